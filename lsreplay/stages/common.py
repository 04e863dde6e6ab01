"""What several stages share: the policy as of a step, and reading a step's trees."""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from lsreplay.algos.critic import critic_heads
from lsreplay.algos.overlong import length_penalty
from lsreplay.core.config import ConfigError
from lsreplay.core.run import Run
from lsreplay.data.preferences import offline
from lsreplay.models.distribution import RAW, SamplingParams
from lsreplay.replay.heads import Heads, logprob_heads
from lsreplay.stages.versions import stamp_staleness, too_stale
from lsreplay.state.resident import RESIDENT
from lsreplay.tree import RolloutTree


def policy_before(run: Run, step: int, device: torch.device | str = "cpu") -> PreTrainedModel:
    """The policy that acts in `step` (after updates 0 .. step - 1) on `device`: the copy
    this process holds, else loaded (lsreplay.state.resident)."""
    return RESIDENT.policy(run, step, torch.device(device))


def sampled_as(cfg) -> SamplingParams:
    """The distribution the step's completions were drawn from, and so the one every
    logprob of the step is scored under (behaviour, old, reference, the update's): the
    rollouts' temperature, top-k and top-p. A preference dataset's answers were drawn by
    nothing here: offline DPO scores the policy's own (temperature 1), as TRL's DPOTrainer does."""
    if offline(cfg):
        return RAW
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def policy_heads(cfg) -> Heads:
    """What the update scores at every entry: the logprob under `sampled_as`, and a critic's value."""
    return critic_heads(sampled_as(cfg)) if cfg.algo.critic else logprob_heads(sampled_as(cfg))


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
    """The step's rollout records, in prompt order, each with its staleness in this step's
    update (stages.versions), and their tries: from the shard files the trees stage's
    manifest lists (a run of before, from its one trees.json)."""
    files = [(entry, "trees") for entry in run.manifest(step, "trees")["files"]]
    records = stamp_staleness(records_in_prompt_order(run, step, files), step)
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


def dpo_rewards(cfg, record: dict) -> list[float | None]:
    """The training rewards DPO pairs a tree's leaves by: None (in no pair, as a leaf no
    reward function applies to) for an answer cut at the limit under algo.overlong=mask,
    which leaves it out of every loss."""
    rewards = training_rewards(cfg, record)
    if cfg.algo.overlong != "mask":
        return rewards
    return [r if finished else None for r, finished in zip(rewards, record["finished"])]


def all_alike(rewards: list[float | None]) -> bool:
    """Whether every scored leaf of a tree got the same reward: no GRPO gradient, no DPO pair."""
    scored = [r for r in rewards if r is not None]
    return not scored or max(scored) == min(scored)


def filter_values(cfg, record: dict) -> list:
    """What dynamic sampling judges a tree's leaves alike on (algo.dynamic_sampling_metric):
    the reward as the reward functions gave it (DAPO's accuracy), the training reward, or
    one reward function's values."""
    metric = cfg.algo.dynamic_sampling_metric
    if metric == "reward":
        return list(record["rewards"])
    if metric == "training_reward":
        return training_rewards(cfg, record)
    name = metric.removeprefix("rewards/")
    functions = record.get("reward_functions", {})
    if name not in functions:
        raise ConfigError(f"algo.dynamic_sampling_metric={metric}: no reward function is named {name!r}; the run's "
                          f"are {sorted(functions)} (rewards/NAME as the metrics name them), or use reward")
    return list(functions[name])


def trains_nothing(cfg, record: dict) -> bool:
    """Whether every loss weight of a tree is zero whatever the policy scores, so that
    neither the caching pass nor replay has anything to do for it: the loss leaves it out
    (too stale, or dynamic sampling), masks every answer (algo.overlong=mask), DPO finds no
    pair in it (of the answers the mask keeps), or the clipped surrogate is all it trains (no
    KL term, no critic) and its leaves' training rewards are all alike, so that every
    advantage is 0."""
    a = cfg.algo
    if too_stale(cfg, record) or (a.dynamic_sampling and all_alike(filter_values(cfg, record))):
        return True
    if a.name == "dpo":
        return all_alike(dpo_rewards(cfg, record))
    alike = all_alike(training_rewards(cfg, record))
    if a.overlong == "mask" and not any(record["finished"]):
        return True
    return alike and a.kl_coef == 0 and not a.critic


def left_out(cfg, records: list[dict]) -> list[bool]:
    """Per tree: whether the loss leaves it out, counting in no term and no denominator: a
    tree older than rollout.max_staleness allows (stages.versions), and with dynamic
    sampling, which keeps only trees whose leaves differ on its metric (DAPO), one still all
    alike when the draws ran out."""
    dynamic = cfg.algo.dynamic_sampling
    return [too_stale(cfg, r) or (dynamic and all_alike(filter_values(cfg, r))) for r in records]
