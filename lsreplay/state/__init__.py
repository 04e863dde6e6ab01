"""State and checkpoints: the formats a checkpoint is written in, when and how the run
writes, rewinds and exports them (in the background), and the models, optimizer state and
engines a process holds between stages."""
