"""The plan of one config: its model's dims, its trees' shape, and per device the update's
peak (replay and naive), the rollouts', per host what it holds, and the store I/O a step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lsreplay.core.config import ConfigError
from lsreplay.planning.context import ContextPlan, context_plan
from lsreplay.planning.host import HostMemory, host_memory
from lsreplay.planning.rollout import ROLLOUT_ENGINES, RolloutMemory, engine_during_update
from lsreplay.planning.shape import TreeShape
from lsreplay.planning.state import StateBytes, critic_params, lora_params, state_bytes
from lsreplay.planning.step_io import StepIO, step_io
from lsreplay.planning.units import ELT, GiB
from lsreplay.planning.update import (RunPeak, joined_levels, naive_peak, planned_split, replay_path, replay_peak,
                                      rounds_bytes, workspace_bytes)
from lsreplay.replay.memory import ModelDims
from lsreplay.stages.objectives import updates_per_step


RESERVE_BYTES = 2 * GiB  # CUDA context, NCCL/gloo buffers
FRAGMENTATION = 0.05  # of device memory, allocator slack


@dataclass
class Plan:
    model: str
    dims: ModelDims
    dtype: str
    mode: str
    ranks: int
    fsdp: bool
    device_bytes: int  # 0 = unknown
    shape: TreeShape
    trees: int
    state: StateBytes
    replay: RunPeak
    naive: RunPeak
    replay_workspace: int
    naive_workspace: int
    rollout: RolloutMemory | None = None
    io: StepIO | None = None
    budget_bytes: int | None = None
    join_below: int = 0
    algo: str = "grpo"
    updates: int = 1  # optimizer updates a step makes (PPO: epochs x minibatches)
    # PPO's later minibatches: the caching pass again, its prefix K/V held in host memory
    minibatch_kv: int = 0
    critic: int = 0  # the critic's parameters (a value head on the trunk)
    adapters: int = 0  # LoRA's parameters (model.lora): all that trains beside the critic
    replay_path: str = ""  # how the update runs each branching level (replay_path)
    host: HostMemory | None = None
    host_bytes: int = 0  # pool.host_memory_gb; 0 = unknown
    engine_kept: int = 0  # what a vLLM engine keeps on the device through the caching pass and the update
    engine_during_update: str = ""  # what happens to the engine's memory then, in words
    context: ContextPlan | None = None  # a prompt split over ranks (replay.context_parallel)

    @property
    def trees_per_device(self) -> int:
        return -(-self.trees // self.ranks)

    @property
    def positions_per_step(self) -> int:
        return self.trees * self.shape.total_positions

    @property
    def replay_positions_per_step(self) -> int:
        root, levels = self.shape.radix()
        return self.trees * TreeShape(root, joined_levels(levels, self.join_below)).unique_positions

    def overhead(self) -> int:
        """Context/NCCL reserve and fragmentation slack of an accelerator (none if unknown)."""
        return RESERVE_BYTES + int(FRAGMENTATION * self.device_bytes) if self.device_bytes else 0

    def peak(self, mode: str) -> int:
        run, work = (self.replay, self.replay_workspace) if mode == "replay" else (self.naive, self.naive_workspace)
        return self.state.total + run.total + work + self.engine_kept + self.overhead()

    def fits(self, mode: str | None = None) -> bool | None:
        """Whether the update (in `mode`, default the configured one) fits a device; None if
        the device's memory is unknown."""
        if not self.device_bytes:
            return None
        return self.peak(mode or self.mode) <= self.device_bytes

    def rollout_peak(self) -> int:
        return self.rollout.total + self.overhead()

    def rollout_fits(self) -> bool | None:
        if self.rollout.kv_too_small:
            return False
        return None if not self.device_bytes else self.rollout_peak() <= self.device_bytes

    def host_fits(self) -> bool | None:
        return None if not (self.host_bytes and self.host) else self.host.total <= self.host_bytes

    def step_fits(self) -> bool | None:
        """Whether the rollouts and the update both fit a device (and its host, where its
        memory is known)."""
        return None if not self.device_bytes else bool(self.fits() and self.rollout_fits()
                                                        and self.host_fits() is not False)


def load_plan_config(path: str | None, overrides: list[str] = ()) -> tuple:
    """The run config and the fields the planner reads."""
    from lsreplay.core.config import load_config

    cfg = load_config(path, overrides)
    return cfg, plan_values(cfg)


def plan_values(cfg) -> dict:
    """The fields of a run config the planner reads (make_plan's `values`)."""
    return {"model.arch": dict(cfg.model.arch), "pool.device_memory_gb": cfg.pool.device_memory_gb,
            "pool.devices_per_step": cfg.pool.devices_per_step, "replay.fsdp": cfg.replay.fsdp,
            "pool.accelerator": cfg.pool.accelerator}


def model_dims(cfg, arch: dict) -> tuple[str, ModelDims]:
    """From model.arch (HF config kwargs with model_type) or the config of model.path."""
    from transformers import AutoConfig

    from lsreplay.models.families import family

    if arch:
        kwargs = dict(arch)
        model_type = kwargs.pop("model_type", None)
        if not model_type:
            raise ConfigError("config key 'model.arch' needs a model_type (e.g. qwen2, llama) next to its dims")
        try:
            hf = AutoConfig.for_model(model_type, **kwargs)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"config key 'model.arch': {e}") from None
        family(hf)
        return f"{model_type} (random init from model.arch)", ModelDims.from_hf(hf, count_params=True)
    from lsreplay.models.loading import resolve_model_dir

    folder = resolve_model_dir(cfg.model)
    hf = AutoConfig.from_pretrained(folder, local_files_only=True)
    family(hf)
    return str(cfg.model.path), ModelDims.from_hf(hf, count_params=True)


def make_plan(cfg, values: dict, dims: ModelDims | None = None, model_name: str = "") -> Plan:
    if dims is None:
        model_name, dims = model_dims(cfg, values["model.arch"])
    dtype_name = cfg.model.dtype
    dtype = getattr(torch, dtype_name)
    elt = ELT[dtype_name]
    r = cfg.rollout
    shape = TreeShape.of_rollouts(cfg.data.max_prompt_tokens, r)
    ranks, fsdp = values["pool.devices_per_step"], values["replay.fsdp"]
    budget = cfg.replay.budget_mb * 2**20 or None
    # Leaves attend to their prefix in place where the pool's device kind has a kernel.
    accelerator = values["pool.accelerator"] == "cuda"
    offload = cfg.replay.offload_prefix
    split = planned_split(cfg, dims, shape, accelerator)
    replay = replay_peak(dims, dtype, shape, budget, accelerator, cfg.replay.join_below, offload, split)
    naive = naive_peak(dims, elt, shape)
    io = step_io(cfg, dims, shape)
    updates = updates_per_step(cfg)
    minibatch = math.ceil(cfg.data.prompts_per_step / cfg.algo.minibatches)
    minibatch_kv = io.prefix_kv * minibatch // cfg.data.prompts_per_step if updates > 1 else 0
    return Plan(model=model_name, dims=dims, dtype=dtype_name, mode=cfg.replay.mode, ranks=ranks, fsdp=fsdp,
                device_bytes=int(values["pool.device_memory_gb"] * GiB), shape=shape,
                trees=cfg.data.prompts_per_step,
                state=state_bytes(dims, dtype_name, ranks, fsdp, critic_params(cfg, dims), lora_params(cfg, dims)),
                replay=replay, naive=naive,
                replay_workspace=workspace_bytes(dims, elt, replay) + rounds_bytes(dims, elt, replay, split),
                naive_workspace=workspace_bytes(dims, elt, naive), rollout=ROLLOUT_ENGINES[r.engine](cfg, dims, shape),
                io=io, budget_bytes=budget, join_below=cfg.replay.join_below, algo=cfg.algo.name, updates=updates,
                minibatch_kv=minibatch_kv, host=host_memory(cfg, dims, shape, io, minibatch_kv),
                host_bytes=int(cfg.pool.host_memory_gb * GiB),
                critic=critic_params(cfg, dims), adapters=lora_params(cfg, dims),
                replay_path=replay_path(dims, dtype, shape, budget, accelerator, cfg.replay.join_below, offload,
                                        split),
                context=split and context_plan(dims, elt, split, offload and accelerator,
                                               shape.unique_positions - shape.radix()[0], _run_width(shape),
                                               shape.total_positions, shape.rollouts,
                                               -(-cfg.data.prompts_per_step * split.ranks // ranks) if split else 0,
                                               cfg.pool.interconnect_gbps, cfg.pool.device_tflops),
                **engine_during_update(cfg, ROLLOUT_ENGINES[r.engine](cfg, dims, shape), accelerator))


def _run_width(shape: TreeShape) -> int:
    """The longest run below the prompt: a path of the levels under it."""
    return sum(seg for _, seg in shape.radix()[1])
