"""What one host holds: offloaded layer inputs, checkpoint snapshots, host-held prefix K/V,
vLLM's update buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lsreplay.planning.shape import TreeShape
from lsreplay.planning.step_io import StepIO
from lsreplay.planning.units import ELT
from lsreplay.planning.update import kept_view, planned_split
from lsreplay.replay.memory import LayerByLayer, ModelDims


@dataclass
class HostMemory:
    """What one host holds at most (pool.devices_per_host of the pool's devices): (label,
    bytes) lines."""

    devices: int  # devices a host holds
    hosts: int
    lines: list[tuple[str, int]]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.lines)


def offloaded_bytes(dims: ModelDims, dtype: torch.dtype, spans, kept: dict) -> int:
    """What one device's backward holds in pinned host memory at once (replay.offload_prefix,
    on CUDA): the inputs of layers 1.. of the spans run layer by layer down a root-to-leaf
    path (layerwise.py; the first layer's is recomputed), the path's first."""
    elt = torch.tensor([], dtype=dtype).element_size()
    out, span = 0, spans[0]
    while not span.is_leaf:
        choice = kept.get(span.id)
        if isinstance(choice, LayerByLayer) and choice.offload:
            out += (dims.layers - 1) * len(span.tokens) * dims.hidden * elt
        span = spans[span.children[0]]
    return out


def host_memory(cfg, dims: ModelDims, shape: TreeShape, io: StepIO, minibatch_kv: int) -> HostMemory:
    """The most one host holds: per update device the layer inputs its backward offloads
    (replay.offload_prefix); the checkpoint snapshots of the trainable state, at most two
    waiting for the writer (the first host's); the prefix K/V the host keeps between the
    caching pass and the update (replay.kv_offload=host) and those of PPO's later
    minibatches, its devices' share; with vLLM on CUDA, each engine's buffer the policy's
    updates reach it through. (On a CPU pool the devices are this memory too: the device
    table counts what they hold.)"""
    pool, elt = cfg.pool, ELT[cfg.model.dtype]
    devices = pool.devices_per_host or pool.slots
    ranks = min(devices, pool.devices_per_step)  # the update's devices on the first host
    lines = []
    if pool.accelerator == "cuda" and cfg.replay.mode == "replay" and cfg.replay.offload_prefix:
        spans, kept, _, _ = kept_view(dims, getattr(torch, cfg.model.dtype), shape, cfg.replay.budget_mb * 2**20 or None,
                                      True, cfg.replay.join_below, True, planned_split(cfg, dims, shape, True))
        if offloaded := offloaded_bytes(dims, getattr(torch, cfg.model.dtype), spans, kept):
            lines.append((f"layer inputs of prompts run layer by layer, pinned, x {ranks} devices", ranks * offloaded))
    lines.append(("checkpoint snapshots: fp32 masters + AdamW, two at most", 2 * io.checkpoint))
    share = lambda total: total * ranks // pool.devices_per_step  # noqa: E731
    if cfg.replay.mode == "replay" and cfg.replay.kv_offload == "host":
        lines.append(("prefix K/V from the caching pass to the update (kv_offload=host)", share(io.prefix_kv)))
    if minibatch_kv:
        lines.append(("PPO's later minibatches: their trees' prefix K/V", share(minibatch_kv)))
    if cfg.rollout.engine == "vllm" and pool.accelerator == "cuda":
        lines.append((f"vLLM: the buffer the policy's updates reach it by, x {devices} devices",
                      devices * dims.params() * elt))
    return HostMemory(devices, -(-pool.slots // devices), lines)
