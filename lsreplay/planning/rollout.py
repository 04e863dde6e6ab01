"""What a rollout shard's device holds: each rollout engine's memory at its peak, beside what
the other stages leave resident there; and what a vLLM engine keeps through the update."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lsreplay.core.config import ConfigError
from lsreplay.planning.shape import TreeShape
from lsreplay.planning.state import critic_params, lora_params, state_bytes
from lsreplay.planning.units import ELT, GiB
from lsreplay.replay.attention.kernels import kernel_for
from lsreplay.replay.memory import ModelDims, kv_bytes_per_position
from lsreplay.rollout.shared_prompt import PREFILL_CHUNK
from lsreplay.stages.prefixes import scores_reference


# A rollout shard holds one pool slot, so one device holds one shard's rollouts at a time.
@dataclass
class RolloutMemory:
    """What one rollout shard's device holds at the shard's peak: (key, label, bytes) lines,
    what the engine allocates and what other stages leave resident there."""

    engine: str
    shards: int  # rollout.shards
    trees: int  # trees one shard decodes together
    rows: int  # sequences decoding at once after the last fork
    peak_at: str
    lines: list[tuple[str, str, int]]
    kv_needed: int = 0  # an engine with a KV cache of its own: the bytes the shard's sequences need at once
    prompt_once: bool = True  # a tree's prompt K/V held once, not by each of its rows
    kv_too_small: bool = False  # the engine's KV cache cannot hold even one of the shard's sequences
    tensor_parallel: int = 1  # devices a shard's engine spans (rollout.vllm.tensor_parallel_size)

    @property
    def total(self) -> int:
        return sum(b for _, _, b in self.lines)

    def part(self, key: str) -> int:
        return sum(b for k, _, b in self.lines if k == key)


def resident_beside_rollouts(cfg, dims: ModelDims) -> list[tuple[str, str, int]]:
    """What a rollout device holds besides the engine (lsreplay.state.resident), at worst, for the
    device that also ran the other stages: the policy's compute weights; the update's state
    where one device of this process runs it (pool.devices_per_step=1: masters, gradients
    and AdamW moments stay on it between steps); the frozen policy versions asynchronous
    rollouts sample with; the reference with a KL term; the drafter the long tail decodes with."""
    n, elt, adapters = dims.params(), ELT[cfg.model.dtype], lora_params(cfg, dims)
    state = state_bytes(dims, cfg.model.dtype, 1, False, critic_params(cfg, dims), adapters)
    lines = [("weights", "policy weights (the resident compute copy)", state.weights)]
    if k := cfg.rollout.max_staleness:
        lines.append(("versions", f"{k + 1} frozen policy versions (rollout.max_staleness={k})",
                      (k + 1) * state.weights))
    if cfg.pool.devices_per_step == 1:
        lines.append(("state", "the update's state held (masters, gradients, AdamW)",
                      state.grads + state.master + state.moments))
    if scores_reference(cfg):
        lines.append(("reference", "the reference: the policy with its LoRA adapters off, no copy", 0) if adapters
                     else ("reference", "the reference model (KL term, DPO)", n * elt))
    if speculates(cfg):
        lines.append(("drafter", "the drafter (fc + one layer)", (2 * dims.hidden ** 2 + dims.hidden
                                                                   + dims.layer_params()) * elt))
    return lines


def speculates(cfg) -> bool:
    return cfg.drafter.enabled and cfg.rollout.spec_threshold > 0


def hf_rollout_memory(cfg, dims: ModelDims, shape: TreeShape) -> RolloutMemory:
    """The HF tree sampler (lsreplay.rollout.tree_sampler), worst case: every rollout runs to
    max_new_tokens. Where the pool's device kind has a cascade kernel for the dtype, each
    tree's prompt K/V is held once (rollout.shared_prompt) and each row holds its own
    completion's (a fork repeats those: reorder_cache); otherwise each row holds its own copy
    of its prompt's too. The rows' cache grows by a column per decode step, each layer's
    copied to append it (one layer's transient); with the drafter, the final-norm features
    of every column (each prompt's once where the prompts are shared), the rows' copied once
    where rows change; per step the float32 logits, log-softmax and sampling probabilities
    and the float64 CDF. At the prefill instead: the prompts' K/V and one layer's
    activations over a chunk of PREFILL_CHUNK prompt positions (estimate: MLP gate, up and
    product, the residual and attention rows), per prompt where they are shared, over every
    prompt's chunk at once otherwise. The larger phase is the peak."""
    elt, d = ELT[cfg.model.dtype], dims
    trees = -(-cfg.data.prompts_per_step // cfg.rollout.shards)
    rows, columns = trees * shape.rollouts, shape.prompt + shape.completion
    kvpp, features = kv_bytes_per_position(d, elt), d.hidden * elt if speculates(cfg) else 0
    shared = kernel_for(cfg.pool.accelerator, getattr(torch, cfg.model.dtype), d.head_dim) is not None
    held, own = (trees * shape.prompt, shape.completion) if shared else (0, columns)
    kv = (f"K/V cache ({trees} prompts x {shape.prompt} once, {rows} rows x {shape.completion} own)" if shared else
          f"K/V cache ({rows} rows x {columns} positions; each row its prompt's own)")
    decode = [("kv", kv, (held + rows * own) * kvpp),
              ("growth", "one layer's K/V copied to append a column", rows * own * kvpp // d.layers),
              ("features", "drafter features of every column, and a copy", (held + 2 * rows * own) * features),
              ("sampling", "logits, log-softmax, probabilities (fp32), CDF (fp64)", rows * d.vocab * (3 * 4 + 8))]
    positions = trees * shape.prompt
    chunk = (1 if shared else trees) * min(shape.prompt, PREFILL_CHUNK)
    layer = (4 * d.intermediate + 4 * d.hidden + 2 * d.q_dim + 2 * d.kv_dim) * elt + 4 * d.hidden
    prefill = [("kv", f"K/V cache ({trees} prompts x {shape.prompt} positions)", positions * kvpp),
               ("prefill", f"one layer's activations over {chunk} prompt positions (est.)", chunk * layer),
               ("features", "drafter features of the prompts", positions * features)]
    phase, lines = max((("the end of decoding", decode), ("the prefill", prefill)),
                       key=lambda p: sum(b for _, _, b in p[1]))
    return RolloutMemory("hf", cfg.rollout.shards, trees, rows, phase, resident_beside_rollouts(cfg, dims) + lines,
                         prompt_once=shared)


def vllm_rollout_memory(cfg, dims: ModelDims, shape: TreeShape) -> RolloutMemory:
    """A vLLM engine (lsreplay.rollout.vllm_engine) on the shard's device, beside what the
    trainer leaves there: the engine's own copy of the weights (it holds them between
    steps, updated in place; on CPU also the shared buffer the updates go through), its
    drafter, and its KV cache, sized up front
    (rollout.vllm.kv_cache_gb; on CUDA without it, gpu_memory_utilization of the device).
    Prefix caching stores a tree's prompt once (as the HF sampler holds it): at the end of
    decoding a shard needs its prompts plus every row's completion. A cache smaller than that still works (vLLM
    preempts and recomputes sequences), but slower: the plan counts the positions it holds;
    one smaller than a single sequence cannot serve it at all. With tensor parallelism
    (rollout.vllm.tensor_parallel_size) the engine spans that many devices, each holding a
    share of the weights and of the K/V heads (a head on several devices where there are
    fewer heads than devices), its cache that size on each; with decode context parallelism
    (rollout.vllm.decode_context_parallel_size) a head's devices split its positions."""
    elt, r = ELT[cfg.model.dtype], cfg.rollout
    tp, dcp = r.vllm.tensor_parallel_size, r.vllm.decode_context_parallel_size
    if dcp > 1 and (dcp > tp // dims.kv_heads or dims.heads // dims.kv_heads % dcp):
        raise ConfigError(f"rollout.vllm.decode_context_parallel_size={dcp}: vLLM splits a K/V head's positions over "
                          f"devices that would each hold a copy of it, at most tensor_parallel_size / K/V heads = "
                          f"{tp // dims.kv_heads} here, and only where the {dims.heads // dims.kv_heads} query heads "
                          "per K/V head divide by it; set it to 1")
    trees = -(-cfg.data.prompts_per_step // r.shards)
    rows = trees * shape.rollouts
    heads = max(1, dims.kv_heads // tp)  # of the K/V heads on a device
    kvpp = max(1, kv_bytes_per_position(dims, elt) * heads // (dims.kv_heads * dcp))  # a position's, on a device
    needed = (trees * shape.prompt + rows * shape.completion) * kvpp
    if r.vllm.kv_cache_gb or cfg.pool.accelerator != "cuda":
        cache, sized = int(r.vllm.kv_cache_gb * GiB), f"rollout.vllm.kv_cache_gb={r.vllm.kv_cache_gb:g}"
    else:
        cache = int(r.vllm.gpu_memory_utilization * cfg.pool.device_memory_gb * GiB)
        sized = f"gpu_memory_utilization={r.vllm.gpu_memory_utilization:g} of the device"
    over = f" (1/{tp} on each of {tp} devices)" if tp > 1 else ""
    lines = [("engine", f"the engine's copy of the policy weights{over}", dims.params() * elt // tp),
             ("kv", f"its KV cache ({sized}{f', {heads} of {dims.kv_heads} K/V heads' if tp > 1 else ''}"
                    f"{f', 1/{dcp} of their positions (decode context parallel)' if dcp > 1 else ''}: "
                    f"{cache // kvpp} positions; the shard needs {needed // kvpp} at once)", cache)]
    if cfg.pool.accelerator == "cpu":  # on CUDA this buffer is host memory, not the device's
        lines.append(("engine", "the shared buffer the policy's updates reach the engine through",
                      dims.params() * elt))
    if speculates(cfg):
        lines.append(("engine", "the engine's drafter (fc + one layer)",
                      (2 * dims.hidden ** 2 + dims.layer_params()) * elt // tp))
    longest = (shape.prompt + shape.completion) * kvpp
    return RolloutMemory("vllm", r.shards, trees, rows, "start-up (vLLM allocates its cache up front)",
                         resident_beside_rollouts(cfg, dims) + lines, kv_needed=needed,
                         kv_too_small=cache < longest, tensor_parallel=tp)


# The rollout engines the planner knows, by name (rollout.engine): (cfg, dims, shape) -> RolloutMemory.
ROLLOUT_ENGINES = {"hf": hf_rollout_memory, "vllm": vllm_rollout_memory}


def engine_during_update(cfg, rollout: RolloutMemory, accelerator: bool) -> dict:
    """What a vLLM engine holds on the device while the caching pass and the update run:
    nothing where it sleeps (CUDA, rollout.vllm.sleep_during_update), else its weights,
    drafter and KV cache (vLLM's CPU build has no sleep mode)."""
    if rollout.engine != "vllm":
        return {}
    kept = rollout.part("engine") + rollout.part("kv")
    if accelerator and cfg.rollout.vllm.sleep_during_update:
        return {"engine_during_update": f"released ({kept / GiB:.2f} GiB: weights and KV cache; vLLM's sleep mode, "
                                        "level 2, from the shard's end to the next weights' update)"}
    why = "rollout.vllm.sleep_during_update=false" if accelerator else "vLLM's CPU build has no sleep mode"
    return {"engine_kept": kept, "engine_during_update": f"kept ({why}): counted in the update's peak"}
