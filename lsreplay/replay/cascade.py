"""Attention to a shared prefix in place ("cascade" attention), for replay runs on CPU and CUDA.

A replay run (a micro-batch of sibling leaves, or a branching node recomputed with grad)
attends to its ancestors' K/V. Broadcast over the batch (what `forward_segments` does),
sdpa gets an explicit mask, which turns off its grouped-query path: every row attends to
its own copy of the prefix, repeated to every query head, and all of it is saved for
backward (on CUDA the mask also rules out the flash kernel). Here instead, per layer:

- every row's queries, with the query heads of each K/V group folded into the query
  length, attend once to each ancestor's unrepeated K/V (1, kv_heads, positions, d),
  without a mask: every prefix position is visible to every token of the run;
- each row's queries attend causally to the row's own keys/values (query length = key
  length, so the flash kernel's is_causal needs no mask either);
- the partial results merge by their log-sum-exp.

The backward runs each part's kernel backward with the merged output and log-sum-exp,
which is exactly the gradient of the joint softmax. What is saved for backward is the
rows' own queries, keys, values, output and log-sum-exp (as in a forward without past)
plus the ancestors' K/V themselves, which replay holds anyway: the same on every device.
The kernels (flash on CPU; flash or memory-efficient on CUDA) are in attention_kernels.py,
the only code that differs per device.

Rows are right-padded: a real token never sees the padding after it (causal), and padded
outputs are ignored by the caller.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

from lsreplay.models.hf_compat import with_cache
from lsreplay.replay.attention_kernels import AttentionKernel, kernel_for, runs_on
from lsreplay.replay.segments import PrefixKV, padded_batch

IMPLEMENTATION = "lsreplay_cascade"
# Attention modules that call the AttentionInterface with their layer_idx and pass the
# model's keyword arguments through to it.
MODULES = (LlamaAttention, Qwen2Attention)


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(rows, heads, width, *tail) -> (1, kv_heads, rows * group * width, *tail): the queries
    of all rows and of every head of a K/V group as one long query sequence per K/V head."""
    rows, heads, width, *tail = x.shape
    grouped = x.reshape(rows, kv_heads, heads // kv_heads, width, *tail).transpose(0, 1)
    return grouped.reshape(1, kv_heads, -1, *tail)


def _unfold(x: torch.Tensor, rows: int, heads: int, width: int) -> torch.Tensor:
    """Inverse of `_fold`."""
    kv_heads, tail = x.shape[1], x.shape[3:]
    grouped = x.reshape(kv_heads, rows, heads // kv_heads, width, *tail).transpose(0, 1)
    return grouped.reshape(rows, heads, width, *tail)


def _repeat_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    group = heads // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


class _CascadeAttention(torch.autograd.Function):
    """softmax(q [prefix keys; own keys]^T * scale, causal on the own part) [prefix values; own values].

    query (rows, heads, width, d); key, value (rows, kv_heads, width, d): the rows' own;
    prefix: k_0, v_0, k_1, v_1, ... each (1, kv_heads, positions, d), the ancestors' in order;
    kernel: the device's attention kernel for these tensors (attention_kernels.kernel_for)."""

    @staticmethod
    def forward(ctx, kernel: AttentionKernel, scale: float, query, key, value, *prefix):
        rows, heads, width, _ = query.shape
        kv_heads = key.shape[1]
        # Own part first: its output has the query's memory layout, (rows, width, heads, d),
        # so the caller's transpose back to that shape is free.
        out, lse = kernel.forward(query, _repeat_heads(key, heads), _repeat_heads(value, heads), True, scale)
        parts = [(out, lse)]
        folded = _fold(query, kv_heads)
        for k, v in zip(prefix[0::2], prefix[1::2]):
            part_out, part_lse = kernel.forward(folded, k, v, False, scale)
            parts.append((_unfold(part_out, rows, heads, width), _unfold(part_lse, rows, heads, width)))
        merged_lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
        # Merged in the log-sum-exp's dtype (float32 for bfloat16), into a tensor of the own
        # part's layout (a product keeps its first input's), so the caller's transpose is free;
        # not in place, since a lean layer (recompute.py) keeps the kernel's outputs as they were.
        out = out.to(merged_lse.dtype) * (lse - merged_lse).exp().unsqueeze(-1)
        for part_out, part_lse in parts[1:]:
            out.addcmul_(part_out, (part_lse - merged_lse).exp().unsqueeze(-1))
        out = out.to(query.dtype)
        ctx.kernel, ctx.scale = kernel, scale
        ctx.save_for_backward(query, key, value, out, merged_lse, *prefix)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, *prefix = ctx.saved_tensors
        rows, heads, width, _ = query.shape
        kv_heads, group = key.shape[1], heads // key.shape[1]
        grad_query, grad_key, grad_value = ctx.kernel.backward(
            grad_out, query, _repeat_heads(key, heads), _repeat_heads(value, heads), out, lse, True, ctx.scale)
        grad_key = grad_key.reshape(rows, kv_heads, group, width, -1).sum(2)
        grad_value = grad_value.reshape(rows, kv_heads, group, width, -1).sum(2)
        folded = [_fold(t, kv_heads) for t in (grad_out, query, out, lse)]
        grad_prefix = []
        for k, v in zip(prefix[0::2], prefix[1::2]):
            part_grad_query, grad_k, grad_v = ctx.kernel.backward(folded[0], folded[1], k, v, folded[2], folded[3],
                                                                  False, ctx.scale)
            grad_query = grad_query + _unfold(part_grad_query, rows, heads, width)
            grad_prefix += [grad_k, grad_v]
        return None, None, grad_query, grad_key, grad_value, *grad_prefix


def cascade_attention(module, query, key, value, attention_mask, *, scaling: float, cascade_prefix: list[PrefixKV],
                      dropout: float = 0.0, sliding_window: int | None = None, **kwargs):
    """The AttentionInterface function: `module`'s layer of the shared prefix comes from
    the model keyword argument `cascade_prefix` (see `forward_cascade`)."""
    if dropout or sliding_window is not None or attention_mask is not None:
        raise ValueError("cascade attention supports neither dropout, a sliding window nor an attention mask")
    kernel = kernel_for(query.device.type, query.dtype, query.shape[-1])
    if kernel is None:
        raise ValueError(f"no cascade attention kernel for {query.dtype} on {query.device.type}, "
                         f"head_dim {query.shape[-1]}")
    layer = module.layer_idx
    prefix = [t for keys, values in cascade_prefix for t in (keys[layer], values[layer])]
    out = _CascadeAttention.apply(kernel, scaling, query, key, value, *prefix)
    return out.transpose(1, 2), None


AttentionInterface.register(IMPLEMENTATION, cascade_attention)


def _attention_modules(model: PreTrainedModel) -> list[torch.nn.Module | None]:
    return [getattr(layer, "self_attn", None) for layer in getattr(model.base_model, "layers", [])]


def cascade_applies(model: PreTrainedModel) -> bool:
    """Whether `forward_cascade` can run this model: a device and dtype (and head size) with
    an attention kernel (attention_kernels.kernel_for), every layer's attention a module of
    MODULES without a sliding window, no attention dropout."""
    param = next(model.parameters())
    attention = _attention_modules(model)
    return (bool(attention)
            and all(isinstance(m, MODULES) and getattr(m, "sliding_window", None) is None for m in attention)
            and not (model.training and getattr(model.config, "attention_dropout", 0.0))
            and kernel_for(param.device.type, param.dtype, attention[0].head_dim) is not None
            and runs_on(param.device))


@contextmanager
def _attention_implementation(model: PreTrainedModel, name: str):
    """The model's attention implementation is `name` inside the block. It lives on the
    model's config, shared by every forward of this model: this assumes nothing else runs
    this model meanwhile (replay owns its model: one per process or thread)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        # set_attn_implementation only warns on a model class it cannot switch; without the
        # switch the prefix would be silently ignored.
        if any(m.config._attn_implementation != name for m in _attention_modules(model)):
            raise RuntimeError(f"{type(model).__name__} did not switch its attention implementation to {name}")
        yield
    finally:
        model.set_attn_implementation(previous)


def forward_cascade(model: PreTrainedModel, segments: list[list[int]], start: int,
                    prefix_kv: list[PrefixKV]) -> tuple[torch.Tensor, DynamicCache]:
    """Hidden states (B, T, d) of sibling `segments` placed at positions start.. after the
    shared prefix whose K/V is `prefix_kv` (one PrefixKV per ancestor, root first, together
    covering positions 0..start), differentiable in the prefix K/V, and a cache holding
    only the segments' own K/V. Like `forward_segments`, but the prefix is attended in
    place, once for all rows (see the module docstring)."""
    ids, positions = padded_batch(model, segments, start)
    cache = DynamicCache(config=model.config)
    with _attention_implementation(model, IMPLEMENTATION):
        out = model.base_model(input_ids=ids, position_ids=positions, use_cache=True,
                               cascade_prefix=prefix_kv, **with_cache(cache))
    return out.last_hidden_state, cache
