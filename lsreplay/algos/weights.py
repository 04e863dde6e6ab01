"""dL/dlogp of a loss over nested per-token logprobs, by autograd."""

from __future__ import annotations

from collections.abc import Callable

import torch

# logprobs[i][j]: 1-D tensor of the token logprobs of completion j of tree i.
NestedLogprobs = list[list[torch.Tensor]]


def loss_and_weights(loss_fn: Callable[[NestedLogprobs], torch.Tensor],
                     logprobs: NestedLogprobs) -> tuple[float, NestedLogprobs]:
    """The loss value at `logprobs` and its gradient with respect to each of them."""
    leaves = [[lp.detach().double().requires_grad_() for lp in tree] for tree in logprobs]
    flat = [lp for tree in leaves for lp in tree]
    loss = loss_fn(leaves)
    grads = torch.autograd.grad(loss, flat, allow_unused=True) if loss.requires_grad else [None] * len(flat)
    grads = [torch.zeros_like(lp) if g is None else g for lp, g in zip(flat, grads)]
    it = iter(grads)
    return float(loss.detach()), [[next(it) for _ in tree] for tree in leaves]
