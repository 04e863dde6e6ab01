"""GRPO: group-normalised advantages over a prompt's rollouts, clipped surrogate.

Each prompt's completions form the group. With old logprobs taken from the caching pass
of the same weights, the ratio is 1 at the first optimizer step and the gradient is the
advantage-weighted logprob gradient; the clip matters once the policy has moved.

Aggregations (`loss_agg`), over the per-token losses l_{j,t} of the batch's completions:

- ``token-mean``: sum_{j,t} l_{j,t} / sum_j |o_j| -- every token of the batch counts equally.
- ``seq-mean``: (1/G) sum_j (1/|o_j|) sum_t l_{j,t} -- GRPO as published; a short
  completion's tokens weigh more than a long one's. Empty completions are left out.
- ``seq-mean-token-sum-norm``: sum_{j,t} l_{j,t} / (G * max_tokens) -- Dr. GRPO
  ("Understanding R1-Zero-Like Training", Liu et al. 2025): no per-completion length
  normalisation, a constant denominator instead (the generation budget, `max_tokens`).
  Together with `group_advantages(..., scale=False)` (no std division) this is Dr. GRPO.

Tree leaves as samples. A leaf that ended before a branch point stands for the
`counts[j]` continuations it would have been forked into (copies of itself), so a tree's
leaves stand for G = sum(counts) samples of the policy, each distributed as a flat
rollout. Every statistic here treats a leaf with count n as n identical completions: the
group's mean and std, and each aggregation (its tokens count n times in token-mean, its
sequence mean n times in seq-mean, G in Dr. GRPO's denominator). Counts of None mean 1 each.

Siblings share sampled tokens, so a group mean that includes a leaf's own siblings is
correlated with it, which a flat group's mean is not (beyond the leaf itself). With
`subtrees` given, `group_advantages` gives every leaf the baseline of flat GRPO with that
correlation taken out; see its docstring and docs/algorithms.md, "Tree rollouts as samples".

The functions here are plain torch over nested logprobs; they serve both the replay path
(through `loss_and_weights`) and the per-rollout reference (through autograd).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lsreplay.algos.weights import NestedLogprobs
from lsreplay.core.config import LOSS_AGGS


# counts[i][j]: the samples completion j of tree i stands for; None = 1 each.
NestedCounts = list[list[int]] | None


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6,
                     counts: list[int] | None = None, subtrees: list[int] | None = None) -> torch.Tensor:
    """Advantages of one prompt's completions: reward minus a baseline, over the group's
    std (scale off = Dr. GRPO). Mean and std are over the G = sum(counts) samples.

    subtrees: each leaf's first-level subtree. None: the baseline is the group mean, as in
    flat GRPO (`algo.tree_baseline=group`). Given (`independent`): (1 - 1/G) (r_j - b_j),
    b_j the mean reward over the leaves outside j's own subtree. Flat GRPO's advantage is
    exactly (1 - 1/G) times r_j minus the mean of the other G - 1 samples, all independent of
    j; here b_j averages only leaves independent of j, so the tree's expected gradient is
    flat GRPO's. With each leaf its own subtree the two baselines are the same."""
    rewards = torch.as_tensor(rewards).double()
    n = sample_counts(counts, len(rewards))
    size = n.sum()
    mean = (n * rewards).sum() / size
    if subtrees is None:
        centred = rewards - mean
    else:
        centred = (1 - 1 / size) * (rewards - independent_baselines(rewards, n, subtrees))
    if not scale or size < 2:
        return centred
    std = ((n * (rewards - mean) ** 2).sum() / (size - 1)).sqrt()
    return centred / (std + eps)


def independent_baselines(rewards: torch.Tensor, counts: torch.Tensor, subtrees: list[int]) -> torch.Tensor:
    """Per leaf: the count-weighted mean reward of the leaves outside its first-level subtree."""
    if len(subtrees) != len(rewards):
        raise ValueError(f"{len(subtrees)} subtrees for {len(rewards)} rewards")
    subtrees = torch.as_tensor(subtrees)
    outside = (subtrees[:, None] != subtrees[None, :]).double() * counts[None, :]
    mass = outside.sum(1)
    if (mass == 0).any():
        raise ValueError("every leaf lies in one first-level subtree, so no leaf is independent of another: "
                         "the independent baseline needs rollout.branching[0] >= 2 (or algo.tree_baseline=group)")
    return outside @ rewards / mass


def sample_counts(counts: list[int] | None, leaves: int) -> torch.Tensor:
    """Counts as float64, checked: one positive integer per leaf (None = 1 each)."""
    if counts is None:
        return torch.ones(leaves, dtype=torch.float64)
    if len(counts) != leaves or any(int(c) != c or c < 1 for c in counts):
        raise ValueError(f"counts must be one positive integer per completion ({leaves}), got {list(counts)}")
    return torch.tensor([float(c) for c in counts], dtype=torch.float64)


def aggregate(token_losses: list[torch.Tensor], loss_agg: str = "token-mean",
              max_tokens: int | None = None, counts: list[int] | None = None) -> torch.Tensor:
    """Reduce per-token losses (one 1-D tensor per completion, the whole batch) to a scalar.

    max_tokens: Dr. GRPO's constant denominator (the generation limit); None uses the
    longest completion given, which is only constant if every batch has one that long.
    counts: the samples each completion stands for; it counts as that many copies."""
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    n = sample_counts(counts, len(token_losses)).tolist()
    nonempty = [(t, c) for t, c in zip(token_losses, n) if t.numel()]
    if not nonempty:
        return torch.zeros((), dtype=torch.float64)
    if loss_agg == "token-mean":
        return torch.cat([t * c for t, c in nonempty]).sum() / sum(t.numel() * c for t, c in nonempty)
    if loss_agg == "seq-mean":
        return torch.stack([t.mean() * c for t, c in nonempty]).sum() / sum(c for _, c in nonempty)
    longest = max(t.numel() for t, _ in nonempty)
    if max_tokens is None:
        max_tokens = longest
    elif longest > max_tokens:
        raise ValueError(f"a completion has {longest} tokens, more than max_tokens={max_tokens}: "
                         "Dr. GRPO's denominator must be the generation limit")
    # Every sample counts in G, empty ones too: the denominator does not depend on lengths.
    return torch.cat([t * c for t, c in nonempty]).sum() / (sum(n) * max_tokens)


def flat_counts(counts: NestedCounts, logprobs: list[list]) -> list[int] | None:
    """Nested per-tree counts as one list over the batch's completions, checked per tree."""
    if counts is None:
        return None
    if len(counts) != len(logprobs):
        raise ValueError(f"counts cover {len(counts)} trees, logprobs {len(logprobs)}")
    for i, (ns, lps) in enumerate(zip(counts, logprobs)):
        if len(ns) != len(lps):
            raise ValueError(f"tree {i}: {len(lps)} completions but {len(ns)} counts")
    return [c for ns in counts for c in ns]


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages,
                      clip_eps: float, clip_eps_high: float | None = None) -> torch.Tensor:
    """Per-token -min(r A, clip(r, 1-eps, 1+eps_high) A), r = exp(logp - old logp).

    advantages: a scalar (one per completion) or one per token. clip_eps_high: the upper
    clip (DAPO's clip-higher: a wider one lets unlikely tokens that earn a positive
    advantage grow faster); None = clip_eps, symmetric."""
    adv = torch.as_tensor(advantages).to(logprobs)
    ratio = torch.exp(logprobs - old_logprobs.to(logprobs))
    clipped = ratio.clamp(1 - clip_eps, 1 + (clip_eps if clip_eps_high is None else clip_eps_high))
    return -torch.minimum(ratio * adv, clipped * adv)


# mask[i][j]: whether completion j of tree i is in the policy loss (None: all are).
NestedMask = list[list[bool]] | None


def clipped_policy_loss(logprobs: NestedLogprobs, old_logprobs: NestedLogprobs, advantages,
                        clip_eps: float, loss_agg: str = "token-mean",
                        max_tokens: int | None = None, counts: NestedCounts = None,
                        clip_eps_high: float | None = None, mask: NestedMask = None) -> torch.Tensor:
    """The clipped surrogate of every completion of every tree, aggregated over the batch.

    advantages[i][j]: a scalar, or a 1-D tensor with one advantage per token. mask: the
    completions left out are out of the aggregation too (DAPO's overlong filtering: neither
    their tokens nor their samples count)."""
    if not (len(logprobs) == len(old_logprobs) == len(advantages)):
        raise ValueError(f"logprobs, old logprobs and advantages cover {len(logprobs)}, "
                         f"{len(old_logprobs)} and {len(advantages)} trees")
    token_losses = []
    for i, (lps, olds, advs) in enumerate(zip(logprobs, old_logprobs, advantages)):
        if not (len(lps) == len(olds) == len(advs)):
            raise ValueError(f"tree {i}: {len(lps)} completions, {len(olds)} old logprobs, "
                             f"{len(advs)} advantages")
        for lp, old, a in zip(lps, olds, advs):
            token_losses.append(clipped_surrogate(lp, old, a, clip_eps, clip_eps_high))
    losses, flat = kept(token_losses, flat_counts(counts, logprobs), mask)
    return aggregate(losses, loss_agg, max_tokens, flat)


def kept(token_losses: list[torch.Tensor], counts: list[int] | None, mask: NestedMask):
    """(token losses, counts) of the completions `mask` keeps; all without a mask."""
    if mask is None:
        return token_losses, counts
    keep = [m for row in mask for m in row]
    if len(keep) != len(token_losses):
        raise ValueError(f"mask covers {len(keep)} completions, the loss {len(token_losses)}")
    losses = [t for t, k in zip(token_losses, keep) if k]
    return losses, None if counts is None else [c for c, k in zip(counts, keep) if k]


def clip_fractions(logprobs: NestedLogprobs, old_logprobs: NestedLogprobs, advantages, clip_eps: float,
                   clip_eps_high: float | None = None, mask: NestedMask = None) -> dict:
    """TRL's clip_ratio/*: the share of completion tokens whose ratio exp(logp - old logp)
    the clipped surrogate cuts off, below 1 - eps where the advantage is negative (low),
    above 1 + eps_high where it is positive (high), either (region); and, per completion,
    the least share cut low (low_min) and the most cut high (high_max). At ratio 1 (one
    update per batch, its first minibatch) none is cut. Over the completions `mask` keeps
    (the loss's), as TRL's figures are over its completion mask."""
    high_eps = clip_eps if clip_eps_high is None else clip_eps_high
    low = high = tokens = 0
    per_completion = []  # (share cut low, share cut high) of each non-empty completion
    keep = mask or [[True] * len(lps) for lps in logprobs]
    for lps, olds, advs, kept_row in zip(logprobs, old_logprobs, advantages, keep):
        for lp, old, a, k in zip(lps, olds, advs, kept_row):
            if not k:
                continue
            ratio = torch.exp(lp.detach() - old.to(lp))
            adv = torch.as_tensor(a).to(lp).expand_as(ratio)
            cut_low = int(((ratio < 1 - clip_eps) & (adv < 0)).sum())
            cut_high = int(((ratio > 1 + high_eps) & (adv > 0)).sum())
            low, high, tokens = low + cut_low, high + cut_high, tokens + ratio.numel()
            if ratio.numel():
                per_completion.append((cut_low / ratio.numel(), cut_high / ratio.numel()))
    tokens = max(tokens, 1)
    return {"clip_ratio/region_mean": (low + high) / tokens, "clip_ratio/low_mean": low / tokens,
            "clip_ratio/high_mean": high / tokens,
            "clip_ratio/low_min": min((lo for lo, _ in per_completion), default=0.0),
            "clip_ratio/high_max": max((hi for _, hi in per_completion), default=0.0)}


@dataclass
class GRPOBatch:
    advantages: list[torch.Tensor]  # per tree: one advantage per completion
    old_logprobs: NestedLogprobs  # per tree, per completion: token logprobs before the update
    clip_eps: float = 0.2
    loss_agg: str = "token-mean"  # see LOSS_AGGS
    max_tokens: int | None = None  # seq-mean-token-sum-norm's constant (the generation limit)
    counts: NestedCounts = None  # per tree, per completion: the samples it stands for
    clip_eps_high: float | None = None  # the upper clip (None: clip_eps)
    mask: NestedMask = None  # per tree, per completion: in the loss (None: all)


def grpo_loss(logprobs: NestedLogprobs, batch: GRPOBatch) -> torch.Tensor:
    """Negative clipped surrogate, aggregated over the batch's completion tokens."""
    return clipped_policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.clip_eps,
                               batch.loss_agg, batch.max_tokens, batch.counts, batch.clip_eps_high, batch.mask)


def batch_reward_std(rewards: list[list[float | None]], counts: NestedCounts = None) -> float:
    """The std of every scored sample's reward in the batch (a leaf counted as its samples,
    Bessel-corrected, as TRL's nanstd): what scale_rewards=batch divides advantages by."""
    pairs = [(float(r), n) for rs, ns in zip(rewards, counts or [[1] * len(rs) for rs in rewards])
             for r, n in zip(rs, ns) if r is not None]
    size = sum(n for _, n in pairs)
    if size < 2:
        return 0.0
    mean = sum(r * n for r, n in pairs) / size
    return math.sqrt(sum(n * (r - mean) ** 2 for r, n in pairs) / (size - 1))


def tree_advantages(rewards: list[float | None], scale: str = "group", counts: list[int] | None = None,
                    subtrees: list[int] | None = None, batch_std: float | None = None,
                    eps: float = 1e-6) -> torch.Tensor:
    """group_advantages of one tree with TRL's scale_rewards (group: the group's std; batch:
    `batch_std`, the batch's; none) and TRL's unscorable completions (reward None: no reward
    function applies): left out of the baseline and the std, advantage 0 (TRL >= 1.6). Where
    the scored leaves lie in one first-level subtree, no leaf is independent of another, and
    their baseline is the group mean."""
    keep = [j for j, r in enumerate(rewards) if r is not None]
    out = torch.zeros(len(rewards), dtype=torch.float64)
    if not keep:
        return out
    kept_subtrees = None if subtrees is None else [subtrees[j] for j in keep]
    if kept_subtrees is not None and len(set(kept_subtrees)) < 2:
        kept_subtrees = None
    scored = torch.tensor([float(rewards[j]) for j in keep], dtype=torch.float64)
    centred = group_advantages(scored, scale == "group", eps,
                               None if counts is None else [counts[j] for j in keep], kept_subtrees)
    out[keep] = centred / (batch_std + eps) if scale == "batch" else centred
    return out
