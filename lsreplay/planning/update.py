"""The update's peak run: one rollout's forward/backward (naive), or the largest run of the
replay backward over the tree's replay view (what it keeps, what it runs layer by layer, a
prompt split over ranks); the workspace beside it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from lsreplay.planning.context import Split
from lsreplay.planning.shape import TreeShape, shape_tree
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


def workspace_bytes(dims: ModelDims, elt: int, run: RunPeak) -> int:
    """Transients the meter does not see (estimate): the run's logits in the model dtype and
    in float32 plus their gradient, and twice one layer's saved activations."""
    logits = run.entries * dims.vocab * (elt + 4 + 4)
    return logits + layer_workspace_bytes(dims, elt, run.rows * run.width, run.past > 0 and not run.cascade)


def rounds_bytes(dims: ModelDims, elt: int, run: RunPeak, split: Split | None) -> int:
    """Below a prompt split over ranks, what a round of its runs' attention to the prompt
    allocates for a moment (distributed/context.SharedPrompt): every rank's requests of its
    largest run and their answers, in float32 for narrower dtypes (estimate: the peak run's
    rows and width on every rank)."""
    if split is None:
        return 0
    queries = split.ranks * run.rows * run.width
    return queries * (5 * dims.q_dim + 2 * dims.heads) * max(4, elt)
