"""The gradient of the vocabulary-sized weights (the input embedding and the LM head, one
tensor when tied) summed in place over a backward's many autograd calls, on CPU.

Branch replay runs one autograd backward per replayed run of sibling spans (13 for a [4, 2]
tree), the per-rollout reference one per rollout. In each, autograd builds these weights'
gradient densely whatever the run's length: the embedding scatters into a zeroed
vocab x hidden tensor, the head's product fills a fresh one, the two are summed when tied,
and the sum is added into `.grad`. Four passes over 113 MB for SmolLM2-135M per call; on
CPU, where a pass over memory costs about what the run's matmuls do, that was 30% of a
replay backward of the default config's tree (6 layers deep, profiled). Here the head's
product goes straight into one buffer (`addmm_`, in lsreplay.models.logits), the embedding's rows are added into it
(`index_add_`), and autograd receives the buffer once when the backward ends: `.grad`, its
hooks (float32 masters, lsreplay.models.train_state) and the sum are those of one gradient,
up to the order of the additions. The price is the buffer: one more weight-sized tensor (in
float32 at least) while the backward runs, which the activation meter does not count.

On CUDA the passes are cheap next to the buffer's memory (2.2 GB in float32 for
Qwen2.5-7B's embedding), so the usual per-call path stays there, as it does for sharded
(DTensor) weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary



@dataclass
class Accumulator:
    """Where one weight's gradient goes while `summed_in_place` runs (float32 at least)."""

    buffer: torch.Tensor
    used: bool = False
    # What the outputs' graph hangs on in place of the weight: with the weight an input,
    # autograd would run its AccumulateGrad (and hooks) on every call, with no gradient.
    anchor: torch.Tensor = field(default_factory=lambda: torch.zeros((), requires_grad=True))


_ACTIVE = WeakIdKeyDictionary()  # weight -> Accumulator


def accumulator(weight: torch.Tensor) -> Accumulator | None:
    return _ACTIVE.get(weight)


def _applies(weight: torch.Tensor | None) -> bool:
    return (weight is not None and weight.requires_grad and weight.device.type == "cpu"
            and type(weight.data) is torch.Tensor)


@contextmanager
def summed_in_place(model: torch.nn.Module):
    """Within the block, the embedding's and the LM head's gradients go into one buffer per
    weight; on leaving it normally, into `.grad` by one autograd call. (On an exception
    they are dropped with the rest of the half-done backward.)"""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    weights = {id(w): w for w in (embedding.weight, getattr(head, "weight", None)) if _applies(w)}
    if not weights or not torch.is_grad_enabled() or any(w in _ACTIVE for w in weights.values()):
        yield
        return
    for w in weights.values():
        _ACTIVE[w] = Accumulator(torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32)))
    hook = embedding.register_forward_hook(_embedding_into_buffer) if _plain_lookup(embedding) else None
    try:
        yield
        live = [(w, _ACTIVE[w].buffer) for w in weights.values() if _ACTIVE[w].used]
        if live:
            torch.autograd.backward([w.view_as(w) for w, _ in live], [b.to(w.dtype) for w, b in live])
    finally:
        if hook is not None:
            hook.remove()
        for w in weights.values():
            _ACTIVE.pop(w, None)


def _plain_lookup(embedding: torch.nn.Module) -> bool:
    """An nn.Embedding whose output is its weight's rows (no scale, as Gemma's subclass
    applies, no max_norm renormalising them): what the hook may recompute."""
    return type(embedding) is torch.nn.Embedding and embedding.max_norm is None and embedding.weight in _ACTIVE


def _embedding_into_buffer(module, args, output):
    """Forward hook: the same rows, with a backward that adds into the buffer."""
    if not output.requires_grad:
        return output
    acc = _ACTIVE[module.weight]
    return _EmbeddingInPlace.apply(args[0], module.weight.detach(), acc.anchor, acc, module.padding_idx)


class _EmbeddingInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, anchor, acc, padding_idx):
        ctx.ids, ctx.acc, ctx.padding_idx = ids, acc, padding_idx
        return weight[ids]

    @staticmethod
    def backward(ctx, grad):
        ids = ctx.ids.reshape(-1)
        rows = grad.reshape(-1, grad.shape[-1]).to(ctx.acc.buffer.dtype)
        if ctx.padding_idx is not None:  # nn.Embedding leaves that row's gradient 0
            rows = rows.masked_fill((ids == ctx.padding_idx).unsqueeze(1), 0)
        ctx.acc.buffer.index_add_(0, ids, rows)
        ctx.acc.used = True
        return None, None, None, None, None
