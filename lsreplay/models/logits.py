"""Logits of the LM head in float32 (at least), whatever the model computes in.

Logits rounded to bf16 lose too much in log_softmax (a logprob's error grows with the
logit's magnitude) and in sampling. Log-probabilities of rollouts, of the caching pass and
of replay's scored positions all come from here, so they agree in every dtype.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from lsreplay.models.vocab_grads import accumulator, head_logits

FULL_PRECISION = (torch.float32, torch.float64)
# Vocabulary rows of a bf16 head cast to float32 at a time: the transient copy stays at
# this many rows x hidden x 4 bytes (64 MiB for hidden 2048) instead of the whole head.
CHUNK = 8192


def float_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head over `hidden` (..., d), computed and returned in float32; float64 stays float64."""
    head = model.get_output_embeddings()
    if torch.is_grad_enabled() and (acc := accumulator(head.weight)) is not None:  # see vocab_grads
        full = head.weight.dtype in FULL_PRECISION
        return head_logits(hidden, head, acc, head.weight.shape[0] if full else CHUNK)
    if head.weight.dtype in FULL_PRECISION:
        return torch.nn.functional.linear(hidden.to(head.weight.dtype), head.weight, head.bias)
    return _FloatHead.apply(hidden, head.weight, head.bias)


class _FloatHead(torch.autograd.Function):
    """hidden @ weight.T (+ bias) of a lower-precision head, with float32 products and output.
    What it saves for backward are its inputs as they are: no float32 copy of the head is
    kept, and the casts run over vocabulary chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias):
        ctx.save_for_backward(hidden, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        h = hidden.float()
        out = torch.cat([h @ w.float().T for w in weight.split(CHUNK)], dim=-1)
        return out if bias is None else out + bias.float()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        h = hidden.reshape(-1, hidden.shape[-1]).float()
        grad_hidden = torch.zeros_like(h)
        grad_weight = []
        for start, w in zip(range(0, weight.shape[0], CHUNK), weight.split(CHUNK)):
            g = rows[:, start:start + w.shape[0]]
            grad_hidden.addmm_(g, w.float())
            grad_weight.append((g.T @ h).to(weight.dtype))
        grad_bias = None if ctx.bias_dtype is None else rows.sum(0).to(ctx.bias_dtype)
        return grad_hidden.to(hidden.dtype).reshape(hidden.shape), torch.cat(grad_weight), grad_bias
