"""PPO's clipped surrogate over trees, and several epochs / minibatches over one batch.

The loss is GRPO's clipped surrogate with advantages given per completion or per token
(e.g. GAE from a value model). `ppo_update` makes several optimizer steps on one batch of
trees. The old logprobs stay those of the first caching pass (the weights that sampled,
or at least preceded, the update). After every optimizer step the prefix activations and
current logprobs are stale, so each minibatch runs the caching pass again for the current
weights before its replay backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from lsreplay.algos.grpo import NestedCounts, clipped_policy_loss
from lsreplay.algos.kl import with_kl
from lsreplay.algos.backward import capture_logprobs, naive_loss_backward, replay_loss_backward
from lsreplay.algos.weights import NestedLogprobs
from lsreplay.tree import RolloutTree


@dataclass
class PPOBatch:
    advantages: list[list]  # per tree, per completion: a scalar or one advantage per token
    old_logprobs: NestedLogprobs  # per tree, per completion: token logprobs before the update
    clip_eps: float = 0.2
    loss_agg: str = "token-mean"  # see grpo.LOSS_AGGS
    max_tokens: int | None = None
    counts: NestedCounts = None  # per tree, per completion: the samples it stands for (see grpo)


def ppo_loss(logprobs: NestedLogprobs, batch: PPOBatch) -> torch.Tensor:
    """Negative clipped surrogate, aggregated over the batch's completion tokens."""
    return clipped_policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.clip_eps,
                               batch.loss_agg, batch.max_tokens, batch.counts)


def minibatch_orders(num_trees: int, epochs: int, minibatch_trees: int | None,
                     generator: torch.Generator | None = None) -> list[list[list[int]]]:
    """Per epoch, the tree indices of each minibatch (shuffled per epoch if a generator is given)."""
    size = minibatch_trees or num_trees
    if size < 1 or epochs < 0:
        raise ValueError(f"need minibatch_trees >= 1 and epochs >= 0, got {minibatch_trees} and {epochs}")
    out = []
    for _ in range(epochs):
        order = list(range(num_trees)) if generator is None else torch.randperm(num_trees, generator=generator).tolist()
        out.append([order[s : s + size] for s in range(0, num_trees, size)])
    return out


def ppo_update(model: PreTrainedModel, optimizer: torch.optim.Optimizer, trees: list[RolloutTree],
               advantages: list[list], epochs: int = 1, minibatch_trees: int | None = None,
               mode: str = "replay", clip_eps: float = 0.2, loss_agg: str = "token-mean",
               max_tokens: int | None = None, old_logprobs: NestedLogprobs | None = None,
               ref_logprobs: NestedLogprobs | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
               max_grad_norm: float | None = None, generator: torch.Generator | None = None,
               budget_bytes: int | None = None, counts: NestedCounts = None) -> list[float]:
    """`epochs` passes over `trees` in minibatches of `minibatch_trees` trees, one optimizer
    step each; returns each minibatch's loss (at the weights before its step).

    old_logprobs: None runs the caching pass now (its activations also serve the first
    minibatch, whose weights they are). ref_logprobs + kl_coef: KL penalty to a reference
    (see kl.reference_logprobs). counts: the samples each leaf stands for (grpo's
    NestedCounts), in both terms. mode "naive" differentiates the same loss per rollout.
    The model must be deterministic (no dropout): the caching pass and the backward must
    see the same function."""
    if mode not in ("replay", "naive"):
        raise ValueError(f"mode must be 'replay' or 'naive', got {mode!r}")
    if len(advantages) != len(trees):
        raise ValueError(f"advantages for {len(advantages)} trees, got {len(trees)} trees")
    orders = minibatch_orders(len(trees), epochs, minibatch_trees, generator)
    fresh = None  # activations valid for the current weights (until the next optimizer step)
    if old_logprobs is None:
        first = set(orders[0][0]) if orders and orders[0] and mode == "replay" else set()
        old_logprobs, acts = [], []
        for i, tree in enumerate(trees):  # one tree at a time: only the first minibatch's K/V is kept
            lps, a = capture_logprobs(model, [tree], keep_kv=i in first)
            old_logprobs += lps
            acts += a
        fresh = acts if first else None
    old_logprobs = [[lp.detach() for lp in row] for row in old_logprobs]

    losses = []
    for epoch in orders:
        for idx in epoch:
            sub = [trees[i] for i in idx]
            sub_counts = None if counts is None else [counts[i] for i in idx]
            batch = PPOBatch(advantages=[advantages[i] for i in idx], old_logprobs=[old_logprobs[i] for i in idx],
                             clip_eps=clip_eps, loss_agg=loss_agg, max_tokens=max_tokens, counts=sub_counts)

            def loss_fn(lp, batch=batch):
                return ppo_loss(lp, batch)

            if kl_coef:
                if ref_logprobs is None:
                    raise ValueError("kl_coef needs ref_logprobs (see kl.reference_logprobs)")
                loss_fn = with_kl(loss_fn, [ref_logprobs[i] for i in idx], kl_coef, kl_estimator, loss_agg, max_tokens,
                                  sub_counts)
            model.zero_grad(set_to_none=True)
            optimizer.zero_grad(set_to_none=True)
            if mode == "replay":
                acts = [fresh[i] for i in idx] if fresh is not None else None  # None: capture now
                loss, _ = replay_loss_backward(model, sub, loss_fn, activations=acts, budget_bytes=budget_bytes)
            else:
                loss = naive_loss_backward(model, sub, loss_fn)
            fresh = None  # the step below makes every cached activation stale
            if not math.isfinite(loss):
                raise FloatingPointError(f"non-finite PPO loss {loss} at minibatch {len(losses)}")
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            losses.append(loss)
    return losses
