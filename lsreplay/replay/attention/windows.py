"""Which keys a layer's queries see: every earlier one, the last window's, or their chunk's.

Sliding-window layers (Mistral, Qwen2 with use_sliding_window, Gemma 2/3, GPT-OSS, OLMo 3,
Cohere 2, ...) let query position i see key position j when i - j < window; chunked layers
(Llama 4) when i and j lie in the same chunk of `chunk` positions. transformers sets both
per layer from the config (`layer_types`, `sliding_window`, `attention_chunk_size`), for its
masks and its cache; `layer_visibility` reads them the same way, so replay's masks are the
family's own.

Cascade attention (replay/cascade.py) splits a run's attention into parts, the row's own
keys and each ancestor's, by absolute positions. Per part, `part_mask` says which of its
keys each query sees: none (the part is skipped), all (no mask, the fused kernels' fast
path) or some (a mask, over the keys any query may see only: a window's worth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs


@dataclass(frozen=True)
class Visibility:
    """Query position i sees key position j <= i: all of them, those with i - j < `window`,
    or those with i // `chunk` == j // `chunk`."""

    window: int | None = None
    chunk: int | None = None

    @property
    def full(self) -> bool:
        return self.window is None and self.chunk is None

    def first_key(self, query: int) -> int:
        """The first key position a query at position `query` or later may see."""
        if self.window is not None:
            return max(0, query - self.window + 1)
        if self.chunk is not None:
            return query // self.chunk * self.chunk
        return 0

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """(len(queries), len(keys)) booleans: which key positions each query position sees."""
        return self.sees(queries[:, None], keys[None, :])

    def sees(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Whether query positions `q` see key positions `k` (broadcast against each other)."""
        seen = k <= q
        if self.window is not None:
            seen &= q - k < self.window
        if self.chunk is not None:
            seen &= q // self.chunk == k // self.chunk
        return seen


def layer_visibility(config) -> list[Visibility]:
    """Each decoder layer's Visibility, as transformers' cache and masks read the config."""
    return [visibility for _, visibility in typed_visibility(config)]


def typed_visibility(config) -> list[tuple[str, Visibility]]:
    """Each decoder layer's type as the config names it (the key of its mask where a family
    builds one per type) and its Visibility."""
    kinds, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    out = []
    for kind, kwargs in zip(kinds, layer_kwargs):
        size = kwargs.get("sliding_window")
        out.append((kind, Visibility(window=size if kind == "sliding_attention" else None,
                                     chunk=size if kind == "chunked_attention" else None)))
    return out


def part_mask(visibility: Visibility, query_start: int, width: int, key_start: int, keys: int,
              dtype: torch.dtype, device) -> tuple[int, torch.Tensor | None] | None:
    """How the queries at positions query_start.. (`width` of them) see a part of `keys` keys
    at positions key_start..: None if they see none of it; else (first, mask): the part's keys
    from index `first` on are those any query may see, and `mask` (width, keys - first),
    additive (0 / -inf) in `dtype`, says which (None: every query sees every one of them)."""
    first = max(0, visibility.first_key(query_start) - key_start)
    if first >= keys:
        return None
    if visibility.full and key_start + keys <= query_start:
        return first, None
    queries = torch.arange(query_start, query_start + width, device=device)
    seen = visibility.visible(queries, torch.arange(key_start + first, key_start + keys, device=device))
    if not seen.any():
        return None
    if seen.all():
        return first, None
    return first, torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, -math.inf)


def own_mask(visibility: Visibility, start: int, width: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """The additive mask of a run's queries over its own keys (positions start.., `width` of
    both), or None where causality alone says it (the fused kernels' is_causal)."""
    if visibility.full or visibility.first_key(start + width - 1) <= start and (
            visibility.chunk is None or start // visibility.chunk == (start + width - 1) // visibility.chunk):
        return None
    positions = torch.arange(start, start + width, device=device)
    seen = visibility.visible(positions, positions)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, -math.inf)
