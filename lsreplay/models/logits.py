"""Logits of the LM head in float32 (at least), whatever the model computes in.

Logits rounded to bf16 lose too much in log_softmax (a logprob's error grows with the
logit's magnitude) and in sampling. Log-probabilities of rollouts, of the caching pass and
of replay's scored positions all come from here, so they agree in every dtype. They are the
logits of the family's causal LM: a family that softcaps or scales the head's output
(models/families.py) has it done here too.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from lsreplay.models.families import lm_logits
from lsreplay.models.summed_grads import FULL_PRECISION, accumulator

# Vocabulary rows of a bf16 head cast to float32 at a time: the transient copy stays at
# this many rows x hidden x 4 bytes (64 MiB for hidden 2048) instead of the whole head.
CHUNK = 8192


def float_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The family's logits over `hidden` (..., d), computed and returned in float32; float64 stays float64."""
    return lm_logits(model.config, _head(model, hidden))


def _head(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    head = model.get_output_embeddings()
    if torch.is_grad_enabled() and (acc := accumulator(head.weight)) is not None:  # see summed_grads
        return _FloatHead.apply(hidden, head.weight.detach(), acc.anchor, head.bias, acc)
    if head.weight.dtype in FULL_PRECISION:
        return torch.nn.functional.linear(hidden.to(head.weight.dtype), head.weight, head.bias)
    return _FloatHead.apply(hidden, head.weight, None, head.bias, None)


class _FloatHead(torch.autograd.Function):
    """hidden @ weight.T (+ bias) with products and output in float32 at least. What it saves
    for backward are its inputs as they are: no float32 copy of a lower-precision head is
    kept, and the casts run over vocabulary chunks. With an Accumulator (`acc`, see
    summed_grads; `weight` then detached, `anchor` carrying the graph) the weight's gradient
    is added into its buffer instead of returned."""

    @staticmethod
    def forward(ctx, hidden, weight, anchor, bias, acc):
        ctx.save_for_backward(hidden, weight)
        ctx.acc, ctx.bias_dtype = acc, None if bias is None else bias.dtype
        ctx.dtype = dtype = torch.promote_types(weight.dtype, torch.float32)
        ctx.chunk = weight.shape[0] if weight.dtype == dtype else CHUNK
        h = hidden.to(dtype)
        out = torch.cat([h @ w.to(dtype).T for w in weight.split(ctx.chunk)], dim=-1)
        return out if bias is None else out + bias.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        h = hidden.reshape(-1, hidden.shape[-1]).to(ctx.dtype)
        grad_hidden = torch.zeros_like(h)
        grad_weight = []
        for start, w in zip(range(0, weight.shape[0], ctx.chunk), weight.split(ctx.chunk)):
            g = rows[:, start:start + w.shape[0]]
            grad_hidden.addmm_(g, w.to(ctx.dtype))
            if ctx.acc is not None:
                ctx.acc.zeroed()[start:start + w.shape[0]].addmm_(g.T, h)
            else:
                grad_weight.append((g.T @ h).to(weight.dtype))
        grad_bias = None if ctx.bias_dtype is None else rows.sum(0).to(ctx.bias_dtype)
        return (grad_hidden.to(hidden.dtype).reshape(hidden.shape), torch.cat(grad_weight) if grad_weight else None,
                None, grad_bias, None)
