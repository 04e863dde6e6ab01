"""Attention sinks (GPT-OSS): a learned logit per head that joins every query's softmax
with no value behind it.

softmax over [q k_1, ..., q k_n, s_h] with the sink's share dropped is the attention of
the keys with the sink's exp(s_h) added to the normaliser: one more term of the log-sum-exp
cascade attention merges its parts by (replay/cascade.py), weighing no value. Its gradient:
with p = exp(s_h - lse) the sink's share, d out / d s_h = -p out, so
dL/ds_h = -sum over queries of p <dL/dout, out>. The parts' backwards from the merged output
and log-sum-exp stay exact: the sink only changes the normaliser they are given.
"""

from __future__ import annotations

import torch


def merged_lse(part_lses: list[torch.Tensor], sinks: torch.Tensor | None) -> torch.Tensor:
    """The log-sum-exp of every part's logits (each (rows, heads, width)) and of the sink of
    each head (`sinks` (heads,), or None)."""
    terms = list(part_lses)
    if sinks is not None:
        terms.append(sinks.to(part_lses[0].dtype).view(1, -1, 1).expand_as(part_lses[0]))
    return torch.logsumexp(torch.stack(terms), dim=0)


def sink_grad(sinks: torch.Tensor, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """dL/d sinks from the merged output `out` (rows, heads, width, d), its gradient and the
    merged log-sum-exp `lse` (rows, heads, width)."""
    share = (sinks.to(lse.dtype).view(1, -1, 1) - lse).exp()
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(share * delta).sum((0, 2)).to(sinks.dtype)
