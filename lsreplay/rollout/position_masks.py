"""Attention masks by position, for decoding over a cache whose rows have holes.

Speculative decoding (speculative.py) verifies a batch's drafts in one forward and hides
each row's rejected ones as holes among its cache columns. A 2D mask over columns is all a
full-attention layer needs; transformers' sliding-window and chunked masks, though, are
laid out by cache column, so a hole would shift a row's window. For a model with such
layers (models.families.windowed_layers), `PositionMasks` builds each layer type's mask
from the positions the visible columns hold (their rank among a row's visible columns, as
position ids count them) and the layer's Visibility (replay/attention/windows.py): a 4D
additive mask transformers hands to the attention as it is (a very low finite value where
hidden, as in transformers' own eager masks: a padding query that sees nothing gets no NaN), one per layer type in the
mapping the families with several layer types take, the mask itself where every layer is
of one type (the families that take no mapping).
"""

from __future__ import annotations

import torch

from lsreplay.replay.attention.windows import Visibility, typed_visibility


class PositionMasks:
    """The masks of a model with windowed or chunked layers (see the module docstring)."""

    def __init__(self, config):
        self.types: dict[str, Visibility] = dict(typed_visibility(config))

    def __call__(self, columns: torch.BoolTensor, new: int, dtype: torch.dtype) -> torch.Tensor | dict:
        """`columns` (rows, cache columns): which columns each row sees, its `new` last ones
        the queries'; the masks (rows, 1, new, cache columns) in `dtype`."""
        positions = columns.long().cumsum(1) - 1  # a visible column's position; hidden ones are masked anyway
        keys, queries = positions[:, None, :], positions[:, -new:, None]
        masks = {}
        for kind, visibility in self.types.items():
            seen = columns[:, None, :] & visibility.sees(queries, keys)
            masks[kind] = torch.zeros(seen.shape, dtype=dtype, device=columns.device).masked_fill(
                ~seen, _hidden(dtype))[:, None]
        return next(iter(masks.values())) if len(masks) == 1 else masks


def _hidden(dtype: torch.dtype) -> float:
    """What a hidden column adds to a logit: the dtype's lowest value, but float32's for
    float64, which eager attention (Gemma 2) casts to float32 for its softmax."""
    return max(torch.finfo(dtype).min, torch.finfo(torch.float32).min)
