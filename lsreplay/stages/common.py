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
    """The step's rollout records, in prompt order, and their tries: from the shard files the
    trees stage's manifest lists (a run of before, from its one trees.json)."""
    files = [(entry, "trees") for entry in run.manifest(step, "trees")["files"]]
    records = records_in_prompt_order(run, step, files)
    return records, [RolloutTree.from_sequences(r["prompt_ids"], r["completions"]) for r in records]


def records_in_prompt_order(run: Run, step: int, files: list[tuple[dict, str]]) -> list[dict]:
    """The tree records in rollout shard files, each entry given with the stage whose output
    it is (InputCorrupt names that stage), in the order of the step's prompts."""
    by_prompt: dict[int, dict] = {}
    for entry, stage in files:
        with run.reading(step, stage):
            stored = run.store.read_json(entry["key"], sha256=entry["sha256"])
        by_prompt.update(zip(stored.get("prompt_indices", range(len(stored["trees"]))), stored["trees"]))
    return [by_prompt[i] for i in sorted(by_prompt)]


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


def training_rewards(cfg, record: dict) -> list[float]:
    """The rewards the update learns from: the reward function's, less DAPO's soft overlong
    penalty with algo.overlong=penalty (lsreplay.algos.overlong)."""
    a = cfg.algo
    if a.overlong != "penalty":
        return list(record["rewards"])
    return [r - length_penalty(len(c), cfg.rollout.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
            for r, c in zip(record["rewards"], record["completions"])]


def all_alike(rewards: list[float]) -> bool:
    """Whether every leaf of a tree got the same reward: no GRPO gradient, no DPO pair."""
    return max(rewards) == min(rewards)
