"""Optimizer updates over one batch of trees: minibatches (of whole trees), each scored at
the weights it sees.

After every optimizer step the prefix activations and current scores of the batch are
stale, so each minibatch after the first runs the caching pass again for the current
weights before its backward; the first one uses the caching pass that gave the old scores
(the pipeline's, with its stored K/V), whose weights it still has. One minibatch over all
trees is one update (GRPO, DPO); PPO makes several (lsreplay.algos.ppo).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedModel

from lsreplay.algos.backward import activations_kv, capture_logprobs
from lsreplay.algos.weights import NestedLogprobs, loss_and_weights
from lsreplay.replay.backward import BackwardStats, PrefixKVSource, naive_backward, replay_backward
from lsreplay.replay.heads import Heads
from lsreplay.tree import RolloutTree


@dataclass
class Minibatch:
    """What one optimizer update of `minibatch_updates` computed, before its step."""

    index: int  # 0, 1, ... over all epochs
    trees: list[int]
    loss: float
    scores: dict | NestedLogprobs  # the current scores the loss was evaluated at
    stats: BackwardStats


# The first minibatch's caching pass: (scores of all trees, a prefix K/V source over all trees).
FirstPass = tuple[dict | NestedLogprobs, PrefixKVSource | None]
# A caching pass at the current weights: trees -> (their scores, a prefix K/V source over them).
Capture = Callable[[list[RolloutTree]], tuple[dict | NestedLogprobs, PrefixKVSource | None]]


def minibatch_updates(model: PreTrainedModel, trees: list[RolloutTree], loss_for: Callable[[list[int]], Callable],
                      orders: list[list[list[int]]], take_step: Callable[[Minibatch], None],
                      mode: str = "replay", *, heads: Heads, first: FirstPass | None = None,
                      budget_bytes: int | None = None, join_below: int = 0, offload_prefix: bool = False,
                      capture: Capture | None = None) -> list[Minibatch]:
    """For every minibatch of `orders` (per epoch, lists of tree indices): the scores of its
    trees at the current weights (the `first` pass's for the first minibatch, whose weights
    it has; a caching pass now for the others), its loss `loss_for(indices)` and the loss's
    per-head weights, the backward into `.grad` (replay or the per-rollout baseline), then
    `take_step` (clip, optimizer step, zero the grads). heads: what the loss scores (the
    logprob under the distribution the rollouts were drawn from, a critic's value).
    capture: the caching pass of the later minibatches (default: the tree pass, K/V kept in
    memory for replay). budget_bytes, join_below, offload_prefix: as for replay_backward.
    Returns every minibatch's record."""
    if mode not in ("replay", "naive"):
        raise ValueError(f"mode must be 'replay' or 'naive', got {mode!r}")
    if capture is None:
        def capture(sub: list[RolloutTree]):
            scores, acts = capture_logprobs(model, sub, keep_kv=mode == "replay", heads=heads)
            return scores, activations_kv(acts)
    done = []
    for idx in (m for epoch in orders for m in epoch):
        sub = [trees[i] for i in idx]
        if not done and first is not None:
            scores, kv = first
            scores = _select(scores, idx)
            kv = None if kv is None else (lambda j, node, kv=kv, idx=idx: kv(idx[j], node))
        else:
            scores, kv = capture(sub)
        loss, weights = loss_and_weights(loss_for(idx), scores)
        if mode == "replay":
            stats = replay_backward(model, sub, weights, prefix_kv=kv, budget_bytes=budget_bytes,
                                    join_below=join_below, heads=heads, offload_prefix=offload_prefix)
        else:
            stats = naive_backward(model, sub, weights, heads=heads)
        done.append(Minibatch(len(done), idx, loss, scores, stats))
        take_step(done[-1])
    return done


def _select(scores, idx: list[int]):
    if isinstance(scores, dict):
        return {name: [nested[i] for i in idx] for name, nested in scores.items()}
    return [scores[i] for i in idx]
