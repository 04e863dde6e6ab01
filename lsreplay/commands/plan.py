"""Memory planner: will one RL step of this config fit the devices, and how many token
positions does it train?

    lsreplay plan CONFIG.yaml [key=value ...]

Per device it counts, for branch replay and for the per-rollout (naive) backward:

- model state: compute weights, the gradient accumulator, AdamW moments and (bfloat16
  models: mixed precision) float32 master weights. With LoRA (model.lora) the base's
  weights in the compute dtype, and gradients, masters and moments for the adapters alone. Without FSDP every rank holds all of
  it. With FSDP (`lsreplay.distributed.parallel.shard_model`) the master weights, moments and reduced
  gradient are sharded over the ranks, but during the backward a rank holds the full
  compute weights and a full gradient accumulator (float32 for mixed precision): the
  backward gathers the parameters once and reduce-scatters once, because ranks run
  different trees (see lsreplay/distributed/parallel.py).
- held prefix K/V: the keys/values of the root-to-leaf path being replayed, and their
  gradients, the kept graphs above it, the layer inputs of a prompt run layer by layer
  (replay only).
- saved activations of the largest single forward/backward of the step: naive, one full
  rollout (prompt + completion); replay, the largest of: the recompute of a branching
  node, one layer's recompute over a chunk of a prompt run layer by layer, a micro-batch of
  sibling leaves on top of their prefix. This mirrors
  `replay_backward`'s schedule (including its leaf micro-batching) and counts what
  `ActivationMeter` counts, with per-tensor byte counts measured for Llama/Qwen2 under
  transformers 5.x, sdpa and cascade attention (`saved_bytes`; tests/test_plan.py checks it
  against the meter).
- workspace (estimate, not validated on a GPU): the transient logits of the run's
  completion tokens and twice one layer's activations for the backward; plus a fixed
  reserve (CUDA context, NCCL buffers) and 5% of the device for allocator fragmentation.

And for the rollouts, per device (one rollout shard holds one device): what the rollout
engine allocates at its peak (ROLLOUT_ENGINES, a function per engine; the HF tree sampler:
each prompt's K/V once and each decoding row's completion K/V, drafter features, sampling
buffers; vLLM: its KV cache, whose prefix cache holds each prompt once) next to what the other
stages leave resident there (the policy's compute weights, a one-device update's state,
the reference, the drafter).

And per host (pool.devices_per_host of the pool's devices; a verdict at pool.host_memory_gb):
the layer inputs its devices' backwards keep in pinned host memory (replay.offload_prefix),
the checkpoint snapshots, host-held prefix K/V, vLLM's update buffers.

Token positions per step are counted two ways: per-rollout (what a pipeline without
replay computes and what replay stands in for: prompts x G x (P + completion)) and
unique (what replay computes). Prompts are taken at data.max_prompt_tokens and completions
at their longest: rollout.max_new_tokens, or for multi-turn episodes rollout.max_turns replies
of max_new_tokens with rollout.max_environment_tokens of the environment's answer between
every two (lsreplay.core.config.completion_tokens, the bound the episodes keep): the worst
case for memory.

The last printed line is key=value (positions_per_step=..., fits=...: the update, the
rollouts and the host). A plan that does not fit exits non-zero with a message saying what to
change; a replay.budget_mb too small for the trees' prompts (memory.kept_spans) is an error
naming the budget they need.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import random
import sys
from dataclasses import dataclass, replace

import torch

from lsreplay.commands.context_plan import ContextPlan, Split, context_plan, format_context
from lsreplay.core.config import ConfigError, RolloutConfig, completion_tokens, multi_turn
from lsreplay.models.train_state import master_dtype
from lsreplay.replay.attention.kernels import kernel_for
from lsreplay.replay.memory import (
    KeptLayers,
    LayerByLayer,
    ModelDims,
    default_budget,
    gathered_bytes,
    kept_bytes,
    kept_spans,
    kv_bytes_per_position,
    layer_by_layer_bytes,
    layer_run_bytes,
    layer_workspace_bytes,
    leaf_rows,
    least_budget,
    saved_bytes,
    split_spans,
    top_run_bytes,
    top_runs,
)
from lsreplay.replay.view import joins, replay_view, share_of
from lsreplay.rollout.shared_prompt import PREFILL_CHUNK
from lsreplay.stages.objectives import updates_per_step
from lsreplay.stages.prefixes import scores_logprobs, scores_reference
from lsreplay.tree import RolloutTree

GiB = 2**30
RESERVE_BYTES = 2 * GiB  # CUDA context, NCCL/gloo buffers
FRAGMENTATION = 0.05  # of device memory, allocator slack
ELT = {"float32": 4, "float64": 8, "bfloat16": 2}



# -- tree shape -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeShape:
    """A rollout tree as the config shapes it: a prompt of P tokens, then per level a
    fan-out and the tokens every branch of that level adds (the last level: up to the end
    of the completion)."""

    prompt: int
    levels: tuple[tuple[int, int], ...]  # (branching, segment tokens), root first

    @classmethod
    def from_rollout(cls, prompt: int, branching, segment_tokens, max_new_tokens: int) -> TreeShape:
        segs = list(segment_tokens) + [max_new_tokens - sum(segment_tokens)]
        return cls(prompt, tuple(zip(branching, segs)))

    @classmethod
    def of_rollouts(cls, prompt: int, r: RolloutConfig) -> TreeShape:
        """The trees rollout config `r` samples for prompts of `prompt` tokens, at their longest
        (completion_tokens). Episodes branching at turns fork turn k's replies after the turns
        before, each a reply and the environment's answer to it; at tokens, within the first reply."""
        if multi_turn(r) and r.branch_at == "turns":
            segments = [r.max_new_tokens + r.max_environment_tokens] * (len(r.branching) - 1)
        else:
            segments = list(r.segment_tokens)
        return cls.from_rollout(prompt, r.branching, segments, completion_tokens(r))

    def radix(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """As the trie stores it: a level of fan-out 1 does not branch, so its tokens join
        the node above (the prompt, for the first). Returns (root length, levels)."""
        root, levels = self.prompt, []
        for b, s in self.levels:
            if b == 1:
                if levels:
                    levels[-1] = (levels[-1][0], levels[-1][1] + s)
                else:
                    root += s
            else:
                levels.append((b, s))
        return root, tuple(levels)

    def random_tree(self, vocab: int, seed: int = 0) -> RolloutTree:
        """A tree of exactly this shape (benchmarks, tests): random tokens, siblings starting
        with distinct tokens, so that the trie branches where the shape does."""
        rng = random.Random(seed)

        def grow(level: int) -> list[list[int]]:
            if level == len(self.levels):
                return [[]]
            branching, length = self.levels[level]
            out = []
            for first in rng.sample(range(vocab), branching):
                segment = [first] + [rng.randrange(vocab) for _ in range(length - 1)]
                out += [segment + rest for rest in grow(level + 1)]
            return out

        return RolloutTree.from_sequences([rng.randrange(vocab) for _ in range(self.prompt)], grow(0))

    @property
    def rollouts(self) -> int:
        return math.prod(b for b, _ in self.levels)

    @property
    def completion(self) -> int:
        return sum(s for _, s in self.levels)

    @property
    def total_positions(self) -> int:
        """Per-rollout positions: G x (P + completion)."""
        return self.rollouts * (self.prompt + self.completion)

    @property
    def unique_positions(self) -> int:
        """Replay positions: P + sum over levels of (nodes at that level) x segment."""
        out, nodes = self.prompt, 1
        for b, s in self.levels:
            nodes *= b
            out += nodes * s
        return out


@functools.lru_cache(maxsize=4)
def shape_tree(shape: TreeShape, vocab: int) -> RolloutTree:
    """The plan's tree of `shape` (TreeShape.random_tree), made once: a plan reads it several
    times, and a million-token prompt takes seconds to draw. Read, never changed."""
    return shape.random_tree(vocab)


@dataclass
class RunPeak:
    """The forward/backward at which activation memory peaks."""

    what: str
    held_kv: int = 0  # what the path above holds: prefix K/V and gradients, kept graphs (ActivationMeter)
    saved: int = 0  # saved for backward
    rows: int = 1
    width: int = 0
    past: int = 0
    entries: int = 0
    cascade: bool = False  # attends to the past in place (see memory.saved_bytes)

    @property
    def total(self) -> int:
        return self.held_kv + self.saved


def _run(dims, elt, what, held, rows, width, past, entries, cascade=False) -> RunPeak:
    return RunPeak(what, held, saved_bytes(dims, elt, rows, width, past, entries, cascade),
                   rows, width, past, entries, cascade)


def naive_peak(dims: ModelDims, elt: int, shape: TreeShape) -> RunPeak:
    """One full rollout (prompt + completion), scored on its completion tokens."""
    return _run(dims, elt, "one rollout", 0, 1, shape.prompt + shape.completion, 0, shape.completion)


def joined_levels(levels: tuple[tuple[int, int], ...], join_below: int) -> tuple[tuple[int, int], ...]:
    """Radix levels as the replay view has them (replay/view.py): a level whose nodes are
    joined into their children merges with the level below."""
    out = list(levels[:1])
    for branching, seg in levels[1:]:
        above_branching, above_seg = out[-1]
        if joins(branching, above_seg, join_below):
            out[-1] = (above_branching * branching, above_seg + seg)
        else:
            out.append((branching, seg))
    return tuple(out)


def kept_view(dims: ModelDims, dtype: torch.dtype, shape: TreeShape, budget_bytes: int | None = None,
              accelerator: bool = False, join_below: int = 0, offload: bool = False,
              split: Split | None = None) -> tuple[list, dict[int, KeptLayers | LayerByLayer], int, bool]:
    """The replay view of a tree of this shape, the branching spans the backward forwards
    before their subtree with what they keep (replay.backward.replay_plan's rule: the model
    takes cascade attention, and with it layer by layer, where the device kind has a kernel;
    `offload`: their layer inputs in host memory, on an accelerator), the budget, and whether
    runs after a prefix use cascade attention. With `split`, the root span is one rank's
    share of a prompt split over ranks (memory.split_spans), the largest with the most before it."""
    cascade = kernel_for("cuda" if accelerator else "cpu", dtype, dims.head_dim) is not None
    elt = torch.tensor([], dtype=dtype).element_size()
    spans = replay_view(shape_tree(shape, dims.vocab), join_below)
    budget = budget_bytes or default_budget(dims, elt, shape.prompt + shape.completion, shape.completion)
    if split is not None:
        spans[0] = share_of(spans[0], split.prompt - split.width, split.prompt)
        kept = split_spans(spans, dims, elt, budget, spans[0], split.before, offload and accelerator)
        return spans, kept, budget, True
    return spans, kept_spans(spans, dims, elt, budget, cascade, cascade, offload and accelerator), budget, cascade


def planned_split(cfg, dims: ModelDims, shape: TreeShape, accelerator: bool) -> Split | None:
    """How the update splits a tree of this shape (replay.context_parallel; replay.backward.splits'
    rule): over the context-parallel ranks where its prompt (the radix root) has
    replay.context_parallel_tokens tokens or more, or, with none, where one device would need
    more than the replay budget (memory.least_budget)."""
    r, dtype = cfg.replay, getattr(torch, cfg.model.dtype)
    root, _ = shape.radix()
    if r.context_parallel < 2 or r.mode != "replay" or root < r.context_parallel:
        return None
    if r.context_parallel_tokens:
        return Split(r.context_parallel, root) if root >= r.context_parallel_tokens else None
    elt = torch.tensor([], dtype=dtype).element_size()
    spans = replay_view(shape_tree(shape, dims.vocab), r.join_below)
    budget = r.budget_mb * 2**20 or default_budget(dims, elt, shape.prompt + shape.completion, shape.completion)
    least = least_budget(spans, dims, elt, True, r.offload_prefix and accelerator)
    return Split(r.context_parallel, root) if least > budget else None


def replay_peak(dims: ModelDims, dtype: torch.dtype, shape: TreeShape, budget_bytes: int | None = None,
                accelerator: bool = False, join_below: int = 0, offload: bool = False,
                split: Split | None = None) -> RunPeak:
    """The largest run of `replay_backward` on a tree of this shape, over its replay view
    as the backward walks it: a branching span memory.kept_spans keeps holds its graph
    (and its K/V's gradient) while its subtree runs; one run layer by layer its layer inputs
    and K/V (and their gradient), its peak one layer's recompute over a chunk; one it does
    neither holds its K/V and their gradient, and runs again with grad after its subtree
    (its "recompute"). Runs after a prefix use cascade attention where the device kind (CPU,
    or a CUDA `accelerator`) has a kernel for the dtype and head size (see
    cascade.cascade_applies); sdpa otherwise. With `split`, the prompt is one rank's share of it,
    which holds one layer's K/V of the positions before it and their gradient besides."""
    elt = torch.tensor([], dtype=dtype).element_size()
    spans, kept, budget, cascade = kept_view(dims, dtype, shape, budget_bytes, accelerator, join_below, offload, split)
    if spans[0].is_leaf:  # a single chain: the root is the one leaf
        return _run(dims, elt, "single chain", 0, 1, shape.prompt + shape.completion, 0, shape.completion)
    kvpp = kv_bytes_per_position(dims, elt)
    runs, held, span = [], 0, spans[0]
    for depth in itertools.count():  # down the first child: every path has the same shape
        name = "prompt" if depth == 0 else f"level-{depth} segment"
        # A share of a split prompt: while its own layers run, one layer's K/V of the shares before it.
        gathered = gathered_bytes(dims, elt, split.before) if depth == 0 and split is not None else 0
        if gathered:
            name = "the prompt's share"
        width, choice = len(span.tokens), kept.get(span.id)
        own = _run(dims, elt, name, held, 1, width, span.start, len(span.entry_ids), cascade)
        if isinstance(choice, LayerByLayer):  # its forward differentiates its entries, its backward a layer a chunk
            held += layer_by_layer_bytes(dims, elt, width, choice.offload)
            top = max(top_runs(span, choice.chunk), key=lambda r: top_run_bytes(dims, elt, *r), default=(0, 0))
            runs.append(RunPeak(f"{name}'s entries, layer by layer", held + gathered, top_run_bytes(dims, elt, *top),
                                entries=top[1]))
            held += kvpp * width
            runs.append(RunPeak(f"{name}, layer by layer: one layer over {choice.chunk} positions", held + gathered,
                                layer_run_bytes(dims, elt, choice.chunk), 1, choice.chunk, span.start, 0, cascade))
        elif choice is not None:  # run once, its graph held below (but its layers run again in the backward)
            own = replace(own, what=f"{name}, {choice.describe(dims.layers)}",
                          saved=kept_bytes(dims, elt, width, span.start, len(span.entry_ids), choice, cascade, depth))
            runs.append(own)
            held += own.saved + kvpp * width
        else:
            held += 2 * kvpp * width
            runs.append(replace(own, what=f"{name} recompute", held_kv=held))
        leaves = [spans[c] for c in span.children if spans[c].is_leaf]
        if leaves:  # micro-batches of siblings, as replay_backward.leaf_batches cuts them
            width = max(len(c.tokens) for c in leaves)
            rows = leaf_rows(dims, elt, len(leaves), width, span.end, budget - held, cascade)
            runs.append(_run(dims, elt, f"{rows} leaves x {width}", held, rows, width, span.end,
                             rows * (width - 1), cascade))
            break
        span = spans[span.children[0]]
    return max(runs, key=lambda r: r.total)


def replay_path(dims: ModelDims, dtype: torch.dtype, shape: TreeShape, budget_bytes: int | None = None,
                accelerator: bool = False, join_below: int = 0, offload: bool = False,
                split: Split | None = None) -> str:
    """How the update runs each branching level of the replay view (down the first path):
    forwarded once with its graph kept while its subtree replays, layer by layer, or its K/V
    written by the caching pass and the level run again with grad after its subtree; a prompt
    split over ranks, each share layer by layer."""
    spans, kept, _, _ = kept_view(dims, dtype, shape, budget_bytes, accelerator, join_below, offload, split)
    out, span = [], spans[0]
    for depth in itertools.count():
        if span.is_leaf:
            break
        name = "prompt" if depth == 0 else f"level-{depth} segment"
        if depth == 0 and split is not None:
            name = f"prompt split over {split.ranks} ranks, each share of at most {split.width} positions"
        choice = kept.get(span.id)
        out.append(f"{name} " + ("recomputed after its subtree" if choice is None
                                  else choice.describe(dims.layers) if isinstance(choice, LayerByLayer)
                                  else f"forwarded once, {choice.describe(dims.layers)}"))
        span = spans[span.children[0]]
    return "; ".join(out) or "a single chain"


# -- model state ----------------------------------------------------------------------------
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


def workspace_bytes(dims: ModelDims, elt: int, run: RunPeak) -> int:
    """Transients the meter does not see (estimate): the run's logits in the model dtype and
    in float32 plus their gradient, and twice one layer's saved activations."""
    logits = run.entries * dims.vocab * (elt + 4 + 4)
    return logits + layer_workspace_bytes(dims, elt, run.rows * run.width, run.past > 0 and not run.cascade)


# -- rollouts -------------------------------------------------------------------------------
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


# -- host memory ----------------------------------------------------------------------------
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


def format_host(p: Plan) -> list[str]:
    h = p.host
    lines = [f"host memory, per host ({h.devices} of the pool's devices a host, {h.hosts} host(s))", ""]
    lines += [f"{label:<66} {gib(b):>10}" for label, b in h.lines]
    lines.append(f"{'total':<66} {gib(h.total):>10}")
    if p.host_bytes:
        lines.append(f"{'host memory (pool.host_memory_gb)':<66} {gib(p.host_bytes):>10}")
        lines.append(f"{'':<66} {'fits' if p.host_fits() else 'DOES NOT FIT':>10}")
    return lines


# -- state I/O ------------------------------------------------------------------------------
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


# -- the plan -------------------------------------------------------------------------------
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


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


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


def rounds_bytes(dims: ModelDims, elt: int, run: RunPeak, split: Split | None) -> int:
    """Below a prompt split over ranks, what a round of its runs' attention to the prompt
    allocates for a moment (distributed/context.SharedPrompt): every rank's requests of its
    largest run and their answers, in float32 for narrower dtypes (estimate: the peak run's
    rows and width on every rank)."""
    if split is None:
        return 0
    queries = split.ranks * run.rows * run.width
    return queries * (5 * dims.q_dim + 2 * dims.heads) * max(4, elt)


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


def format_plan(p: Plan) -> str:
    d, s, st = p.dims, p.shape, p.state
    tree = " x ".join(f"{b} (+{n})" for b, n in s.levels)
    lines = [
        (f"model     {p.model}: {d.layers} layers, hidden {d.hidden}, intermediate {d.intermediate}, "
         f"heads {d.heads}/{d.kv_heads} kv, head_dim {d.head_dim}, vocab {d.vocab}; {st.notes}"),
        (f"tree      prompt {s.prompt}, branching {tree} -> G={s.rollouts} rollouts of {s.completion} tokens; "
         f"{s.total_positions} per-rollout / {s.unique_positions} unique positions "
         f"({s.total_positions / s.unique_positions:.2f}x)"),
        (f"step      {p.trees} trees on {p.ranks} device(s), "
         + (f"each prompt split over {p.context.split.ranks} of them; " if p.context else
            f"{p.trees_per_device} per device (whole trees); ")
         + f"per-rollout positions {p.positions_per_step:,}, replay positions {p.replay_positions_per_step:,}"),
        f"peak run  replay: {p.replay.what} (past {p.replay.past}); naive: {p.naive.what} ({p.naive.width} positions)",
        f"branches  replay: {p.replay_path}",
        format_update(p),
        "",
        f"{'per device, GiB':<44} {'replay':>10} {'naive':>10}",
    ]
    rows = [
        ("weights (compute copy)", st.weights, st.weights),
        ("gradient accumulator", st.grads, st.grads),
        ("master weights (fp32)" + (" / ranks" if p.fsdp else ""), st.master, st.master),
        ("AdamW moments" + (" / ranks" if p.fsdp else ""), st.moments, st.moments),
        ("reduced gradient shard" if p.fsdp else "reduced gradient (in place)", st.grad_shard, st.grad_shard),
        ("prefix K/V + dK/dV held (one path)", p.replay.held_kv, p.naive.held_kv),
        ("activations saved for backward (peak run)", p.replay.saved, p.naive.saved),
        ("workspace: logits, one layer's backward (est.)", p.replay_workspace, p.naive_workspace),
        *([("vLLM engine kept (weights, KV cache)", p.engine_kept, p.engine_kept)] if p.engine_kept else []),
        (f"reserve: context/NCCL + {FRAGMENTATION:.0%} fragmentation", p.overhead(), p.overhead()),
    ]
    for name, a, b in rows:
        lines.append(f"{name:<44} {gib(a):>10} {gib(b):>10}")
    lines.append(f"{'total':<44} {gib(p.peak('replay')):>10} {gib(p.peak('naive')):>10}")
    if p.device_bytes:
        verdict = lambda m: "fits" if p.fits(m) else "DOES NOT FIT"  # noqa: E731
        lines.append(f"{'device memory':<44} {gib(p.device_bytes):>10} {gib(p.device_bytes):>10}")
        lines.append(f"{'':<44} {verdict('replay'):>10} {verdict('naive'):>10}")
    if p.context is not None:
        lines += ["", *format_context(p.context)]
    lines += ["", *format_rollout(p)]
    if p.host is not None:
        lines += ["", *format_host(p)]
    if p.io is not None:
        lines += ["", *format_io(p.io)]
    fits = p.step_fits()
    kv = dict(algo=p.algo, updates_per_step=p.updates, mode=p.mode, devices=p.ranks, fsdp=str(p.fsdp).lower(), trees=p.trees, rollouts_per_tree=s.rollouts,
              positions_per_step=p.positions_per_step, replay_positions_per_step=p.replay_positions_per_step,
              positions_ratio=f"{s.total_positions / s.unique_positions:.3f}", state_gib=gib(st.total),
              **({"lora_params": p.adapters} if p.adapters else {}), **_context_fields(p.context),
              peak_gib=gib(p.peak(p.mode)), replay_peak_gib=gib(p.peak("replay")),
              naive_peak_gib=gib(p.peak("naive")), rollout_peak_gib=gib(p.rollout_peak()),
              device_gib=gib(p.device_bytes), **({"host_gib": gib(p.host.total)} if p.host else {}),
              fits="unknown" if fits is None else str(fits).lower(),
              **({} if p.io is None else {"io_gib_per_step": gib(p.io.written + p.io.read),
                                          "io_s_per_step": f"{p.io.seconds():.1f}",
                                          "io_s_per_step_not_resident": f"{p.io.seconds(resident=False):.1f}"}))
    lines.append(" ".join(f"{k}={v}" for k, v in kv.items()))
    return "\n".join(lines)


def _context_fields(c: ContextPlan | None) -> dict:
    if c is None:
        return {}
    out = {"context_parallel": c.split.ranks, "share_positions": c.split.width,
           "cp_sent_gib_per_step": gib(c.sent)}
    for key, value in (("cp_comm_s", c.comm_seconds()), ("prefill_s", c.seconds(c.prefill_flops)),
                       ("backward_s", c.seconds(c.backward_flops))):
        if value is not None:
            out[key] = f"{value:.1f}"
    return out


def format_update(p: Plan) -> str:
    """The algorithm's update: how many optimizer updates, what the later ones hold, the critic."""
    line = f"update    {p.algo}: {p.updates} optimizer update(s) a step"
    if p.updates > 1:
        line += (f"; the first on the stored prefix K/V, each later minibatch runs the caching pass again and holds "
                 f"its trees' K/V in host memory ({gib(p.minibatch_kv)} GiB)")
    if p.critic:
        line += f"; critic: a value head on the policy's trunk ({p.critic} params), no K/V or model of its own"
    if p.adapters:
        line += (f"; LoRA: {p.adapters / 1e6:.1f}M adapter params train on the frozen base, whose weights are held "
                 "in the compute dtype; the reference is the base with the adapters off")
    return line


def format_rollout(p: Plan) -> list[str]:
    r = p.rollout
    spans = f", each shard's engine on {r.tensor_parallel} devices (tensor parallel)" if r.tensor_parallel > 1 else ""
    lines = [f"rollouts, per device: engine {r.engine}, {r.trees} trees a shard ({p.trees} prompts over "
             f"{r.shards} rollout.shards{spans}), {r.rows} sequences decoding; the peak is at {r.peak_at}",
             f"each prompt's K/V {'is held once' if r.prompt_once else 'is held by every row (no cascade kernel here)'}"
             f"{' (vLLM: its prefix cache)' if r.engine == 'vllm' else ''}", ""]
    rows = [(label, b) for _, label, b in r.lines] + [
        (f"reserve: context/NCCL + {FRAGMENTATION:.0%} fragmentation", p.overhead())]
    lines += [f"{label:<66} {gib(b):>10}" for label, b in rows]
    lines.append(f"{'total':<66} {gib(p.rollout_peak()):>10}")
    if p.engine_during_update:
        lines.append(f"the engine during the caching pass and the update: {p.engine_during_update}")
    if r.kv_too_small:
        lines.append("the engine's KV cache cannot hold one of the shard's sequences (its prompt and completion): "
                     "vLLM cannot serve it; raise rollout.vllm.kv_cache_gb or rollout.vllm.tensor_parallel_size")
    elif r.kv_needed > r.part("kv"):
        lines.append("the engine's KV cache holds fewer positions than the shard's sequences need at once: vLLM "
                     "preempts and recomputes sequences (slower); raise rollout.vllm.kv_cache_gb or rollout.shards")
    if p.device_bytes:
        lines.append(f"{'device memory':<66} {gib(p.device_bytes):>10}")
        lines.append(f"{'':<66} {'fits' if p.rollout_fits() else 'DOES NOT FIT':>10}")
    return lines


def format_io(io: StepIO) -> list[str]:
    gbps = io.bandwidth / 1e9
    return [
        f"store I/O per step at {gbps:g} GB/s (storage.bandwidth_gbps), GiB",
        f"  prefix K/V written by the caching pass, read by replay   {gib(io.prefix_kv):>8} x 2",
        f"  KL logprobs and drafter hidden states, written and read  {gib(io.activations):>8} x 2",
        f"  checkpoint (fp32 masters + AdamW) every {io.every} step(s)        {gib(io.checkpoint):>8} / {io.every}",
        f"  total {gib(io.written + io.read)} GiB, {io.seconds():.1f} s a step (checkpoints written in the background)",
        f"  stages that keep nothing (checkpoint.resident=false) also read {gib(io.model_loads)} GiB of models "
        f"and write and read a checkpoint every step: {io.seconds(resident=False):.1f} s a step",
    ]


def rollout_advice(p: Plan) -> str:
    r = p.rollout
    if r.kv_too_small:
        return ("the rollout engine's KV cache cannot hold one of the shard's sequences; raise "
                "rollout.vllm.kv_cache_gb, or spread the engine over more devices (rollout.vllm.tensor_parallel_size)")
    return (f"the rollouts need {gib(p.rollout_peak())} GiB per device but a device has {gib(p.device_bytes)} GiB "
            f"(K/V of {r.rows} sequences decoding at once: {gib(r.part('kv'))} GiB); try more rollout.shards "
            f"(a shard decodes {r.trees} of the {p.trees} trees now), or fewer data.prompts_per_step")


def advice(p: Plan) -> str:
    need, have = p.peak(p.mode), p.device_bytes
    tips = []
    if not p.fsdp and p.ranks > 1:
        tips.append("replay.fsdp=true (shards master weights, moments and gradients)")
    elif p.state.total + p.overhead() > have:
        tips.append(f"more devices per step with FSDP (the model state alone is {gib(p.state.total)} GiB)")
    if p.mode == "naive" and p.fits("replay"):
        tips.append("replay.mode=replay (it fits)")
    run = p.replay if p.mode == "replay" else p.naive
    tips.append(f"a shorter prompt or completion (the peak run is {run.what}, {gib(run.total)} GiB)")
    if p.mode == "replay":
        now = f"{p.budget_bytes // 2**20}" if p.budget_bytes else "0, the per-rollout backward's"
        tips.append(f"a smaller replay.budget_mb (now {now}: what one root-to-leaf path of the backward holds at "
                    "once; fewer sibling leaves share a micro-batch, and a prompt whose graph does not fit runs layer "
                    "by layer)")
    return (f"the {p.mode} step needs {gib(need)} GiB per device but a device has {gib(have)} GiB; "
            f"try {'; or '.join(tips)}")


def host_advice(p: Plan) -> str:
    largest = max(p.host.lines, key=lambda line: line[1])
    return (f"a host needs {gib(p.host.total)} GiB but has {gib(p.host_bytes)} GiB (pool.host_memory_gb; the most: "
            f"{largest[0]}, {gib(largest[1])} GiB); try fewer devices a host (pool.devices_per_host), "
            "replay.offload_prefix=false, or replay.kv_offload=store")


def main(argv: list[str] | None = None) -> int:
    from lsreplay.models.loading import ModelError

    ap = argparse.ArgumentParser(prog="lsreplay plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="YAML config")
    ap.add_argument("overrides", nargs="*", help="key=value overrides")
    args = ap.parse_args(argv)
    try:
        cfg, values = load_plan_config(args.config, args.overrides)
        plan = make_plan(cfg, values)
    except (ConfigError, ModelError) as e:
        print(f"lsreplay plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan), flush=True)
    problems = ([advice(plan)] if plan.fits() is False else []) + (
        [rollout_advice(plan)] if plan.rollout_fits() is False else []) + (
        [host_advice(plan)] if plan.host_fits() is False else [])
    if problems:
        print(f"lsreplay plan: error: does not fit: {'; and '.join(problems)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
