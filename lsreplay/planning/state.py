"""The model state a device holds during the update: weights, the gradient accumulator,
master weights and AdamW moments, replicated or sharded (FSDP); a critic's and LoRA's
parameters."""

from __future__ import annotations

from dataclasses import dataclass

from lsreplay.core.config import ConfigError
from lsreplay.planning.units import ELT
from lsreplay.replay.memory import ModelDims


@dataclass
class StateBytes:
    weights: int  # compute copy, full during the backward
    grads: int  # gradient accumulator, full during the backward
    master: int  # float32 master weights (mixed precision), sharded under FSDP
    moments: int  # AdamW exp_avg + exp_avg_sq, sharded under FSDP
    grad_shard: int  # FSDP: the reduced gradient shard (0 without FSDP: reduced in place)
    notes: str = ""

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master + self.moments + self.grad_shard


def critic_params(cfg, dims: ModelDims) -> int:
    """The critic's parameters: a value head (hidden -> 1) on the policy's trunk, with
    algo.critic (lsreplay.algos.critic); it has no K/V, caching pass or model of its own."""
    return dims.hidden + 1 if cfg.algo.critic else 0


# (in, out) features of each projection LoRA adapts (model.lora.target_modules), by name.
def projection_shapes(dims: ModelDims) -> dict[str, tuple[int, int]]:
    h, q, kv, i = dims.hidden, dims.q_dim, dims.kv_dim, dims.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def lora_params(cfg, dims: ModelDims) -> int:
    """The LoRA adapters' parameters (model.lora): A (rank x in) and B (out x rank) per target
    projection of every layer (all-linear: all of them; a dotted name by its last part, in
    every layer); 0 without LoRA."""
    from lsreplay.core.config import ALL_LINEAR

    lora = cfg.model.lora
    if not lora.enabled:
        return 0
    shapes = projection_shapes(dims)
    targets = list(shapes) if lora.target_modules == [ALL_LINEAR] else \
        list(dict.fromkeys(t.rpartition(".")[2] for t in lora.target_modules))
    if unknown := [t for t in targets if t not in shapes]:
        raise ConfigError(f"lsreplay plan counts LoRA adapters on {', '.join(shapes)}; model.lora.target_modules "
                          f"names {unknown}: plan with those projections")
    return dims.layers * lora.rank * sum(sum(shapes[t]) for t in targets)


def state_bytes(dims: ModelDims, dtype: str, ranks: int, fsdp: bool, extra_params: int = 0,
                adapters: int = 0) -> StateBytes:
    """bfloat16 means mixed precision: bf16 compute weights, float32 master weights,
    AdamW moments and gradient accumulation. float32/float64: one copy in that dtype.
    extra_params: trained beside the model's (a critic's value head). adapters: LoRA's
    parameters; then the base is held in the compute dtype and only they (and the extra
    ones) have gradients, masters and moments."""
    n = dims.params() + extra_params + adapters
    trained = adapters + extra_params if adapters else n
    elt = ELT[dtype]
    mixed = dtype == "bfloat16"
    opt_elt = 4 if mixed else elt
    shard = ranks if fsdp else 1
    weights = n * elt
    grads = trained * opt_elt
    master = trained * 4 // shard if mixed else 0
    moments = 2 * trained * opt_elt // shard
    grad_shard = trained * opt_elt // shard if fsdp else 0
    if fsdp and not mixed:  # the sharded parameter is the master copy
        master = trained * elt // shard
    parts = [f"{extra_params} of them the critic"] if extra_params else []
    if adapters:
        parts.append(f"{trained / 1e6:.1f}M trained: LoRA adapters{' and the critic' if extra_params else ''}")
    of_them = f" ({'; '.join(parts)})" if parts else ""
    return StateBytes(weights, grads, master, moments, grad_shard,
                      notes=f"{n / 1e9:.3f}B params{of_them}, "
                            f"{'mixed bf16/fp32' if mixed else dtype}, {'FSDP over ' + str(ranks) if fsdp else 'replicated'}")
