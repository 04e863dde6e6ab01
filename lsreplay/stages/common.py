"""What several stages share: the policy as of a step, and reading a step's trees."""

from __future__ import annotations

from transformers import PreTrainedModel

from lsreplay.checkpoint import load_module
from lsreplay.models import load_model
from lsreplay.run import Run
from lsreplay.tree import RolloutTree


def policy_before(run: Run, step: int, trainable: bool = False) -> PreTrainedModel:
    """The policy that acts in `step`: the base model, or the checkpoint of step - 1."""
    model = load_model(run.cfg.model, trainable=trainable)
    if step > 0:
        load_module(run.store, run.checkpoint("policy", step - 1), model)
    return model


def load_trees(run: Run, step: int) -> tuple[list[dict], list[RolloutTree]]:
    """The step's rollout records and their tries."""
    records = run.store.read_json(run.key(step, "trees.json"))["trees"]
    return records, [RolloutTree.from_sequences(r["prompt_ids"], r["completions"]) for r in records]
