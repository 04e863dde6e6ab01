"""The `lsreplay` commands beyond training (cli.py parses them): `plan` (will a config's RL
step fit the devices), `report` (markdown and curves of runs, overlaid) and `generate`
(lossless speculative decoding of a checkpoint with its drafter)."""
