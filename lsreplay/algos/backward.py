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
whichever path runs it. `heads` (lsreplay.replay.heads) say what is scored, the logprob
under the distribution its head names (no default: `logprob_heads(sampling)`); with
several (e.g. logprobs and a critic's values), the loss takes the scores by head name,
{name: nested}, and both paths score and differentiate every head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from lsreplay.algos.weights import NestedLogprobs, NestedScores, loss_and_weights
from lsreplay.replay.backward import BackwardStats, replay_backward
from lsreplay.replay.capture import TreeActivations, capture_tree
from lsreplay.models.distribution import SamplingParams
from lsreplay.replay.heads import LOGPROB, Heads, by_head, logprob_heads
from lsreplay.replay.segments import forward_segments
from lsreplay.tree import RolloutTree

LossFn = Callable[[NestedLogprobs], torch.Tensor]


def naive_scores(model: PreTrainedModel, trees: list[RolloutTree], heads: Heads) -> dict:
    """Every head's per-token scores of every completion, {name: nested}, one full-sequence
    forward per rollout, with grad (when grad is enabled). Keeps every rollout's graph
    alive: a reference, not a memory-efficient path."""
    param = next(model.parameters())
    out = {name: [] for name in heads}
    for tree in trees:
        rows = {name: [] for name in heads}
        for comp in tree.completions:
            if not comp:
                for row in rows.values():
                    row.append(torch.zeros(0, dtype=torch.promote_types(param.dtype, torch.float32),
                                           device=param.device))
                continue
            hidden, _ = forward_segments(model, [tree.prompt_ids + comp], 0, None)
            at = list(range(tree.prompt_len - 1, tree.prompt_len - 1 + len(comp)))
            for name, head in heads.items():
                rows[name].append(head(model, hidden[0], at, comp))
        for name, row in rows.items():
            out[name].append(row)
    return out


def naive_logprobs(model: PreTrainedModel, trees: list[RolloutTree], sampling: SamplingParams) -> NestedLogprobs:
    """Per-token logprobs of every completion under `sampling`'s distribution, per rollout
    (naive_scores of the logprob)."""
    return naive_scores(model, trees, logprob_heads(sampling))[LOGPROB]


def naive_loss_backward(model: PreTrainedModel, trees: list[RolloutTree], loss_fn: LossFn, *,
                        heads: Heads) -> float:
    """loss_fn over per-rollout scores (logprobs, or {name: nested} with several heads),
    backpropagated into `.grad`; returns the loss."""
    scores = {name: [[s.double() for s in row] for row in nested]
              for name, nested in naive_scores(model, trees, heads).items()}
    loss = loss_fn(scores if by_head(heads) else scores[LOGPROB])
    if loss.requires_grad:
        loss.backward()
    return float(loss.detach())


def capture_logprobs(model: PreTrainedModel, trees: list[RolloutTree], keep_kv: bool = True, *,
                     heads: Heads) -> tuple[NestedLogprobs | NestedScores, list[TreeActivations]]:
    """The no-grad caching pass over each tree: per-completion token logprobs (float64, on
    CPU; under the distribution the logprob head names; with several heads, every head's
    scores by name) and the activations (prefix K/V unless keep_kv=False; no hidden states)."""
    acts = []
    for tree in trees:
        acts.append(capture_tree(model, tree, keep_hidden=False, heads=heads, kv_nodes=None if keep_kv else set()))
    return scores_of(trees, acts, heads), acts


def completion_logprobs(trees: list[RolloutTree], acts: list[TreeActivations]) -> NestedLogprobs:
    return [t.completion_values(a.entry_logprobs) for t, a in zip(trees, acts)]


def completion_scores(trees: list[RolloutTree], acts: list[TreeActivations], heads: Heads) -> dict:
    """{head name: per-completion token scores} from the caching pass's entries."""
    return {name: completion_logprobs(trees, acts) if name == LOGPROB else
            [t.completion_values(a.entry_scores[name]) for t, a in zip(trees, acts)] for name in heads}


def scores_of(trees: list[RolloutTree], acts: list[TreeActivations], heads: Heads):
    """What a loss over `heads` takes from the caching pass: scores by head name, or nested
    logprobs for the logprob alone (heads.by_head)."""
    return completion_scores(trees, acts, heads) if by_head(heads) else completion_logprobs(trees, acts)


def activations_kv(acts: list[TreeActivations]):
    """A `replay_backward` prefix_kv source over captured activations (index = tree in batch)."""
    return lambda index, node: acts[index].prefix_kv.get(node.id)


def replay_loss_backward(model: PreTrainedModel, trees: list[RolloutTree], loss_fn: LossFn,
                         activations: list[TreeActivations] | None = None,
                         budget_bytes: int | None = None, *, heads: Heads) -> tuple[float, BackwardStats]:
    """loss_fn's gradient by branch replay, accumulated into `.grad`; returns (loss, stats).

    activations: caching-pass results of *the current weights* for `trees` (captured here
    if None). Scores and prefix K/V of other weights would give another gradient."""
    if activations is None:
        _, activations = capture_logprobs(model, trees, heads=heads)
    scores = scores_of(trees, activations, heads)
    loss, weights = loss_and_weights(loss_fn, scores)
    stats = replay_backward(model, trees, weights, prefix_kv=activations_kv(activations),
                            budget_bytes=budget_bytes, heads=heads)
    return loss, stats
