"""What a step moves through the store: prefix K/V, scored entries and hidden states,
checkpoints; and what stages that keep nothing load instead."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lsreplay.models.train_state import master_dtype
from lsreplay.planning.shape import TreeShape
from lsreplay.planning.state import critic_params, lora_params
from lsreplay.planning.units import ELT
from lsreplay.planning.update import kept_view, planned_split
from lsreplay.replay.memory import ModelDims, kv_bytes_per_position
from lsreplay.stages.prefixes import scores_logprobs, scores_reference


@dataclass
class StepIO:
    """What a step moves through the store (bytes, the whole run's, not per device)."""

    prefix_kv: int  # the caching pass writes the branching spans' K/V, the backward reads them
    activations: int  # entry logprobs for KL, hidden states for the drafter: written, read once or twice
    checkpoint: int  # float32 masters, AdamW moments: one checkpoint
    every: int  # steps per checkpoint
    model_loads: int  # what stages that keep nothing read instead (checkpoint.resident=false)
    bandwidth: float  # the store's bytes per second

    @property
    def written(self) -> float:
        return self.prefix_kv + self.activations + self.checkpoint / self.every

    @property
    def read(self) -> int:
        return self.prefix_kv + self.activations

    def seconds(self, resident: bool = True) -> float:
        """Store time a step costs; stages that keep nothing also load the models and write
        and read back a checkpoint every step (checkpoint.every must be 1 then)."""
        if resident:
            return (self.written + self.read) / self.bandwidth
        return (2 * (self.prefix_kv + self.activations + self.checkpoint) + self.model_loads) / self.bandwidth


def step_io(cfg, dims: ModelDims, shape: TreeShape) -> StepIO:
    """Bytes per step: K/V of the branching spans replay reads (after joining; not those
    whose graphs it keeps), with a KL penalty every entry's logprobs, with the drafter every
    position's hidden state; a checkpoint per checkpoint.every steps; and, for stages that
    keep nothing, the models they load (each rollout shard and the caching pass the
    weights, the update the masters and moments)."""
    elt, n = ELT[cfg.model.dtype], dims.params()
    trees = cfg.data.prompts_per_step
    kv = 0
    if cfg.replay.mode == "replay" and not planned_split(cfg, dims, shape, cfg.pool.accelerator == "cuda"):
        # (The caching pass keeps no K/V of a tree the update splits: its ranks compute what they read.)
        spans, kept, _, _ = kept_view(dims, getattr(torch, cfg.model.dtype), shape, cfg.replay.budget_mb * 2**20 or None,
                                      cfg.pool.accelerator == "cuda", cfg.replay.join_below, cfg.replay.offload_prefix)
        read = sum(len(s.tokens) for s in spans if not s.is_leaf and s.id not in kept)
        kv = trees * read * kv_bytes_per_position(dims, elt)
    # The caching pass scores entries (float64) where a loss reads them: the policy's
    # logprobs (KL, PPO, DPO; with vLLM every logprob_gap_every steps, to measure the
    # engine's), the reference's (KL, DPO), the critic's values; it keeps hidden states
    # only for the drafter.
    gap = cfg.rollout.engine == "vllm" and cfg.rollout.vllm.logprob_gap_every > 0
    scored = max(scores_logprobs(cfg), gap / max(cfg.rollout.vllm.logprob_gap_every, 1)) + scores_reference(cfg) \
        + cfg.algo.critic
    logprobs = (shape.unique_positions - shape.prompt) * scored * 8
    hidden = shape.unique_positions * dims.hidden * elt if cfg.drafter.enabled else 0
    master = ELT[master_dtype(cfg.model.dtype)]
    adapters = lora_params(cfg, dims)  # with LoRA only they (and a critic) are checkpointed
    checkpoint = 3 * ((adapters or n) + critic_params(cfg, dims)) * master  # masters + two AdamW moments
    loads = (cfg.rollout.shards + 1 + scores_reference(cfg)) * n * master
    return StepIO(kv, trees * (logprobs + hidden), checkpoint, cfg.checkpoint.every, loads,
                  cfg.storage.bandwidth_gbps * 1e9)
