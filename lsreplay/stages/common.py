"""What several stages share: the policy as of a step, and reading a step's trees."""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from lsreplay.algos.overlong import length_penalty
from lsreplay.core.run import Run
from lsreplay.state.resident import RESIDENT
from lsreplay.tree import RolloutTree


def policy_before(run: Run, step: int, device: torch.device | str = "cpu") -> PreTrainedModel:
    """The policy that acts in `step` (after updates 0 .. step - 1) on `device`: the copy
    this process holds, else loaded (lsreplay.state.resident)."""
    return RESIDENT.policy(run, step, torch.device(device))


class StateClock:
    """Seconds a stage spends getting and saving state rather than computing (`state_seconds`)."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, get, *args):
        start = time.perf_counter()
        try:
            return get(*args)
        finally:
            self.seconds += time.perf_counter() - start


def load_trees(run: Run, step: int) -> tuple[list[dict], list[RolloutTree]]:
    """The step's rollout records and their tries."""
    key = run.key(step, "trees.json")
    with run.reading(step, "trees"):
        records = run.store.read_json(key, sha256=run.sha256(run.manifest(step, "trees"), key))["trees"]
    return records, [RolloutTree.from_sequences(r["prompt_ids"], r["completions"]) for r in records]


def leaf_counts(record: dict) -> list[int]:
    """The samples each leaf of a tree record stands for; records written before leaves
    carried counts: 1 each."""
    return record.get("counts", [1] * len(record["completions"]))


def leaf_subtrees(record: dict) -> list[int]:
    """Each leaf's first-level subtree (leaves of different ones share no sampled token).
    Records written before leaves carried paths: each leaf its own, with which the
    independent baseline is the plain group mean (what those runs trained with)."""
    if "paths" not in record:
        return list(range(len(record["completions"])))
    return [path[0] for path in record["paths"]]


def training_rewards(cfg, record: dict) -> list[float | None]:
    """The rewards the update learns from: the reward function's, less DAPO's soft overlong
    penalty with algo.overlong=penalty (lsreplay.algos.overlong); None where no reward
    function applies (TRL's unscorable completions)."""
    a = cfg.algo
    if a.overlong != "penalty":
        return list(record["rewards"])
    return [None if r is None else r - length_penalty(len(c), cfg.rollout.max_new_tokens, a.overlong_buffer,
                                                      a.overlong_penalty)
            for r, c in zip(record["rewards"], record["completions"])]


def all_alike(rewards: list[float | None]) -> bool:
    """Whether every scored leaf of a tree got the same reward: no GRPO gradient, no DPO pair."""
    scored = [r for r in rewards if r is not None]
    return not scored or max(scored) == min(scored)
