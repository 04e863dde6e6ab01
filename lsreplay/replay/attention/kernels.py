"""The attention kernels cascade attention (replay/cascade.py) is built on: fused ones per device
kind, and one in plain torch ops for what no fused kernel does.

Cascade attention needs two things no public attention function gives together: each
part's log-sum-exp per query, to merge the parts, and a backward that starts from a given
output and log-sum-exp (the merged ones), which makes each part's backward exactly its
share of the joint softmax's gradient. The aten ops behind sdpa have both:

- CPU: the flash kernel (`_scaled_dot_product_flash_attention_for_cpu`), float32, float64
  and bfloat16;
- CUDA: the flash kernel (FlashAttention-2) for bfloat16 and float16, the memory-efficient
  kernel (xformers/cutlass) for float32: head_dim a multiple of 8, at most 256, compute
  capability 8.0 or newer, a CUDA (not ROCm) build.

Each kernel is wrapped to one signature, so everything around it (cascade.py: the fold of
queries and GQA heads, the merge, the autograd Function) is the same code on every device
and the CPU tests exercise it. What differs per device is only the calls below.

A part of the attention that only some of its keys may see (a sliding window's or a
chunk's edge, windows.py) needs a mask, which the CPU flash kernel takes and the CUDA ones
here do not; attention logits softcapped (Gemma 2) need a tanh between the product and the
softmax, which none does. `PLAIN` computes both in torch ops, a block of queries at a time
(its scores are materialised), on every device and dtype, with the same signature: where a
part needs what the fused kernel lacks, `kernel_for` answers it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# forward(query, key, value, causal, scale, mask) -> (out, lse): query (B, H, L, d), key and value
# (B, H, S, d), same heads; mask None or additive (0 / -inf), broadcast to (B, H, L, S); out
# (B, H, L, d), lse (B, H, L) in float32 (float64 for float64), -inf where a row sees no key.
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# backward(grad_out, query, key, value, out, lse, causal, scale, mask) -> (grad_query, grad_key, grad_value)
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AttentionKernel:
    """softmax(q k^T * scale (softcapped), causal or not, masked) v with its log-sum-exp, and
    its backward from a given output and log-sum-exp. `masks`: whether it takes a mask."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    forward: Forward
    backward: Backward
    masks: bool = False


def _cpu_flash_forward(query, key, value, causal, scale, mask=None):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                          attn_mask=mask, scale=scale)
    if mask is not None:  # the kernel gives a row that sees no key a log-sum-exp of 0, not -inf
        unseen = (mask == -math.inf).all(-1).expand(lse.shape)
        lse = lse.masked_fill(unseen, -math.inf)
    return out, lse


def _cpu_flash_backward(grad_out, query, key, value, out, lse, causal, scale, mask=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _no_rng(like: torch.Tensor) -> torch.Tensor:
    # The CUDA backward kernels read their dropout RNG state only when dropout_p > 0.
    return torch.empty(0, dtype=torch.long, device=like.device)


def _cuda_flash_forward(query, key, value, causal, scale, mask=None):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, scale=scale)
    return out, lse


def _cuda_flash_backward(grad_out, query, key, value, out, lse, causal, scale, mask=None):
    # No cumulative sequence lengths: the dense (not varlen) kernel.
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, query, key, value, out, lse, None, None, query.shape[2], key.shape[2], 0.0, causal,
        _no_rng(query), _no_rng(query), scale=scale)


# The memory-efficient kernel's log-sum-exp rows are padded to a multiple of this with +inf,
# and its backward reads the padding (to save bound checks).
_EFFICIENT_LSE_ALIGN = 32


def _cuda_efficient_forward(query, key, value, causal, scale, mask=None):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : query.shape[2]]


def _cuda_efficient_backward(grad_out, query, key, value, out, lse, causal, scale, mask=None):
    lse = F.pad(lse, (0, -lse.shape[-1] % _EFFICIENT_LSE_ALIGN), value=math.inf)
    grad_query, grad_key, grad_value, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, query, key, value, None, out, lse, _no_rng(query), _no_rng(query), 0.0, [True, True, True, False],
        causal, scale=scale)
    return grad_query, grad_key, grad_value


# Scores the plain kernel materialises at once (B x H x queries x keys), 64 MiB in float32.
PLAIN_BLOCK = 1 << 24


def _plain_scores(query, key, scale, causal, mask, softcap, rows: slice):
    """The logits of queries `rows` (L == S when causal), softcapped and masked, in the
    log-sum-exp's dtype; and tanh(logits / softcap) for the backward (None without a cap)."""
    acc = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query[:, :, rows].to(acc), key.to(acc).transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    if causal:
        above = torch.arange(rows.start, rows.stop, device=scores.device)[:, None] < torch.arange(
            key.shape[2], device=scores.device)
        scores = scores.masked_fill(above, -math.inf)
    if mask is not None:
        scores = scores + mask[..., rows, :].to(acc) if mask.shape[-2] > 1 else scores + mask.to(acc)
    return scores, capped


def _blocks(query, key) -> list[slice]:
    """Query blocks whose scores take at most PLAIN_BLOCK elements."""
    batch, heads, length, _ = query.shape
    step = max(1, PLAIN_BLOCK // max(1, batch * heads * key.shape[2]))
    return [slice(a, min(a + step, length)) for a in range(0, length, step)]


def plain_forward(query, key, value, causal, scale, mask=None, softcap=None):
    acc = torch.promote_types(query.dtype, torch.float32)
    out = query.new_empty(*query.shape[:-1], value.shape[-1])
    lse = torch.empty(query.shape[:-1], dtype=acc, device=query.device)
    for rows in _blocks(query, key):
        scores, _ = _plain_scores(query, key, scale, causal, mask, softcap, rows)
        lse[:, :, rows] = torch.logsumexp(scores, -1)  # -inf where a row sees no key
        probs = (scores - lse[:, :, rows, None]).exp().nan_to_num(0.0)  # such a row's 0/0
        out[:, :, rows] = torch.matmul(probs, value.to(acc)).to(out.dtype)
    return out, lse


def plain_backward(grad_out, query, key, value, out, lse, causal, scale, mask=None, softcap=None):
    """The gradient of the attention whose softmax is normalised by `lse` (the merged one
    for a part of cascade attention), with `out` its output: dS = P (dP - rowsum(dO * O))."""
    acc = torch.promote_types(query.dtype, torch.float32)
    grad_query = torch.empty_like(query)
    grad_key = torch.zeros(key.shape, dtype=acc, device=key.device)
    grad_value = torch.zeros(value.shape, dtype=acc, device=value.device)
    for rows in _blocks(query, key):
        scores, capped = _plain_scores(query, key, scale, causal, mask, softcap, rows)
        probs = (scores - lse[:, :, rows, None].to(acc)).exp()
        g_out = grad_out[:, :, rows].to(acc)
        grad_value += torch.matmul(probs.transpose(-1, -2), g_out)
        delta = (g_out * out[:, :, rows].to(acc)).sum(-1, keepdim=True)
        grad_scores = probs * (torch.matmul(g_out, value.to(acc).transpose(-1, -2)) - delta)
        if capped is not None:
            grad_scores = grad_scores * (1 - capped * capped)
        grad_scores = grad_scores * scale
        grad_query[:, :, rows] = torch.matmul(grad_scores, key.to(acc)).to(query.dtype)
        grad_key += torch.matmul(grad_scores.transpose(-1, -2), query[:, :, rows].to(acc))
    return grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype)


CPU_FLASH = AttentionKernel("cpu-flash", (torch.float32, torch.float64, torch.bfloat16),
                            _cpu_flash_forward, _cpu_flash_backward, masks=True)
CUDA_FLASH = AttentionKernel("cuda-flash", (torch.bfloat16, torch.float16), _cuda_flash_forward, _cuda_flash_backward)
CUDA_EFFICIENT = AttentionKernel("cuda-efficient", (torch.float32,), _cuda_efficient_forward, _cuda_efficient_backward)
PLAIN = AttentionKernel("plain", (torch.float32, torch.float64, torch.bfloat16, torch.float16),
                        plain_forward, plain_backward, masks=True)
KERNELS = {"cpu": (CPU_FLASH,), "cuda": (CUDA_FLASH, CUDA_EFFICIENT)}


def kernel_for(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool = False,
               softcap: float | None = None) -> AttentionKernel | None:
    """The kernel for tensors of this device kind, dtype and head size, a mask or not, logits
    softcapped or not: the fused one where it does all that, else PLAIN where there is a fused
    one for the unmasked case (so that cascade applies at all: cascade.cascade_applies), None
    if there is none."""
    fused = None
    if device_type != "cuda" or (head_dim % 8 == 0 and head_dim <= 256):
        fused = next((k for k in KERNELS.get(device_type, ()) if dtype in k.dtypes), None)
    if fused is None or softcap is None and (fused.masks or not masked):
        return fused
    return softcapped(softcap) if softcap is not None else PLAIN


def softcapped(cap: float) -> AttentionKernel:
    """PLAIN with logits softcapped: cap * tanh(logits / cap) before the mask and softmax."""
    return AttentionKernel(f"plain-softcap{cap:g}", PLAIN.dtypes, functools.partial(plain_forward, softcap=cap),
                           functools.partial(plain_backward, softcap=cap), masks=True)


def runs_on(device: torch.device) -> bool:
    """Whether this device can run its kernels: any CPU; a CUDA device of compute capability
    8.0+ (FlashAttention-2's floor) in a CUDA build (ROCm's kernels differ, e.g. in the
    log-sum-exp padding)."""
    if device.type == "cpu":
        return True
    return (device.type == "cuda" and torch.version.cuda is not None
            and torch.cuda.get_device_capability(device) >= (8, 0))
