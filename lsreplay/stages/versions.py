"""Policy versions and staleness: which policy samples a step's rollouts, and how old a tree
is when the update trains on it (rollout.max_staleness; docs/async.md).

Version v is the policy after updates 0 .. v - 1: the one that acts in step v of a
synchronous run. With max_staleness K the rollouts of step t are sampled by version
max(0, t - K), the newest one the flow can give them when it submits them: it submits them
as soon as update t - K - 1 has ended (flows/train.py), while the updates of steps t - K ..
t - 1 are still to run. The version is fixed by the step and K, not by timing, so a resumed
run samples what an uninterrupted one sampled (bit for bit with the HF engine).

Every tree's record says which version drew it (`policy_version`). Update t trains step t's
trees from version t, so a tree is t - policy_version updates stale there. One more than K
stale (a record written under a larger K, before a resume with --force lowered it, or one
forged) is dropped: left out of the loss and its denominators, as dynamic sampling leaves a
tree out, and counted (trees_stale_dropped). Records written before trees carried versions
were sampled by the policy of their own step.
"""

from __future__ import annotations

import math

import torch


def sampling_version(cfg, step: int) -> int:
    """The policy version that samples step `step`'s rollouts."""
    return max(0, step - cfg.rollout.max_staleness)


def stamp_staleness(records: list[dict], step: int) -> list[dict]:
    """Each record, as read for step `step`'s update, with how many updates stale it is
    there (`staleness`: not stored, a property of the record and the step that reads it)."""
    for record in records:
        record["staleness"] = step - record.get("policy_version", step)
    return records


def too_stale(cfg, record: dict) -> bool:
    """Whether a record read by stamp_staleness is older than rollout.max_staleness allows."""
    return record.get("staleness", 0) > cfg.rollout.max_staleness


def staleness_figures(cfg, records: list[dict]) -> dict:
    """What a step's update trained on: the trees dropped as too stale, and the staleness of
    the others (mean and max over trees). Nothing for a synchronous run's fresh trees."""
    if not cfg.rollout.max_staleness and not any(r.get("staleness", 0) for r in records):
        return {}
    kept = [r.get("staleness", 0) for r in records if not too_stale(cfg, r)]
    return {"trees_stale_dropped": len(records) - len(kept), "staleness_mean": sum(kept) / max(len(kept), 1),
            "staleness_max": max(kept, default=0)}


def off_policy_figures(records: list[dict], proximal: list[list[torch.Tensor]], behaviour: list[list[torch.Tensor]],
                       cap: float, keep: list[bool], mask: list[list[bool]] | None) -> dict:
    """The behaviour ratio w = p_proximal / p_behaviour of the loss's tokens, per staleness k
    of the trees `keep` marks (in the loss, and scored by the caching pass), under
    off_policy/staleness{k}/ (ratio_figures)."""
    by_staleness: dict[int, list[torch.Tensor]] = {}
    for i, record in enumerate(records):
        for j, (p, b) in enumerate(zip(proximal[i], behaviour[i])):
            if keep[i] and (mask is None or mask[i][j]) and p.numel():
                by_staleness.setdefault(record.get("staleness", 0), []).append(p.double() - b.double())
    return {f"off_policy/staleness{k}/{name}": value for k, log_ratios in sorted(by_staleness.items())
            for name, value in ratio_figures(log_ratios, cap).items()}


def ratio_figures(log_ratios: list[torch.Tensor], cap: float) -> dict[str, float]:
    """Of completions' per-token log w: the mean |log w| (logprob_gap); truncated importance
    sampling's mean weight min(w, cap) and share of tokens it caps (tis_weight_mean,
    tis_capped_fraction); masked importance sampling's share of tokens with w outside [1 / cap,
    cap], and of completions holding one (verl's token rejection at its default lower bound:
    mis_masked_fraction, mis_seq_masked_fraction)."""
    flat, bound = torch.cat(log_ratios), math.log(cap)
    return {"logprob_gap": float(flat.abs().mean()), "tis_weight_mean": float(flat.exp().clamp(max=cap).mean()),
            "tis_capped_fraction": float((flat.exp() >= cap).double().mean()),
            "mis_masked_fraction": float((flat.abs() > bound).double().mean()),
            "mis_seq_masked_fraction": sum(bool((r.abs() > bound).any()) for r in log_ratios) / len(log_ratios)}
