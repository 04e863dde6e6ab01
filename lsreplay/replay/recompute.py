"""Decoder layers of a kept span's forward that keep less for the backward and run again in it.

A branching span whose graph replay keeps (memory.kept_spans) is forwarded once with grad,
and its graph takes its subtree's dK/dV afterwards. Where the whole graph does not leave
room for its leaves' runs, some of its decoder layers keep less (memory.KeptLayers), each
under a non-reentrant torch.utils.checkpoint whose backward runs the layer again:

- a lean layer keeps its input and the outputs of its matrix products and attention
  kernels (selective activation checkpointing): run again, those ops hand back what they
  returned in the forward, and only the elementwise ops between them (norms, rotary
  embedding, activation, residual adds) compute, about a tenth of the layer's forward, for
  a bit over half of what its whole graph holds;
- a rerun layer keeps its input alone and runs again whole.

The span is still forwarded once before its subtree (its K/V feed the children); only
those layers' forward runs a second time, or their elementwise part, instead of the whole
span's forward without grad (the caching pass) that the fallback needs.

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
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from lsreplay.models.attention_switch import attention_for_thread
from lsreplay.models.hf_compat import CACHE_KEYWORD, decoder_layers
from lsreplay.replay.memory import ActivationMeter, KeptLayers

aten = torch.ops.aten
# What a lean layer keeps: the outputs of its matrix products (linear layers, with their
# bias or without) and of the attention kernels cascade.py and sdpa call. Batched products
# are left out: sdpa's math path computes its attention scores with them.
KEPT_OPS = frozenset({
    aten.mm.default, aten.addmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
})


@contextmanager
def recomputed_layers(model: torch.nn.Module, layers: KeptLayers, meter: ActivationMeter | None = None):
    """Inside the block, the model's first `layers.rerun` decoder layers (models.hf_compat.decoder_layers)
    keep only their input for the backward and the next `layers.lean` are lean; what lean
    layers keep counts in `meter`."""
    chosen = decoder_layers(model)[:layers.rerun + layers.lean]
    if len(chosen) < layers.rerun + layers.lean:
        raise ValueError(f"{type(model).__name__} has {len(chosen)} decoder layers; "
                         f"cannot run {layers.rerun + layers.lean} again")
    if clash := [i for i, layer in enumerate(chosen) if "forward" in layer.__dict__]:
        raise RuntimeError(f"decoder layers {clash} have their forward replaced already (a hook library's?)")
    for i, layer in enumerate(chosen):  # an instance attribute shadows the class's forward until deleted
        layer.forward = _Recomputed(layer, meter, lean=i >= layers.rerun)
    try:
        yield
    finally:
        for layer in chosen:
            del layer.forward


class _Recomputed:
    """A decoder layer's forward under a non-reentrant checkpoint, its cache rewound for the
    recompute; `lean`, with the outputs of KEPT_OPS kept (counted in `meter`) and handed
    back when it runs again."""

    def __init__(self, layer: torch.nn.Module, meter: ActivationMeter | None, lean: bool):
        self.forward = functools.partial(type(layer).forward, layer)
        self.attention = layer.self_attn
        self.meter, self.lean = meter, lean

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        cache = kwargs.get(CACHE_KEYWORD)  # the installed transformers' name for it
        layer = cache.layers[self.attention.layer_idx] if cache is not None else None
        past = layer.keys.shape[-2] if layer is not None and layer.is_initialized else 0
        implementation = self.attention.config._attn_implementation

        def contexts():
            if not self.lean:
                return nullcontext(), self._as_run(layer, past, implementation)
            kept = defaultdict(list)
            return _Keep(kept, self.meter), self._as_run(layer, past, implementation, _HandBack(kept))

        # Without early stop the recompute runs to the layer's end, handing back every kept output.
        return checkpoint(self.forward, hidden_states, *args, use_reentrant=False, early_stop=not self.lean,
                          context_fn=contexts, **kwargs)

    @contextmanager
    def _as_run(self, layer, past: int, implementation: str, hand_back: _HandBack | None = None):
        """The recompute's surroundings as the forward had them: the cache layer holding its
        first `past` positions only, the attention implementation (and a lean layer's kept
        outputs handed back); then as they are."""
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if layer is not None:
            layer.keys, layer.values = keys[..., :past, :], values[..., :past, :]
        try:
            # On CUDA the recompute runs on autograd's device thread: the forward's choice of
            # attention (made per thread) is made again here.
            with attention_for_thread([self.attention.config], implementation), hand_back or nullcontext():
                yield
        finally:
            if layer is not None:
                layer.keys, layer.values = keys, values


class _Kept:
    """One kept output: what ActivationMeter.keep returned (or the tensor), and its version."""

    __slots__ = ("handle", "version")

    def __init__(self, t: torch.Tensor, meter: ActivationMeter | None):
        t = t.detach()
        self.handle, self.version = (meter.keep(t) if meter else t), t._version

    def tensor(self) -> torch.Tensor:
        t = ActivationMeter.kept(self.handle)
        if t._version != self.version:
            raise RuntimeError("a lean layer's kept output was modified in place after its forward; "
                               "its recompute would not see what the forward computed")
        return t


class _Keep(TorchDispatchMode):
    """A lean layer's forward: the outputs of KEPT_OPS, in the order they ran, per op, each
    counted in the meter until the recompute takes it (or the graph is dropped)."""

    def __init__(self, kept: dict, meter: ActivationMeter | None):
        super().__init__()
        self.kept, self.meter = kept, meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in KEPT_OPS:
            self.kept[func].append(tree_map_only(torch.Tensor, lambda t: _Kept(t, self.meter), out))
        return out


class _HandBack(TorchDispatchMode):
    """A lean layer's recompute: KEPT_OPS hand back their forward's outputs, in order."""

    def __init__(self, kept: dict):
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in KEPT_OPS:
            return func(*args, **(kwargs or {}))
        return tree_map_only(_Kept, _Kept.tensor, self.kept[func].pop(0))
