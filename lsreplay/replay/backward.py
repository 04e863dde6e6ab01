"""Branch replay backward, and the per-rollout reference it must equal.

Both accumulate into each parameter's `.grad` the gradient of

    sum over trees i, completions j, tokens t of weights[i][j][t] * log p(token t of completion j)

(p the distribution the logprob head of `heads` names, heads.py) or, with several heads,
of sum over heads h of weights[h][i][j][t] * head_h(the hidden state that predicts token t): any per-position loss on the last hidden states
(a critic's value loss, a logprob loss, both at once) reduces to such weights.

Replay walks each tree depth first. A branching node kept by memory.kept_spans runs
forward once with grad and keeps its graph: its keys/values, as leaf tensors viewing them,
feed every child subtree (so their dK/dV accumulates in the leaves' .grad), and the kept
graph then backpropagates the accumulated dK/dV together with the node's own token
losses, including the logits at its last position that predict each child's first token.
Each position is then forwarded once for the update. Where the whole graph would leave too
little of the budget to the node's leaves, its first layers keep less and run again in its
backward: lean (the outputs of their products and attention kept, their elementwise ops run
again) or whole (recompute.py). A node that does not fit even so takes its
keys/values as leaf tensors from the caching pass (or computed here without grad), runs
its subtrees on them, then runs itself again with grad to inject the dK/dV: memory then
holds one root-to-leaf path's K/V instead of its graphs.
Either way memory holds one root-to-leaf path at a time, whatever the number of branches. Where the model allows it (see
cascade.py), a run attends to its ancestors' K/V in place instead of a copy per row. On CPU
every weight's gradient is summed in one buffer over the walk's many autograd calls
(lsreplay.models.summed_grads), in both backwards.
The walk is over the tree's replay view (view.py), where branching nodes too short to be
worth a run of their own are joined into their children.

With a `context` (context parallelism: lsreplay.distributed.context), a tree whose prompt one
device cannot hold is replayed by the ranks of the context's group together: each runs its
share of the prompt layer by layer (layerwise.py, with the other shares as its peers) and its
share of the prompt's children on the whole prompt, every share attended where it is held
(cascade.HeldElsewhere); the other trees replay as they do on one device.

A subtree whose every weight is zero (a DPO leaf outside its pair, a masked completion, a
tree whose leaves all scored alike) adds nothing to the gradient, and both backwards
skip it; `per_rollout_positions` counts the rollouts that carry weight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from lsreplay.models.families import family
from lsreplay.models.hf_compat import decoder_layers
from lsreplay.models.summed_grads import summed_in_place
from lsreplay.replay.attention.windows import layer_visibility
from lsreplay.replay.cascade import cascade_applies, forward_cascade
from lsreplay.replay.heads import Heads, per_head
from lsreplay.replay.layerwise import LayerByLayerSpan, layer_by_layer_applies
from lsreplay.replay.memory import (ActivationMeter, KeptLayers, LayerByLayer, ModelDims, default_budget,
                                    device_peak_bytes, kept_spans, leaf_batch_rows, least_budget, reset_device_peak,
                                    split_spans)
from lsreplay.replay.recompute import recomputed_layers
from lsreplay.replay.segments import PrefixKV, concat_kv, device_index, forward_segments, kv_bytes, new_kv
from lsreplay.replay.view import Span, replay_view, share_of
from lsreplay.tree import Node, RolloutTree

if TYPE_CHECKING:
    from lsreplay.distributed.context import ContextParallel

log = logging.getLogger(__name__)

# (tree index, node) -> cached K/V of that node's positions, or None to recompute it.
PrefixKVSource = Callable[[int, Node], PrefixKV | None]


@dataclass
class BackwardStats:
    objective: float  # sum of weights * scores (what was differentiated)
    positions: int  # token positions run forward+backward (padding included)
    per_rollout_positions: int  # what a per-rollout pipeline runs (the rollouts that carry weight)
    seconds: float
    peak_activation_bytes: int  # saved-for-backward + held K/V, see memory.py
    device_peak_bytes: int | None = None
    layer_by_layer_positions: int = 0  # positions of branching spans run layer by layer (layerwise.py)

    @property
    def positions_ratio(self) -> float:
        return self.per_rollout_positions / max(self.positions, 1)


class _Replay:
    """State of one replay_backward call."""

    def __init__(self, model, meter: ActivationMeter, prefix_kv: PrefixKVSource | None, budget_bytes: int | None,
                 join_below: int, heads: Heads, offload_prefix: bool = False, context: ContextParallel | None = None):
        family(model.config)  # replay is exact on its family, or refuses it
        self.model, self.meter, self.prefix_kv, self.join_below, self.heads = model, meter, prefix_kv, join_below, heads
        self.offload_prefix, self.context = offload_prefix, context
        self.dims = ModelDims.from_hf(model.config)
        self.elt = next(model.parameters()).element_size()
        self.budget_bytes = budget_bytes
        self.cascade = cascade_applies(model)
        # Summed where the terms are: a host copy per scored row would wait for the device each time.
        self.objective = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
        self.positions = 0
        self.layer_by_layer_positions = 0
        self.recomputed = 0

    def tree(self, index: int, tree: RolloutTree, entry_weights: dict[str, torch.Tensor], split: bool = False) -> None:
        """Replay tree `index`; `split`: its prompt over the ranks of self.context (splits)."""
        self.index, self.t = index, tree
        # A head of no weight in the tree is not run at all (a value loss alone needs no LM head).
        self.w = {name: w.to(self.objective.device) for name, w in entry_weights.items() if w.ne(0).any()}
        self.spans, self.kept, self.budget = replay_plan(self.model, tree, self.join_below, self.budget_bytes,
                                                         self.offload_prefix, self.context if split else None)
        self.split = split  # the caching pass keeps no K/V of a split tree (stages/prefixes.py)
        self.live = _live_spans(self.spans, entry_weights)
        root = self.spans[0]
        if not self.live[root.id]:
            return
        if split:
            self.split_root(root)
        elif root.is_leaf:
            self.run([root], [], None)
        else:
            self.node(root, [])

    def node(self, span: Span, ancestors: list[PrefixKV]) -> None:
        children = [self.spans[c] for c in span.children if self.live[c]]
        if not children:  # only its own entries carry weight
            self.run([span], ancestors, None)
            return
        if isinstance(self.kept.get(span.id), LayerByLayer):
            self.layer_by_layer_node(span, ancestors, children)
            return
        if span.id in self.kept:
            self.kept_node(span, ancestors, children)
            return
        kv = self.leaf_kv(span, ancestors)
        with self.meter.hold(kv_bytes(kv), tensors=kv[0] + kv[1]):  # the K/V and its gradient
            self.subtrees(children, ancestors + [kv], span.end)
            self.run([span], ancestors, _grads(kv))

    def kept_node(self, span: Span, ancestors: list[PrefixKV], children: list[Span]) -> None:
        """Forward the span once with grad and keep its graph while its subtree replays on
        its K/V (leaf tensors viewing them), then backward its own scores and the subtree's
        dK/dV through that graph: no second forward of the span (kept_spans chose it), only
        of its layers that keep less (recompute.py)."""
        with recomputed_layers(self.model, self.kept[span.id], self.meter):
            hidden, own_kv = self.forward([span], ancestors)
        objective = self.score([span], hidden)
        del hidden  # what backward needs of it, the graph holds
        kv = ([k.detach().requires_grad_() for k in own_kv[0]], [v.detach().requires_grad_() for v in own_kv[1]])
        with self.meter.hold(kv_bytes(kv)):  # their gradient
            self.subtrees(children, ancestors + [kv], span.end)
            self.backward(objective, own_kv, _grads(kv))

    def layer_by_layer_node(self, span: Span, ancestors: list[PrefixKV], children: list[Span]) -> None:
        """Forward the span without grad keeping its layer inputs and K/V, replay its subtree
        on the K/V (leaf tensors), then run its layers again one at a time from the top, in
        chunks of positions, each backpropagating its share of the subtree's dK/dV
        (layerwise.py): what kept_spans chose where the span's graph does not fit."""
        choice = self.kept[span.id]
        run = LayerByLayerSpan(self.model, span.tokens, span.start, ancestors, choice.chunk, self.meter,
                               choice.offload)
        kv = run.forward(self.score_entries, span.entry_ids, span.entry_pos, span.entry_targets)
        self.positions += len(span.tokens)
        self.layer_by_layer_positions += len(span.tokens)
        with self.meter.hold(kv_bytes(kv)):  # their gradient
            self.subtrees(children, ancestors + [kv], span.end)
            run.backward()

    def split_root(self, root: Span) -> None:
        """The root span split over the ranks of self.context: this rank's share run layer by
        layer beside the others' (peers), this rank's share of the root's children replayed
        on the whole prompt, whose shares every rank serves, then the share's backward."""
        lo, hi = self.context.share(len(root.tokens))
        mine = [(i, p - lo, t) for i, p, t in zip(root.entry_ids, root.entry_pos, root.entry_targets) if lo <= p < hi]
        ids, positions, targets = map(list, zip(*mine)) if mine else ([], [], [])
        choice = self.kept[root.id]
        run = LayerByLayerSpan(self.model, root.tokens[lo:hi], root.start + lo, [], choice.chunk, self.meter,
                               choice.offload, peers=self.context.peers(len(root.tokens)))
        kv = run.forward(self.score_entries, ids, positions, targets)
        self.positions += hi - lo
        self.layer_by_layer_positions += hi - lo
        children = self.context.children(self.spans, [self.spans[c] for c in root.children if self.live[c]])
        with self.meter.hold(kv_bytes(kv)), self.context.serving(len(root.tokens), kv) as prompt:  # their gradient
            self.subtrees(children, [prompt], root.end)
        run.backward()

    def subtrees(self, children: list[Span], below: list[PrefixKV], past_len: int) -> None:
        """Replay every live child of a branching span on top of `below`: the leaves in
        micro-batches, the branching children depth first."""
        for batch in self.leaf_batches([c for c in children if c.is_leaf], past_len):
            self.run(batch, below, None)
        for child in children:
            if not child.is_leaf:
                self.node(child, below)

    def leaf_kv(self, span: Span, ancestors: list[PrefixKV]) -> PrefixKV:
        kv = self.cached_kv(span)
        if kv is None:
            with torch.no_grad():
                if any(not isinstance(a, tuple) for a in ancestors):  # a prompt held elsewhere: attended in place
                    _, cache = forward_cascade(self.model, [span.tokens], span.start, ancestors)
                    kv = new_kv(cache, 0)
                else:
                    past = concat_kv([(list(map(torch.Tensor.detach, k)), list(map(torch.Tensor.detach, v)))
                                      for k, v in ancestors])
                    _, cache = forward_segments(self.model, [span.tokens], span.start, past)
                    kv = new_kv(cache, span.start)
        return ([k.detach().clone().requires_grad_() for k in kv[0]],
                [v.detach().clone().requires_grad_() for v in kv[1]])

    def cached_kv(self, span: Span) -> PrefixKV | None:
        """The span's K/V from the caching pass: its tree nodes', joined; None if one is
        missing or unusable."""
        if not self.prefix_kv or self.split:
            return None
        parts = []
        for node in (self.t.nodes[s] for s in span.sources):
            kv = self.prefix_kv(self.index, node)
            if kv is not None and kv[0][0].shape[-2] != len(node.tokens):
                log.warning("tree %d node %d: cached K/V covers %d positions, the node has %d; recomputing it",
                            self.index, node.id, kv[0][0].shape[-2], len(node.tokens))
                kv = None
            if kv is None:
                self.recomputed += 1
                return None
            parts.append(kv)
        return concat_kv(parts)

    def leaf_batches(self, leaves: list[Span], past_len: int) -> list[list[Span]]:
        """Group sibling leaves, longest first, so that each group's saved activations
        (see memory.saved_bytes) fit the budget next to the K/V held for them."""
        budget = self.budget - self.meter.current  # the held K/V already count toward the peak
        leaves = sorted(leaves, key=lambda n: -len(n.tokens))
        rows = leaf_batch_rows(self.dims, self.elt, [len(n.tokens) for n in leaves], past_len, budget,
                               cascade=self.cascade)
        starts = [sum(rows[:i]) for i in range(len(rows))]
        return [leaves[at:at + r] for at, r in zip(starts, rows)]

    def forward(self, nodes: list[Span], ancestors: list[PrefixKV]) -> tuple[torch.Tensor, PrefixKV]:
        """Hidden states of sibling `nodes` after their ancestors' K/V, and the first node's
        own K/V."""
        segments, start = [n.tokens for n in nodes], nodes[0].start
        if ancestors and self.cascade:
            hidden, cache = forward_cascade(self.model, segments, start, ancestors)
            own = new_kv(cache, 0)  # the cache holds only the nodes' own K/V
        else:
            hidden, cache = forward_segments(self.model, segments, start, concat_kv(ancestors))
            own = new_kv(cache, start)
        self.positions += hidden.shape[0] * hidden.shape[1]
        return hidden, own

    def score(self, nodes: list[Span], hidden: torch.Tensor) -> torch.Tensor:
        """The weighted scores of the nodes' entries, every head's (with grad)."""
        objective = hidden.new_zeros(())
        for row, n in enumerate(nodes):
            objective = objective + self.score_entries(hidden[row], n.entry_ids, n.entry_pos, n.entry_targets)
        return objective

    def score_entries(self, hidden: torch.Tensor, ids: list[int], positions: list[int],
                      targets: list[int]) -> torch.Tensor:
        """The weighted scores of entries `ids` at `positions` of one row of hidden states
        (T, d), every head's (with grad)."""
        objective = hidden.new_zeros(())
        if ids:
            index = device_index(ids, hidden.device)
            for name, w in self.w.items():
                score = self.heads[name](self.model, hidden, positions, targets)
                term = (score * w[index].to(score)).sum()
                self.objective += term.detach().double()
                objective = objective + term
        return objective

    @staticmethod
    def backward(objective: torch.Tensor, own_kv: PrefixKV, kv_grads) -> None:
        """Backward the objective, with `kv_grads` (dK, dV) injected at the run's own K/V."""
        outputs, grads = [objective], [torch.ones_like(objective)]
        if kv_grads is not None:
            for own, grad in zip(own_kv[0] + own_kv[1], kv_grads[0] + kv_grads[1]):
                if grad is not None:
                    outputs.append(own)
                    grads.append(grad)
        # Injecting dK/dV as output gradients (not as a <K, dK> term) saves neither for backward.
        live = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live])

    def run(self, nodes: list[Span], ancestors: list[PrefixKV], kv_grads) -> None:
        """Forward `nodes` (siblings) with grad on their ancestors' K/V and backward their
        entries' weighted scores, with `kv_grads` (dK, dV) injected at a node's own K/V."""
        hidden, own_kv = self.forward(nodes, ancestors)
        self.backward(self.score(nodes, hidden), own_kv, kv_grads)


def _grads(kv: PrefixKV):
    """The gradients accumulated in K/V leaf tensors."""
    return [k.grad for k in kv[0]], [v.grad for v in kv[1]]


def replay_plan(model: PreTrainedModel, tree: RolloutTree, join_below: int = 0, budget_bytes: int | None = None,
                offload_prefix: bool = False, context: ContextParallel | None = None,
                ) -> tuple[list[Span], dict[int, KeptLayers | LayerByLayer], int]:
    """How replay_backward walks `tree`: its replay view (view.py), the branching spans it
    forwards before their subtree with what they keep (memory.kept_spans: their graph, or
    where the model takes cascade attention their layer inputs and K/V, run layer by layer,
    those inputs in host memory with `offload_prefix` on CUDA) and the memory budget of one
    path, `budget_bytes` or by default what the per-rollout backward needs for the tree's
    longest rollout, with its K/V (memory.default_budget). With `context`, the root span is
    split over its ranks: this rank's share of it runs layer by layer (memory.split_spans).
    The caching pass asks it which K/V the backward will read. Raises ConfigError where no
    way of running a span fits the budget."""
    dims, elt = ModelDims.from_hf(model.config), next(model.parameters()).element_size()
    spans = replay_view(tree, join_below)
    longest = max(n.end for n in tree.nodes)
    budget = budget_bytes or default_budget(dims, elt, longest, longest - tree.prompt_len)
    cascade = cascade_applies(model)
    offload = offload_prefix and next(model.parameters()).device.type == "cuda"
    if context is not None:
        lo, hi = context.share(len(spans[0].tokens))
        return spans, split_spans(spans, dims, elt, budget, share_of(spans[0], lo, hi), lo, offload), budget
    kept = kept_spans(spans, dims, elt, budget, cascade, cascade and layer_by_layer_applies(model), offload)
    return spans, kept, budget


def splits(model: PreTrainedModel, tree: RolloutTree, context: ContextParallel | None, join_below: int = 0,
           budget_bytes: int | None = None, offload_prefix: bool = False) -> bool:
    """Whether replay splits `tree`'s prompt over the ranks of `context` (context parallelism):
    its root span branches and has context.threshold positions or more, or, with no
    threshold, one device would need more than the replay budget to replay the tree
    (memory.least_budget). Every rank of a group decides alike from the same tree."""
    if context is None or context.ranks < 2:
        return False
    spans = replay_view(tree, join_below)
    root = spans[0]
    if root.is_leaf or len(root.tokens) < context.ranks:
        return False
    if context.threshold:
        return len(root.tokens) >= context.threshold
    dims, elt = ModelDims.from_hf(model.config), next(model.parameters()).element_size()
    longest = max(n.end for n in tree.nodes)
    budget = budget_bytes or default_budget(dims, elt, longest, longest - tree.prompt_len)
    offload = offload_prefix and next(model.parameters()).device.type == "cuda"
    return least_budget(spans, dims, elt, True, offload) > budget


def context_parallel_applies(model: PreTrainedModel) -> str | None:
    """Why `model` cannot have its prompts split over ranks, or None if it can: its prompt's
    shares run layer by layer, and every rank attends to the others' shares through cascade
    attention, full softmax attention of cached keys and values (no sliding window, softcap or
    latent attention)."""
    if not (cascade_applies(model) and layer_by_layer_applies(model)):
        return (f"{type(model).__name__} in {next(model.parameters()).dtype} does not run layer by layer with "
                "cascade attention here (replay/cascade.py, layerwise.py)")
    if not all(v.full for v in layer_visibility(model.config)):
        return f"{type(model).__name__} has sliding-window or chunked attention layers"
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "kv_lora_rank", None):
        return f"{type(model).__name__} softcaps its attention logits or caches latents"
    if any(hasattr(getattr(layer, "self_attn", None), "sinks") for layer in decoder_layers(model)):
        return f"{type(model).__name__} has attention sinks"
    return None


def _live_spans(spans: list[Span], entry_weights: dict[str, torch.Tensor]) -> list[bool]:
    """Per span: whether it or a span below it has an entry of nonzero weight."""
    nonzero = torch.stack([w != 0 for w in entry_weights.values()]).any(0)
    live = [False] * len(spans)
    for span in reversed(spans):  # depth-first order: children after their parent
        live[span.id] = bool(nonzero[span.entry_ids].any()) or any(live[c] for c in span.children)
    return live


def _entry_weights(trees: list[RolloutTree], weights: dict) -> list[dict[str, torch.Tensor]]:
    for name, w in weights.items():
        if len(w) != len(trees):
            raise ValueError(f"got {name} weights for {len(w)} trees, expected {len(trees)}")
    return [{name: t.entry_weights(w[i]) for name, w in weights.items()} for i, t in enumerate(trees)]


def _weighted_positions(trees: list[RolloutTree], weights: dict) -> int:
    """Positions a per-rollout pipeline runs for the rollouts that carry any weight."""
    return sum(t.prompt_len + len(c) for i, t in enumerate(trees) for j, c in enumerate(t.completions)
               if any(bool(torch.as_tensor(w[i][j]).ne(0).any()) for w in weights.values()))


def replay_backward(model: PreTrainedModel, trees: list[RolloutTree], weights,
                    prefix_kv: PrefixKVSource | None = None, budget_bytes: int | None = None,
                    meter: ActivationMeter | None = None, join_below: int = 0, *,
                    heads: Heads, offload_prefix: bool = False, context: ContextParallel | None = None,
                    ) -> BackwardStats:
    """Accumulate the weighted-score gradient of `trees` into `.grad`, branch replay style.

    heads: what is scored (heads.py), the logprob under the distribution its head names;
    for the logprob alone `weights` may be the nested per-token weights, else
    `weights[name]` per head.
    prefix_kv: where cached K/V of branching nodes come from (None: computed here without
    grad). budget_bytes: memory allowed to one micro-batch of sibling leaves, the K/V held
    for them included (default: what the per-rollout backward saves for the longest rollout).
    join_below: join short branching nodes into their children, see view.py (0: never).
    offload_prefix: on CUDA, the layer inputs of spans run layer by layer wait in host memory
    (layerwise.py); on a CPU it changes nothing.
    context: this rank's context-parallel group (lsreplay.distributed.context): the trees it
    `splits` every rank of the group replays together, in the same order on every rank, each
    rank accumulating its part of their gradient (and of the objective and positions; their
    per-rollout positions count on the group's first rank); the other trees as ever."""
    weights, heads = per_head(weights, heads)
    entry_w = _entry_weights(trees, weights)
    split = [splits(model, t, context, join_below, budget_bytes, offload_prefix) for t in trees]
    if any(split):
        if why := context_parallel_applies(model):
            raise ValueError(f"replay.context_parallel cannot split this model's prompts: {why}")
        context.agree([t for t, s in zip(trees, split) if s])
    meter = meter or ActivationMeter(model)
    state = _Replay(model, meter, prefix_kv, budget_bytes, join_below, heads, offload_prefix, context)
    device = next(model.parameters()).device
    reset_device_peak(device)
    start = time.perf_counter()
    with meter.measure(), summed_in_place(model):
        for i, (tree, w) in enumerate(zip(trees, entry_w)):
            state.tree(i, tree, w, split[i])
    if state.recomputed:
        log.warning("recomputed %d prefix K/V entries that were missing or corrupt in the cache", state.recomputed)
    counted = [i for i, s in enumerate(split) if not s or context.index == 0]
    return BackwardStats(
        objective=float(state.objective), positions=state.positions,
        per_rollout_positions=_weighted_positions([trees[i] for i in counted],
                                                  {name: [w[i] for i in counted] for name, w in weights.items()}),
        seconds=time.perf_counter() - start, peak_activation_bytes=meter.peak,
        device_peak_bytes=device_peak_bytes(device), layer_by_layer_positions=state.layer_by_layer_positions)


def naive_backward(model: PreTrainedModel, trees: list[RolloutTree], weights,
                   meter: ActivationMeter | None = None, *, heads: Heads) -> BackwardStats:
    """The per-rollout reference: every completion's full sequence, forward and backward
    (those that carry weight). `heads`, `weights`: as for replay_backward."""
    weights, heads = per_head(weights, heads)
    for name, w in weights.items():
        if len(w) != len(trees):
            raise ValueError(f"got {name} weights for {len(w)} trees, expected {len(trees)}")
    meter = meter or ActivationMeter(model)
    device = next(model.parameters()).device
    objective, positions = torch.zeros((), dtype=torch.float64, device=device), 0
    reset_device_peak(device)
    start = time.perf_counter()
    with meter.measure(), summed_in_place(model):
        for i, tree in enumerate(trees):
            for j, comp in enumerate(tree.completions):
                comp_w = {name: torch.as_tensor(w[i][j]) for name, w in weights.items()}
                comp_w = {name: w for name, w in comp_w.items() if w.ne(0).any()}
                if not comp or not comp_w:
                    continue
                hidden, _ = forward_segments(model, [tree.prompt_ids + comp], 0, None)
                positions += hidden.shape[1]
                at = list(range(tree.prompt_len - 1, tree.prompt_len - 1 + len(comp)))
                scores = {name: heads[name](model, hidden[0], at, comp) for name in comp_w}
                term = sum((s * comp_w[name].to(s)).sum() for name, s in scores.items())
                objective += term.detach().double()
                if term.requires_grad:
                    term.backward()
    return BackwardStats(
        objective=float(objective), positions=positions,
        per_rollout_positions=_weighted_positions(trees, weights),
        seconds=time.perf_counter() - start, peak_activation_bytes=meter.peak,
        device_peak_bytes=device_peak_bytes(device))
