"""The fused attention kernels cascade attention (cascade.py) is built on, one set per device kind.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# forward(query, key, value, causal, scale) -> (out, lse): query (B, H, L, d), key and value
# (B, H, S, d), same heads; out (B, H, L, d), lse (B, H, L) in float32 (float64 for float64).
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]
# backward(grad_out, query, key, value, out, lse, causal, scale) -> (grad_query, grad_key, grad_value)
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AttentionKernel:
    """softmax(q k^T * scale, causal or not) v with its log-sum-exp, and its backward from
    a given output and log-sum-exp."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    forward: Forward
    backward: Backward


def _cpu_flash_forward(query, key, value, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)


def _cpu_flash_backward(grad_out, query, key, value, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, lse, 0.0, causal, scale=scale)


def _no_rng(like: torch.Tensor) -> torch.Tensor:
    # The CUDA backward kernels read their dropout RNG state only when dropout_p > 0.
    return torch.empty(0, dtype=torch.long, device=like.device)


def _cuda_flash_forward(query, key, value, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, scale=scale)
    return out, lse


def _cuda_flash_backward(grad_out, query, key, value, out, lse, causal, scale):
    # No cumulative sequence lengths: the dense (not varlen) kernel.
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, query, key, value, out, lse, None, None, query.shape[2], key.shape[2], 0.0, causal,
        _no_rng(query), _no_rng(query), scale=scale)


# The memory-efficient kernel's log-sum-exp rows are padded to a multiple of this with +inf,
# and its backward reads the padding (to save bound checks).
_EFFICIENT_LSE_ALIGN = 32


def _cuda_efficient_forward(query, key, value, causal, scale):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : query.shape[2]]


def _cuda_efficient_backward(grad_out, query, key, value, out, lse, causal, scale):
    lse = F.pad(lse, (0, -lse.shape[-1] % _EFFICIENT_LSE_ALIGN), value=math.inf)
    grad_query, grad_key, grad_value, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, query, key, value, None, out, lse, _no_rng(query), _no_rng(query), 0.0, [True, True, True, False],
        causal, scale=scale)
    return grad_query, grad_key, grad_value


CPU_FLASH = AttentionKernel("cpu-flash", (torch.float32, torch.float64, torch.bfloat16),
                            _cpu_flash_forward, _cpu_flash_backward)
CUDA_FLASH = AttentionKernel("cuda-flash", (torch.bfloat16, torch.float16), _cuda_flash_forward, _cuda_flash_backward)
CUDA_EFFICIENT = AttentionKernel("cuda-efficient", (torch.float32,), _cuda_efficient_forward, _cuda_efficient_backward)
KERNELS = {"cpu": (CPU_FLASH,), "cuda": (CUDA_FLASH, CUDA_EFFICIENT)}


def kernel_for(device_type: str, dtype: torch.dtype, head_dim: int) -> AttentionKernel | None:
    """The kernel for tensors of this device kind, dtype and head size; None if there is none."""
    if device_type == "cuda" and not (head_dim % 8 == 0 and head_dim <= 256):
        return None
    return next((k for k in KERNELS.get(device_type, ()) if dtype in k.dtypes), None)


def runs_on(device: torch.device) -> bool:
    """Whether this device can run its kernels: any CPU; a CUDA device of compute capability
    8.0+ (FlashAttention-2's floor) in a CUDA build (ROCm's kernels differ, e.g. in the
    log-sum-exp padding)."""
    if device.type == "cpu":
        return True
    return (device.type == "cuda" and torch.version.cuda is not None
            and torch.cuda.get_device_capability(device) >= (8, 0))
