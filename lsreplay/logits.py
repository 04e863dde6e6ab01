"""Logits of the LM head in float32 (at least), whatever the model computes in.

Logits rounded to bf16 lose too much in log_softmax (a logprob's error grows with the
logit's magnitude) and in sampling. Log-probabilities of rollouts, of the caching pass and
of replay's scored positions all come from here, so they agree in every dtype.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def float_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head over `hidden` (..., d), computed and returned in float32; float64 stays float64."""
    head = model.get_output_embeddings()
    dtype = torch.promote_types(head.weight.dtype, torch.float32)
    bias = None if head.bias is None else head.bias.to(dtype)
    return torch.nn.functional.linear(hidden.to(dtype), head.weight.to(dtype), bias)
