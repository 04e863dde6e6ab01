"""Decoder layers of a kept span's forward that keep only their input and run again in the backward.

A branching span whose graph replay keeps (memory.kept_spans) is forwarded once with grad,
and its graph takes its subtree's dK/dV afterwards. Where the whole graph does not leave
room for its leaves' runs, its first `count` decoder layers run under torch.utils.checkpoint
(non-reentrant): they save their input alone, and the backward runs them again when it
reaches them. The span is still forwarded once before its subtree (its K/V feed the
children); only those layers' forward runs a second time, instead of the whole span's
forward without grad (the caching pass) that the fallback needs.

The recompute must run what the forward ran. A layer writes its keys and values into the
forward's cache, which its children read and at which their dK/dV are injected: run again
in the backward it would append them a second time, so for the recompute the cache's layer
is set back to what it held before the layer ran (its past), and restored after; the
recompute sees the same keys and values, and the forward's own are left as they were. And
the attention implementation the forward ran with (cascade.py's, switched on for the
forward only) is switched on again for the recompute.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext

import torch
from torch.utils.checkpoint import checkpoint


@contextmanager
def recomputed_layers(model: torch.nn.Module, count: int):
    """Inside the block, the model's first `count` decoder layers (model.base_model.layers)
    keep only their input for the backward and run again in it."""
    layers = list(getattr(model.base_model, "layers", []))[:count]
    if len(layers) < count:
        raise ValueError(f"{type(model).__name__} has {len(layers)} decoder layers; cannot recompute {count}")
    if clash := [i for i, layer in enumerate(layers) if "forward" in layer.__dict__]:
        raise RuntimeError(f"decoder layers {clash} have their forward replaced already (a hook library's?)")
    for layer in layers:  # an instance attribute shadows the class's forward until deleted
        layer.forward = _Recomputed(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


class _Recomputed:
    """A decoder layer's forward under a non-reentrant checkpoint, its cache rewound for the
    recompute."""

    def __init__(self, layer: torch.nn.Module):
        self.forward = functools.partial(type(layer).forward, layer)
        self.attention = layer.self_attn

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        cache = kwargs.get("cache")
        layer = cache.layers[self.attention.layer_idx] if cache is not None else None
        past = layer.keys.shape[-2] if layer is not None and layer.is_initialized else 0
        implementation = self.attention.config._attn_implementation
        return checkpoint(self.forward, hidden_states, *args, use_reentrant=False,
                          context_fn=lambda: (nullcontext(), self._as_run(layer, past, implementation)), **kwargs)

    @contextmanager
    def _as_run(self, layer, past: int, implementation: str):
        """The recompute's surroundings as the forward had them: the cache layer holding its
        first `past` positions only, the attention implementation; then as they are."""
        config = self.attention.config
        keys, values, previous = getattr(layer, "keys", None), getattr(layer, "values", None), config._attn_implementation
        if layer is not None:
            layer.keys, layer.values = keys[..., :past, :], values[..., :past, :]
        config._attn_implementation = implementation
        try:
            yield
        finally:
            config._attn_implementation = previous
            if layer is not None:
                layer.keys, layer.values = keys, values
