"""dL/dscore of a loss over nested per-token scores (logprobs, values), by autograd."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

# logprobs[i][j]: 1-D tensor of the token logprobs of completion j of tree i.
NestedLogprobs = list[list[torch.Tensor]]
# Per head name (lsreplay.replay.heads): the nested scores of that head.
NestedScores = Mapping[str, NestedLogprobs]


def loss_and_weights(loss_fn: Callable, logprobs: NestedLogprobs | NestedScores) -> tuple[float, NestedLogprobs | dict]:
    """The loss value at `logprobs` and its gradient with respect to each of them. Given
    scores by head ({name: nested}), loss_fn takes them so and the weights come back so."""
    by_head = isinstance(logprobs, Mapping)
    scores = dict(logprobs) if by_head else {None: logprobs}
    leaves = {name: [[lp.detach().double().requires_grad_() for lp in tree] for tree in nested]
              for name, nested in scores.items()}
    flat = [lp for nested in leaves.values() for tree in nested for lp in tree]
    loss = loss_fn(leaves if by_head else leaves[None])
    grads = torch.autograd.grad(loss, flat, allow_unused=True) if loss.requires_grad else [None] * len(flat)
    it = iter(torch.zeros_like(lp) if g is None else g for lp, g in zip(flat, grads))
    weights = {name: [[next(it) for _ in tree] for tree in nested] for name, nested in leaves.items()}
    return float(loss.detach()), weights if by_head else weights[None]
