"""Deterministic activation-memory accounting.

Process RSS on a shared CPU machine is noise. What replay changes is which activations
autograd keeps for backward and how much prefix K/V stays alive, so that is what we
count: bytes of tensors saved for backward (deduplicated by storage, parameters
excluded) plus explicitly registered live tensors. On CUDA the allocator's peak is
reported next to it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class _Saved:
    """A saved-for-backward tensor, counted until autograd drops it."""

    __slots__ = ("tensor", "meter", "ptr")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, ptr: int):
        self.tensor, self.meter, self.ptr = tensor, meter, ptr
        meter._acquire(ptr, tensor.untyped_storage().nbytes())

    def __del__(self):
        self.meter._release(self.ptr)


class ActivationMeter:
    """Tracks current and peak bytes of saved activations + live buffers."""

    def __init__(self, model: torch.nn.Module | None = None):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()} if model else set()
        self._refs: dict[int, list[int]] = {}  # storage ptr -> [count, bytes]
        self.current = 0
        self.peak = 0

    def _acquire(self, ptr: int, nbytes: int) -> None:
        ref = self._refs.setdefault(ptr, [0, nbytes])
        if ref[0] == 0:
            self._add(nbytes)
        ref[0] += 1

    def _release(self, ptr: int) -> None:
        ref = self._refs[ptr]
        ref[0] -= 1
        if ref[0] == 0:
            self._add(-ref[1])
            del self._refs[ptr]

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr == 0 or ptr in self._params:
            return t
        return _Saved(self, t, ptr)

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    @contextmanager
    def measure(self):
        """Count tensors saved for backward inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    @contextmanager
    def hold(self, nbytes: int):
        """Count `nbytes` of explicitly held buffers (cached K/V and its grad) in the block."""
        self._add(nbytes)
        try:
            yield
        finally:
            self._add(-nbytes)


def device_peak_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None


def activation_bytes_per_position(config, dtype: torch.dtype) -> int:
    """Rough bytes autograd saves per token position for a Llama/Qwen2-style decoder:
    per layer ~8 hidden-sized tensors (norms, projections' inputs, residuals) and ~4
    intermediate-sized ones (gate, up, activation, down input); RMSNorm saves in float32."""
    elt = torch.tensor([], dtype=dtype).element_size()
    per_layer = 8 * config.hidden_size * elt + 4 * config.intermediate_size * elt + 2 * config.hidden_size * 4
    return config.num_hidden_layers * per_layer


def kv_bytes_per_position(config, dtype: torch.dtype) -> int:
    """Bytes of keys + values of one position over all layers."""
    elt = torch.tensor([], dtype=dtype).element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * elt
