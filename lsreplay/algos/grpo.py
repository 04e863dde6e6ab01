"""GRPO: group-normalised advantages over a prompt's rollouts, clipped surrogate.

Each prompt's completions form the group. With old logprobs taken from the caching pass
of the same weights, the ratio is 1 at the first optimizer step and the gradient is the
advantage-weighted logprob gradient; the clip matters once the policy has moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lsreplay.algos.weights import NestedLogprobs


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / std over one prompt's completions; std division off = Dr. GRPO."""
    rewards = rewards.double()
    centred = rewards - rewards.mean()
    if not scale or rewards.numel() < 2:
        return centred
    return centred / (rewards.std() + eps)


@dataclass
class GRPOBatch:
    advantages: list[torch.Tensor]  # per tree: one advantage per completion
    old_logprobs: NestedLogprobs  # per tree, per completion: token logprobs before the update
    clip_eps: float = 0.2
    loss_agg: str = "token-mean"  # or "seq-mean"


def grpo_loss(logprobs: NestedLogprobs, batch: GRPOBatch) -> torch.Tensor:
    """Negative clipped surrogate, aggregated over the batch's completion tokens."""
    per_completion, counts = [], []
    for lps, olds, adv in zip(logprobs, batch.old_logprobs, batch.advantages):
        for lp, old, a in zip(lps, olds, adv):
            if lp.numel() == 0:
                continue
            ratio = torch.exp(lp - old.to(lp))
            clipped = ratio.clamp(1 - batch.clip_eps, 1 + batch.clip_eps)
            token_loss = -torch.minimum(ratio * a, clipped * a)
            per_completion.append(token_loss.sum() if batch.loss_agg == "token-mean" else token_loss.mean())
            counts.append(lp.numel())
    if not per_completion:
        return torch.zeros((), dtype=torch.float64)
    total = torch.stack(per_completion).sum()
    return total / (sum(counts) if batch.loss_agg == "token-mean" else len(counts))
