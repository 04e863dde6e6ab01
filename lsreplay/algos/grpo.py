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

The functions here are plain torch over nested logprobs; they serve both the replay path
(through `loss_and_weights`) and the per-rollout reference (through autograd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lsreplay.algos.weights import NestedLogprobs

LOSS_AGGS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / std over one prompt's completions; std division off = Dr. GRPO."""
    rewards = torch.as_tensor(rewards).double()
    centred = rewards - rewards.mean()
    if not scale or rewards.numel() < 2:
        return centred
    return centred / (rewards.std() + eps)


def aggregate(token_losses: list[torch.Tensor], loss_agg: str = "token-mean",
              max_tokens: int | None = None) -> torch.Tensor:
    """Reduce per-token losses (one 1-D tensor per completion, the whole batch) to a scalar.

    max_tokens: Dr. GRPO's constant denominator (the generation limit); None uses the
    longest completion given, which is only constant if every batch has one that long."""
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    nonempty = [t for t in token_losses if t.numel()]
    if not nonempty:
        return torch.zeros((), dtype=torch.float64)
    if loss_agg == "token-mean":
        return torch.cat(nonempty).sum() / sum(t.numel() for t in nonempty)
    if loss_agg == "seq-mean":
        return torch.stack([t.mean() for t in nonempty]).mean()
    longest = max(t.numel() for t in nonempty)
    if max_tokens is None:
        max_tokens = longest
    elif longest > max_tokens:
        raise ValueError(f"a completion has {longest} tokens, more than max_tokens={max_tokens}: "
                         "Dr. GRPO's denominator must be the generation limit")
    # Every completion counts in G, empty ones too: the denominator does not depend on lengths.
    return torch.cat(nonempty).sum() / (len(token_losses) * max_tokens)


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages,
                      clip_eps: float) -> torch.Tensor:
    """Per-token -min(r A, clip(r, 1-eps, 1+eps) A), r = exp(logp - old logp).

    advantages: a scalar (one per completion) or one per token."""
    adv = torch.as_tensor(advantages).to(logprobs)
    ratio = torch.exp(logprobs - old_logprobs.to(logprobs))
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    return -torch.minimum(ratio * adv, clipped * adv)


def clipped_policy_loss(logprobs: NestedLogprobs, old_logprobs: NestedLogprobs, advantages,
                        clip_eps: float, loss_agg: str = "token-mean",
                        max_tokens: int | None = None) -> torch.Tensor:
    """The clipped surrogate of every completion of every tree, aggregated over the batch.

    advantages[i][j]: a scalar, or a 1-D tensor with one advantage per token."""
    if not (len(logprobs) == len(old_logprobs) == len(advantages)):
        raise ValueError(f"logprobs, old logprobs and advantages cover {len(logprobs)}, "
                         f"{len(old_logprobs)} and {len(advantages)} trees")
    token_losses = []
    for i, (lps, olds, advs) in enumerate(zip(logprobs, old_logprobs, advantages)):
        if not (len(lps) == len(olds) == len(advs)):
            raise ValueError(f"tree {i}: {len(lps)} completions, {len(olds)} old logprobs, "
                             f"{len(advs)} advantages")
        for lp, old, a in zip(lps, olds, advs):
            token_losses.append(clipped_surrogate(lp, old, a, clip_eps))
    return aggregate(token_losses, loss_agg, max_tokens)


@dataclass
class GRPOBatch:
    advantages: list[torch.Tensor]  # per tree: one advantage per completion
    old_logprobs: NestedLogprobs  # per tree, per completion: token logprobs before the update
    clip_eps: float = 0.2
    loss_agg: str = "token-mean"  # see LOSS_AGGS
    max_tokens: int | None = None  # seq-mean-token-sum-norm's constant (the generation limit)


def grpo_loss(logprobs: NestedLogprobs, batch: GRPOBatch) -> torch.Tensor:
    """Negative clipped surrogate, aggregated over the batch's completion tokens."""
    return clipped_policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.clip_eps,
                               batch.loss_agg, batch.max_tokens)
