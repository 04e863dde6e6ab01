"""Differentiating a loss over trees: the per-rollout reference, and the replay path.

A loss is one function of nested per-token logprobs (`logprobs[i][j]`: completion j of
tree i). Two ways to get its parameter gradient, which must agree:

- naive (`naive_loss_backward`): run every completion's full sequence (prompt +
  completion) through the model with grad, evaluate the loss on those logprobs and
  backpropagate through everything. Every loss is checked against this.
- replay (`replay_loss_backward`): a no-grad caching pass over each tree gives every
  token's logprob and the branching nodes' K/V; autograd over the loss alone gives
  dL/dlogp per token; `replay_backward` turns those weights into the parameter gradient,
  replaying the cached prefix K/V.

Both evaluate the loss on float64 logprobs, so the loss function sees the same precision
whichever path runs it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from lsreplay.algos.weights import NestedLogprobs, loss_and_weights
from lsreplay.replay.backward import BackwardStats, replay_backward
from lsreplay.replay.capture import TreeActivations, capture_tree
from lsreplay.replay.segments import forward_segments, target_logprobs
from lsreplay.tree import RolloutTree

LossFn = Callable[[NestedLogprobs], torch.Tensor]


def naive_logprobs(model: PreTrainedModel, trees: list[RolloutTree]) -> NestedLogprobs:
    """Per-token logprobs of every completion, one full-sequence forward per rollout, with
    grad (when grad is enabled). Keeps every rollout's graph alive: a reference, not a
    memory-efficient path."""
    out = []
    for tree in trees:
        row = []
        for comp in tree.completions:
            if not comp:
                dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
                row.append(torch.zeros(0, dtype=dtype, device=next(model.parameters()).device))
                continue
            hidden, _ = forward_segments(model, [tree.prompt_ids + comp], 0, None)
            at = range(tree.prompt_len - 1, tree.prompt_len - 1 + len(comp))
            row.append(target_logprobs(model, hidden[0], list(at), comp))
        out.append(row)
    return out


def naive_loss_backward(model: PreTrainedModel, trees: list[RolloutTree], loss_fn: LossFn) -> float:
    """loss_fn over per-rollout logprobs, backpropagated into `.grad`; returns the loss."""
    logprobs = [[lp.double() for lp in row] for row in naive_logprobs(model, trees)]
    loss = loss_fn(logprobs)
    if loss.requires_grad:
        loss.backward()
    return float(loss.detach())


def capture_logprobs(model: PreTrainedModel, trees: list[RolloutTree],
                     keep_kv: bool = True) -> tuple[NestedLogprobs, list[TreeActivations]]:
    """The no-grad caching pass over each tree: per-completion token logprobs (float64,
    on CPU) and the activations (prefix K/V unless keep_kv=False; no hidden states)."""
    acts = []
    for tree in trees:
        a = capture_tree(model, tree, keep_hidden=False)
        if not keep_kv:
            a.prefix_kv = {}
        acts.append(a)
    return completion_logprobs(trees, acts), acts


def completion_logprobs(trees: list[RolloutTree], acts: list[TreeActivations]) -> NestedLogprobs:
    return [t.completion_values(a.entry_logprobs) for t, a in zip(trees, acts)]


def activations_kv(acts: list[TreeActivations]):
    """A `replay_backward` prefix_kv source over captured activations (index = tree in batch)."""
    return lambda index, node: acts[index].prefix_kv.get(node.id)


def replay_loss_backward(model: PreTrainedModel, trees: list[RolloutTree], loss_fn: LossFn,
                         activations: list[TreeActivations] | None = None,
                         budget_bytes: int | None = None) -> tuple[float, BackwardStats]:
    """loss_fn's gradient by branch replay, accumulated into `.grad`; returns (loss, stats).

    activations: caching-pass results of *the current weights* for `trees` (captured here
    if None). Logprobs and prefix K/V of other weights would give another gradient."""
    if activations is None:
        _, activations = capture_logprobs(model, trees)
    loss, weights = loss_and_weights(loss_fn, completion_logprobs(trees, activations))
    stats = replay_backward(model, trees, weights, prefix_kv=activations_kv(activations),
                            budget_bytes=budget_bytes)
    return loss, stats
