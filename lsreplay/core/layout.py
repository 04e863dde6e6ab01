"""Where a run keeps things in its store, at the bottom of the library's layers: the stage
names of a step, a checkpoint's folder and its weights file, and the error for a checkpoint
that is not there as it should be. The store's fault hooks (lsreplay.core.faults) read them,
so they cannot live with the run (lsreplay.core.run) or the checkpoints (lsreplay.state.checkpoint),
which use the store."""

# A step's stages, in the order a step runs them.
STAGES = ("prompts", "trees", "prefixes", "policy", "drafter")

# The weights file of a checkpoint folder (the HF model's tensors, nothing else).
MODEL_FILE = "model.safetensors"

CHECKPOINTS = "checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, or does not fit what it is loaded into."""


def checkpoint_folder(kind: str, step: int) -> str:
    """The store prefix of checkpoint `kind` (policy, drafter) of `step`."""
    return f"{CHECKPOINTS}/{kind}/step_{step:04d}"
