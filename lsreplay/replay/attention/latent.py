"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, ...): a cache of latents, and
values narrower than queries and keys.

transformers caches latent attention compressed: per position one latent (kv_lora_rank) as
the cache's "keys" and one shared rotary key part as its "values", and each attention
module decompresses them (`expand_kv`) into per-head keys (qk_nope + qk_rope dimensions)
and values (v_head_dim) after reading the cache. So the K/V replay hands from a prefix to
its branches is the latent one, a fraction of the decompressed size, and cascade attention
(replay/cascade.py) decompresses an ancestor's part per layer as the module does its cache:
differentiably, so the branches' gradient reaches the latents (and through them the
prefix) and the decompression's weights, as in a plain forward.

The fused kernels take one head size for queries, keys and values, so cascade attention
pads the narrower side with zeros: zero key and query dimensions add nothing to q k^T (the
scale is given, not derived from the size), zero value dimensions give zero outputs that
are cut off again. Padding and cutting are differentiable: the gradients are the unpadded ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decompressed(module: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values `module` attends with, from what its cache holds."""
    expand = getattr(module, "expand_kv", None)
    return (keys, values) if expand is None else expand(keys, values)


def padded(tensors: list[torch.Tensor], size: int) -> list[torch.Tensor]:
    """`tensors` (..., d) zero-padded to `size` in their last dimension (as they are if d == size)."""
    return [t if t.shape[-1] == size else F.pad(t, (0, size - t.shape[-1])) for t in tensors]


def common_head_dim(query: torch.Tensor, value: torch.Tensor) -> int:
    return max(query.shape[-1], value.shape[-1])
