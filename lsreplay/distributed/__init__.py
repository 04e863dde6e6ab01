"""Beyond one process: data-parallel (and FSDP2) ranks of the replay backward, and the hosts
stages run on (the flow's process, or one Ray actor per pool device)."""
