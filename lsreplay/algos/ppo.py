"""PPO's clipped surrogate over trees, and several epochs / minibatches over one batch.

The loss is GRPO's clipped surrogate with advantages given per completion or per token
(GAE from a critic, lsreplay.algos.critic), optionally plus the critic's clipped value
loss (then the loss takes scores by head, {"logprob": ..., "value": ...}) and a KL term.
`ppo_update` makes several optimizer steps on one batch of trees (updates.py): the old
logprobs (and old values) stay those of the first caching pass (the weights that sampled,
or at least preceded, the update); every minibatch is scored at the weights it sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from lsreplay.algos.backward import activations_kv, capture_logprobs
from lsreplay.algos.critic import VALUE, CriticBatch, value_loss
from lsreplay.algos.grpo import NestedCounts, NestedMask, clipped_policy_loss
from lsreplay.algos.kl import kl_loss
from lsreplay.algos.updates import Minibatch, minibatch_updates
from lsreplay.algos.weights import NestedLogprobs
from lsreplay.models.distribution import SamplingParams
from lsreplay.replay.heads import LOGPROB, logprob_heads
from lsreplay.tree import RolloutTree


@dataclass
class PPOBatch:
    advantages: list[list]  # per tree, per completion: a scalar or one advantage per token
    old_logprobs: NestedLogprobs  # per tree, per completion: token logprobs before the update
    clip_eps: float = 0.2
    loss_agg: str = "token-mean"  # see lsreplay.core.config.LOSS_AGGS
    max_tokens: int | None = None
    counts: NestedCounts = None  # per tree, per completion: the samples it stands for (see grpo)
    clip_eps_high: float | None = None  # the upper clip (None: clip_eps)
    mask: NestedMask = None  # per tree, per completion: in the policy and KL terms (None: all)
    ref_logprobs: NestedLogprobs | None = None  # with kl_coef: the KL term's reference
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    critic: CriticBatch | None = None  # with vf_coef: the value loss (scores by head then)
    vf_coef: float = 0.0

    def select(self, idx: list[int]) -> PPOBatch:
        """The batch of trees `idx` (a minibatch)."""
        def pick(nested):
            return None if nested is None else [nested[i] for i in idx]

        critic = None if self.critic is None else replace(
            self.critic, old_values=pick(self.critic.old_values), returns=pick(self.critic.returns),
            counts=pick(self.critic.counts), mask=pick(self.critic.mask))
        return replace(self, advantages=pick(self.advantages), old_logprobs=pick(self.old_logprobs),
                       counts=pick(self.counts), mask=pick(self.mask), ref_logprobs=pick(self.ref_logprobs),
                       critic=critic)


def ppo_loss(scores, batch: PPOBatch) -> torch.Tensor:
    """Negative clipped surrogate aggregated over the batch's completion tokens, plus
    kl_coef x KL and, with a critic, vf_coef x the value loss (`scores` by head then)."""
    logprobs = scores[LOGPROB] if batch.critic is not None else scores
    loss = clipped_policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.clip_eps, batch.loss_agg,
                               batch.max_tokens, batch.counts, batch.clip_eps_high, batch.mask)
    if batch.kl_coef:
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef needs ref_logprobs (see kl.reference_logprobs)")
        loss = loss + batch.kl_coef * kl_loss(logprobs, batch.ref_logprobs, batch.kl_estimator, batch.loss_agg,
                                              batch.max_tokens, batch.counts, batch.mask)
    if batch.critic is not None:
        loss = loss + batch.vf_coef * value_loss(scores[VALUE], batch.critic)
    return loss


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
               advantages: list[list], sampling: SamplingParams, epochs: int = 1, minibatch_trees: int | None = None,
               mode: str = "replay", clip_eps: float = 0.2, loss_agg: str = "token-mean",
               max_tokens: int | None = None, old_logprobs: NestedLogprobs | None = None,
               ref_logprobs: NestedLogprobs | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
               max_grad_norm: float | None = None, generator: torch.Generator | None = None,
               budget_bytes: int | None = None, counts: NestedCounts = None) -> list[float]:
    """`epochs` passes over `trees` in minibatches of `minibatch_trees` trees, one step of a
    plain torch optimizer each; returns each minibatch's loss (at the weights before its step).

    sampling: the distribution the trees' completions were drawn from (temperature, top-k,
    top-p; RAW for the policy's own), under which every logprob of the update is scored: the
    old logprobs, the current ones, and so the ratio. old_logprobs, ref_logprobs: given, of
    the same distribution. old_logprobs: None runs the caching pass now (its activations also serve the first
    minibatch, whose weights they are). ref_logprobs + kl_coef: KL penalty to a reference
    (see kl.reference_logprobs). counts: the samples each leaf stands for (grpo's
    NestedCounts), in both terms. mode "naive" differentiates the same loss per rollout.
    The model must be deterministic (no dropout): the caching pass and the backward must
    see the same function."""
    if mode not in ("replay", "naive"):
        raise ValueError(f"mode must be 'replay' or 'naive', got {mode!r}")
    if len(advantages) != len(trees):
        raise ValueError(f"advantages for {len(advantages)} trees, got {len(trees)} trees")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef needs ref_logprobs (see kl.reference_logprobs)")
    orders = minibatch_orders(len(trees), epochs, minibatch_trees, generator)
    heads, first = logprob_heads(sampling), None
    if old_logprobs is None:
        keep = set(orders[0][0]) if orders and orders[0] and mode == "replay" else set()
        old_logprobs, acts = [], []
        for i, tree in enumerate(trees):  # one tree at a time: only the first minibatch's K/V is kept
            lps, a = capture_logprobs(model, [tree], keep_kv=i in keep, heads=heads)
            old_logprobs += lps
            acts += a
        first = (old_logprobs, activations_kv(acts))
    old_logprobs = [[lp.detach() for lp in row] for row in old_logprobs]
    batch = PPOBatch(advantages=advantages, old_logprobs=old_logprobs, clip_eps=clip_eps, loss_agg=loss_agg,
                     max_tokens=max_tokens, counts=counts, ref_logprobs=ref_logprobs, kl_coef=kl_coef,
                     kl_estimator=kl_estimator)

    def take_step(m: Minibatch) -> None:
        if not math.isfinite(m.loss):
            raise FloatingPointError(f"non-finite PPO loss {m.loss} at minibatch {m.index}")
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)

    def loss_for(idx: list[int]):
        minibatch = batch.select(idx)
        return lambda scores: ppo_loss(scores, minibatch)

    model.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    return [m.loss for m in minibatch_updates(model, trees, loss_for, orders, take_step, mode, heads=heads,
                                              first=first, budget_bytes=budget_bytes)]
