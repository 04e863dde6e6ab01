"""Attention to a shared prefix in place ("cascade" attention), for replay runs on CPU and CUDA.

A replay run (a micro-batch of sibling leaves, or a branching node recomputed with grad)
attends to its ancestors' K/V. Broadcast over the batch (what `forward_segments` does),
sdpa gets an explicit mask, which turns off its grouped-query path: every row attends to
its own copy of the prefix, repeated to every query head, and all of it is saved for
backward (on CUDA the mask also rules out the flash kernel). Here instead, per layer:

- every row's queries, with the query heads of each K/V group folded into the query
  length, attend once to each ancestor's unrepeated K/V (1, kv_heads, positions, d);
- each row's queries attend causally to the row's own keys/values (query length = key
  length, so the flash kernel's is_causal needs no mask either);
- the partial results merge by their log-sum-exp.

The backward runs each part's kernel backward with the merged output and log-sum-exp,
which is exactly the gradient of the joint softmax. What is saved for backward is the
rows' own queries, keys, values, output and log-sum-exp (as in a forward without past)
plus the ancestors' K/V themselves, which replay holds anyway: the same on every device.

Attention as each family computes it (replay/attention/): a sliding-window or chunked
layer's part sees only some of an ancestor's keys (windows.py: a part no query sees is
skipped, one seen in part gets a mask over the keys any query may see), attention
logits softcapping (Gemma 2) takes the plain kernel, attention sinks (GPT-OSS) join the
merge (sinks.py), latent attention's cached latents are decompressed and its narrower
values padded (latent.py). The kernels
(attention/kernels.py) are the only code that differs per device.

A prefix part may be held elsewhere (HeldElsewhere: a long prompt split over the ranks of a
step, lsreplay.distributed.context): its holders attend the queries to their shares and send
back each share's output and log-sum-exp, which join the merge as parts; in the backward they
compute the queries' gradient from the merged output and log-sum-exp, as a local part's
kernel does, and keep their keys' and values' gradient where the keys are.

Rows are right-padded: a real token never sees the padding after it (causal), and padded
outputs are ignored by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from lsreplay.models.attention_switch import attention_for_thread, model_configs
from lsreplay.models.families import FAMILIES
from lsreplay.models.hf_compat import decoder, decoder_layers, full_cache, with_cache
from lsreplay.replay.attention.kernels import AttentionKernel, kernel_for, runs_on
from lsreplay.replay.attention.latent import common_head_dim, decompressed, padded
from lsreplay.replay.attention.sinks import merged_lse, sink_grad
from lsreplay.replay.attention.windows import Visibility, layer_visibility, own_mask, part_mask
from lsreplay.replay.segments import PrefixKV, padded_batch

IMPLEMENTATION = "lsreplay_cascade"
# Keyword arguments a family's attention module hands the attention function that do not
# change what it computes (the model's own keywords passed through, and its cache).
PASSED_THROUGH = frozenset({"position_ids", "use_cache", "cache", "past_key_values", "cache_position",
                            "output_attentions", "position_embeddings", "is_causal"})


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


def _fold_mask(mask: torch.Tensor | None, copies: int) -> torch.Tensor | None:
    """A part's mask (width, keys) for the folded queries: the same per row and head."""
    return None if mask is None else mask.repeat(copies, 1)[None, None]


def _repeat_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    group = heads // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


class HeldElsewhere(Protocol):
    """A prefix part whose keys and values other processes hold, in shares (a prompt split over
    ranks: lsreplay.distributed.context). Its positions come first, before every query, and
    every query sees all of them (full attention)."""

    positions: int

    def attend(self, layer: int, query: torch.Tensor, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Queries (1, kv_heads, n, d), the heads of a K/V group folded into their length,
        against layer `layer`'s keys and values of each share: (output, log-sum-exp) per share."""

    def attend_backward(self, layer: int, grad_out: torch.Tensor, query: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: float) -> torch.Tensor:
        """The queries' gradient from every share, given the merged output and log-sum-exp
        (each share's keys and values keep theirs where they are held)."""


class KeysOnly(Exception):
    """Raised by cascade_attention where the prefix asks for a layer's keys and values only:
    the layer has put them in its cache by then (layerwise.py's share of a split span)."""


@dataclass
class _Plan:
    """One layer's cascade: the kernel and mask (None: causal alone) of the rows' own part,
    and of each ancestor part the rows see (its mask None: every query sees every key), and
    the parts held elsewhere."""

    scale: float
    own: AttentionKernel
    own_mask: torch.Tensor | None
    parts: list[tuple[AttentionKernel, torch.Tensor | None]] = field(default_factory=list)
    layer: int = 0
    elsewhere: list[HeldElsewhere] = field(default_factory=list)


class _CascadeAttention(torch.autograd.Function):
    """softmax(q [prefix keys; own keys]^T * scale, causal on the own part, masked where the
    layer sees only some keys, with the sinks in the normaliser) [prefix values; own values].

    query (rows, heads, width, d); key, value (rows, kv_heads, width, d): the rows' own;
    sinks (heads,) or None; prefix: k_0, v_0, k_1, v_1, ... each (1, kv_heads, positions, d),
    the ancestors' keys a query may see, in order; plan: the kernels and masks (_Plan)."""

    @staticmethod
    def forward(ctx, plan: _Plan, query, key, value, sinks, *prefix):
        rows, heads, width, _ = query.shape
        kv_heads = key.shape[1]
        # Own part first: its output has the query's memory layout, (rows, width, heads, d),
        # so the caller's transpose back to that shape is free.
        out, lse = plan.own.forward(query, _repeat_heads(key, heads), _repeat_heads(value, heads),
                                    plan.own_mask is None, plan.scale, plan.own_mask)
        parts = [(out, lse)]
        folded = _fold(query, kv_heads)
        for (k, v), (kernel, mask) in zip(zip(prefix[0::2], prefix[1::2]), plan.parts):
            part_out, part_lse = kernel.forward(folded, k, v, False, plan.scale, _fold_mask(mask, rows * heads // kv_heads))
            parts.append((_unfold(part_out, rows, heads, width), _unfold(part_lse, rows, heads, width)))
        for held in plan.elsewhere:
            parts += [(_unfold(part_out, rows, heads, width), _unfold(part_lse, rows, heads, width))
                      for part_out, part_lse in held.attend(plan.layer, folded, plan.scale)]
        merged = merged_lse([part_lse for _, part_lse in parts], sinks)
        # Merged in the log-sum-exp's dtype (float32 for bfloat16), into a tensor of the own
        # part's layout (a product keeps its first input's), so the caller's transpose is free;
        # not in place, since a lean layer (recompute.py) keeps the kernel's outputs as they were.
        out = out.to(merged.dtype) * (lse - merged).exp().unsqueeze(-1)
        for part_out, part_lse in parts[1:]:
            out.addcmul_(part_out, (part_lse - merged).exp().unsqueeze(-1))
        out = out.to(query.dtype)
        ctx.plan = plan
        ctx.save_for_backward(query, key, value, out, merged, sinks, *prefix)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, sinks, *prefix = ctx.saved_tensors
        plan = ctx.plan
        rows, heads, width, _ = query.shape
        kv_heads, group = key.shape[1], heads // key.shape[1]
        grad_query, grad_key, grad_value = plan.own.backward(
            grad_out, query, _repeat_heads(key, heads), _repeat_heads(value, heads), out, lse, plan.own_mask is None,
            plan.scale, plan.own_mask)
        grad_key = grad_key.reshape(rows, kv_heads, group, width, -1).sum(2)
        grad_value = grad_value.reshape(rows, kv_heads, group, width, -1).sum(2)
        folded = [_fold(t, kv_heads) for t in (grad_out, query, out, lse)]
        grad_prefix = []
        for (k, v), (kernel, mask) in zip(zip(prefix[0::2], prefix[1::2]), plan.parts):
            part_grad_query, grad_k, grad_v = kernel.backward(folded[0], folded[1], k, v, folded[2], folded[3], False,
                                                              plan.scale, _fold_mask(mask, rows * group))
            grad_query = grad_query + _unfold(part_grad_query, rows, heads, width)
            grad_prefix += [grad_k, grad_v]
        for held in plan.elsewhere:
            grad_query = grad_query + _unfold(held.attend_backward(plan.layer, *folded, plan.scale), rows, heads, width)
        grad_sinks = sink_grad(sinks, grad_out, out, lse) if sinks is not None and ctx.needs_input_grad[4] else None
        return None, grad_query, grad_key, grad_value, grad_sinks, *grad_prefix


@dataclass
class CascadePrefix:
    """What forward_cascade hands every attention layer: the ancestors' K/V (`parts`, root
    first, together covering positions 0..start; a part HeldElsewhere, first, covers its
    positions), the rows' first position, each layer's Visibility, the layers that ran (each
    attention layer must: one that did not attend through cascade_attention would have
    ignored the prefix), and whether a layer is run for its keys and values only (KeysOnly)."""

    parts: list[PrefixKV | HeldElsewhere]
    start: int
    visibility: list[Visibility]
    layers_run: set[int] = field(default_factory=set)
    keys_only: bool = False


def cascade_attention(module, query, key, value, attention_mask, *, scaling: float, cascade_prefix: CascadePrefix,
                      dropout: float = 0.0, sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs):
    """The AttentionInterface function: `module`'s layer of the shared prefix comes from the
    model keyword argument `cascade_prefix` (see `forward_cascade`). `attention_mask` is not
    read: forward_cascade's rows need no padding mask, and what a layer sees is computed here
    from positions (windows.py), as the family's masks say it."""
    layer, prefix = module.layer_idx, cascade_prefix
    if prefix.keys_only:
        raise KeysOnly()
    visibility = prefix.visibility[layer]
    if dropout:
        raise ValueError("cascade attention runs without attention dropout (replay runs the model in eval mode)")
    if sliding_window is not None and sliding_window != visibility.window:
        raise ValueError(f"layer {layer} attends with a sliding window of {sliding_window}, its config says "
                         f"{visibility}: replay would not attend as the family does")
    if unknown := sorted(k for k, v in kwargs.items() if v is not None and k not in PASSED_THROUGH):
        raise ValueError(f"{type(module).__name__} passes the attention function {unknown}, which cascade attention "
                         "does not know: replay cannot promise to attend as the family does")
    width, dtype, device = query.shape[2], query.dtype, query.device
    size = common_head_dim(query, value)
    parts, elsewhere, offset = [], [], 0
    for part in prefix.parts:
        if not isinstance(part, tuple):
            elsewhere.append(_held_elsewhere(part, module, visibility, offset, softcap))
            offset += part.positions
            continue
        keys, values = part
        count = keys[layer].shape[-2]
        seen = part_mask(visibility, prefix.start, width, offset, count, dtype, device)
        offset += count
        if seen is not None:
            part = decompressed(module, keys[layer][:, :, seen[0]:], values[layer][:, :, seen[0]:])
            parts.append((*part, seen[1]))
    mask = own_mask(visibility, prefix.start, width, dtype, device)
    plan = _Plan(scaling, _kernel(query, size, mask is not None, softcap), mask,
                 [(_kernel(query, size, m is not None, softcap), m) for _, _, m in parts], layer, elsewhere)
    tensors = padded([query, key, value] + [t for k, v, _ in parts for t in (k, v)], size)
    out = _CascadeAttention.apply(plan, *tensors[:3], s_aux, *tensors[3:])
    prefix.layers_run.add(layer)
    return out[..., : value.shape[-1]].transpose(1, 2), None


def _held_elsewhere(part: HeldElsewhere, module, visibility: Visibility, offset: int,
                    softcap: float | None) -> HeldElsewhere:
    """`part`, where its holders attend as this layer does: first in the prefix, every key seen
    by every query, plain softmax attention of keys and values as cached."""
    if offset or not visibility.full or softcap is not None or hasattr(module, "expand_kv"):
        raise ValueError(f"layer {module.layer_idx} ({type(module).__name__}) attends with "
                         f"{'a window' if not visibility.full else 'softcapped logits' if softcap else 'latents'}: "
                         "a prompt split over ranks (replay.context_parallel) takes full softmax attention of "
                         "cached keys and values only")
    return part


def _kernel(query: torch.Tensor, head_dim: int, masked: bool, softcap: float | None) -> AttentionKernel:
    kernel = kernel_for(query.device.type, query.dtype, head_dim, masked, softcap)
    if kernel is None:
        raise ValueError(f"no cascade attention kernel for {query.dtype} on {query.device.type}, head_dim {head_dim}")
    return kernel


AttentionInterface.register(IMPLEMENTATION, cascade_attention)
# No mask to build: cascade_attention computes what each layer sees from positions.
ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, lambda *args, **kwargs: None)


def _attention_modules(model: PreTrainedModel) -> list[torch.nn.Module | None]:
    return [getattr(layer, "self_attn", None) for layer in decoder_layers(model)]


def cascade_applies(model: PreTrainedModel) -> bool:
    """Whether `forward_cascade` can run this model: a family the matrix tests on cascade
    attention (models.families), every decoder layer with an attention module, no attention
    dropout, and a device and dtype (and head size) with a fused kernel (kernels.kernel_for)."""
    param = next(model.parameters())
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    attention = _attention_modules(model)
    if family is None or not family.cascade or not attention or any(m is None for m in attention):
        return False
    head_dim = max(getattr(attention[0], "head_dim", 0), getattr(attention[0], "qk_head_dim", 0))
    return (not (model.training and getattr(model.config, "attention_dropout", 0.0))
            and kernel_for(param.device.type, param.dtype, head_dim) is not None
            and runs_on(param.device))


def forward_cascade(model: PreTrainedModel, segments: list[list[int]], start: int,
                    prefix_kv: list[PrefixKV]) -> tuple[torch.Tensor, DynamicCache]:
    """Hidden states (B, T, d) of sibling `segments` placed at positions start.. after the
    shared prefix whose K/V is `prefix_kv` (one PrefixKV per ancestor, root first, together
    covering positions 0..start), differentiable in the prefix K/V, and a cache holding
    only the segments' own K/V. Like `forward_segments`, but the prefix is attended in
    place, once for all rows (see the module docstring)."""
    ids, positions = padded_batch(model, segments, start)
    cache = full_cache(model)
    prefix = CascadePrefix(prefix_kv, start, layer_visibility(model.config))
    with attention_for_thread(model_configs(model), IMPLEMENTATION):
        out = decoder(model)(input_ids=ids, position_ids=positions, use_cache=True, cascade_prefix=prefix,
                             **with_cache(cache))
    if missed := sorted(set(range(len(prefix.visibility))) - prefix.layers_run):
        raise RuntimeError(f"{type(model).__name__}'s layers {missed} did not attend through cascade attention: "
                           "they would have ignored the prefix")
    return out.last_hidden_state, cache
