"""Deterministic activation-memory accounting.

Process RSS on a shared CPU machine is noise. What replay changes is which activations
autograd keeps for backward and how much prefix K/V stays alive, so that is what we
count: bytes of tensors saved for backward (deduplicated by storage, parameters
excluded) plus explicitly registered live tensors. On CUDA the allocator's peak is
reported next to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from transformers import AutoModelForCausalLM

from lsreplay.core.config import ConfigError
from lsreplay.replay.view import Span

MiB = 2**20


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
        # Detached: a saved *output* would otherwise reference its own grad_fn through us,
        # a cycle gc cannot see, and stay counted after its graph is dropped.
        return _Saved(self, t.detach(), ptr)

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    def keep(self, t: torch.Tensor):
        """Count `t` as saved for backward until the returned handle is dropped (for what
        autograd does not save itself: a lean layer's kept outputs, recompute.py)."""
        return self._pack(t)

    kept = _unpack  # the tensor back from `keep`'s handle

    @contextmanager
    def measure(self):
        """Count tensors saved for backward inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    @contextmanager
    def hold(self, nbytes: int, tensors: Sequence[torch.Tensor] = ()):
        """Count explicitly held buffers in the block: `nbytes` (e.g. gradients to come) and
        the storages of `tensors` (e.g. cached K/V). A held tensor that autograd also saves
        counts once, as it is stored once (cascade attention saves the prefix K/V it reads)."""
        ptrs = [t.untyped_storage().data_ptr() for t in tensors]
        for t, ptr in zip(tensors, ptrs):
            self._acquire(ptr, t.untyped_storage().nbytes())
        self._add(nbytes)
        try:
            yield
        finally:
            self._add(-nbytes)
            for ptr in ptrs:
                self._release(ptr)


def reset_device_peak(device: torch.device) -> None:
    """Start the allocator's peak afresh (CUDA): `device_peak_bytes` then reads the peak of
    what runs from here on, over what is allocated now, not the process's lifetime peak
    (on an FSDP rank that includes the full float32 model it loaded before sharding)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_peak_bytes(device: torch.device) -> int | None:
    """The allocator's peak since `reset_device_peak` (CUDA); None on a CPU, which has none."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None



# -- what ActivationMeter will count, predicted from the model's dimensions ----------------
@dataclass(frozen=True)
class ModelDims:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    qkv_bias: bool = False
    cached_kv: int = 0  # what one layer caches per position, keys and values (0: 2 x kv_heads x head_dim)
    total_params: int = 0  # counted on the model itself (0: the formula of layer_params)

    @classmethod
    def from_hf(cls, config, count_params: bool = False) -> ModelDims:
        """The dimensions of a model config, of any supported family (models/families.py).
        Sizes that differ per layer (Gemma 4's global layers) are averaged over the layers, so
        that sums over layers come out right; latent attention (DeepSeek-V3) caches its
        latents; a mixture of experts runs its active experts' MLPs per position. `count_params`:
        count the weights on the model built on the meta device (every expert's, every
        family's exactly; a tenth of a second for a 7B model) rather than by layer_params' formula."""
        text = config.get_text_config(decoder=True)
        heads, layers = text.num_attention_heads, text.num_hidden_layers
        per_layer = list(text.per_layer_config)

        def mean(values) -> int:
            return -(-sum(values) // layers)

        head_dim = mean(getattr(c, "head_dim", None) or text.hidden_size // heads for c in per_layer)
        kv_heads = mean(getattr(c, "num_key_value_heads", None) or heads for c in per_layer)
        cached_kv = 2 * mean((getattr(c, "num_key_value_heads", None) or heads)
                             * (getattr(c, "head_dim", None) or text.hidden_size // heads) for c in per_layer)
        if getattr(text, "kv_lora_rank", None):  # latent attention
            head_dim, kv_heads = text.qk_nope_head_dim + text.qk_rope_head_dim, heads
            cached_kv = text.kv_lora_rank + text.qk_rope_head_dim
        bias = bool(getattr(text, "attention_bias", False)) or text.model_type == "qwen2"
        return cls(vocab=text.vocab_size, hidden=text.hidden_size, intermediate=_active_mlp_width(text),
                   layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   tied=bool(getattr(config, "tie_word_embeddings", False)), qkv_bias=bias, cached_kv=cached_kv,
                   total_params=_counted_params(config) if count_params else 0)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """What one layer caches per position, of keys or of values (their mean where they differ)."""
        return self.cached_kv // 2 if self.cached_kv else self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """One decoder layer: attention, MLP, two norms (the mean over the layers where counted)."""
        if self.total_params:
            return (self.total_params - self.vocab * self.hidden * (1 if self.tied else 2) - self.hidden) // self.layers
        h, i = self.hidden, self.intermediate
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        return attn + 3 * h * i + 2 * h

    def params(self) -> int:
        if self.total_params:
            return self.total_params
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden


def _active_mlp_width(text) -> int:
    """The MLP width one position runs through: a dense layer's, or its active experts' and
    shared experts' together in a mixture of experts."""
    active = getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k_experts", None)
    experts = (getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
               or getattr(text, "n_routed_experts", None))
    if not (active and experts):
        return text.intermediate_size
    expert = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    shared = (getattr(text, "shared_expert_intermediate_size", None)
              or (getattr(text, "n_shared_experts", None) or 0) * expert)
    return active * expert + shared


def _counted_params(config) -> int:
    """The parameters of the causal LM `config` describes, counted on one built on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def kv_bytes_per_position(dims: ModelDims, elt: int) -> int:
    """Keys + values of one position over all layers, as the cache holds them."""
    return 2 * dims.layers * dims.kv_dim * elt


def entry_bytes(dims: ModelDims, elt: int) -> int:
    """Per completion token scored: the LM head's input row, the float32 (float64 in a
    float64 model) log_softmax output over the vocabulary, and two int64 indices."""
    return dims.hidden * elt + dims.vocab * max(4, elt) + 16


def per_position_bytes(dims: ModelDims, elt: int, repeated_kv: bool) -> int:
    """Saved-for-backward bytes per new position of one forward, excluding scored entries
    and K/V of the past. Measured tensor by tensor (transformers 5.x, Llama/Qwen2, sdpa and
    cascade attention): per layer two RMSNorms (float32 input copy, rsqrt, normed and scaled
    outputs: 4h + 4 + 2he), attention (query, output: 2 q_dim e; log-sum-exp per head, in
    float32 or float64; the new keys and values, 2 kv_dim e, unless `repeated_kv`: sdpa given
    a mask saves them repeated to every query head instead, see saved_bytes), MLP (gate,
    SiLU, up, product: 4 i e); per forward the token ids, rotary cos/sin and the final norm."""
    h, e = dims.hidden, elt
    layer = 2 * (4 * h + 4 + 2 * h * e) + 2 * dims.q_dim * e + max(4, e) * dims.heads + 4 * dims.intermediate * e
    if not repeated_kv:
        layer += 2 * dims.kv_dim * e
    return dims.layers * layer + 8 + 2 * dims.head_dim * e + 4 * h + 4 + h * e


def saved_bytes(dims: ModelDims, elt: int, rows: int, width: int, past: int, entries: int,
                cascade: bool = False) -> int:
    """Bytes autograd keeps for one forward + scoring + backward of `rows` segments of
    `width` new positions after `past` positions of K/V.

    `forward_segments` with a past: HF passes sdpa an explicit mask, which turns off its
    grouped-query path: keys and values are repeated to all query heads and saved per row
    for past + new positions (2 q_dim e per layer and position), and every layer saves a
    copy of the mask (rows x width x (past + width) x e). `cascade` (cascade.forward_cascade):
    the rows attend to the past in place, saving the past K/V themselves, which replay holds
    anyway (counted once, see ActivationMeter.hold), and the rows' new K/V as without a
    past: the same on CPU and CUDA, whose kernels differ but not what the one autograd
    Function saves (a float32 log-sum-exp for every dtype but float64). A node run's
    injected dK/dV are output gradients, not saved tensors."""
    repeated_kv = past > 0 and not cascade
    out = rows * width * per_position_bytes(dims, elt, repeated_kv) + entries * entry_bytes(dims, elt)
    if repeated_kv:
        out += rows * dims.layers * 2 * dims.q_dim * elt * (past + width)
        out += dims.layers * rows * width * (past + width) * elt  # each layer saves its own mask copy
    return out


def default_budget(dims: ModelDims, elt: int, longest: int, completion: int) -> int:
    """Replay's default budget (replay.budget_mb=0) for what one root-to-leaf path holds at
    once: what the per-rollout backward saves for the tree's longest rollout, so that
    replay's peak is never above the per-rollout backward's. Within it a path whose
    branching nodes keep their graphs (kept_spans, some layers run again where the leaves
    need the room) holds about one rollout's activations, and batched sibling leaves never
    cost more than that."""
    return saved_bytes(dims, elt, 1, longest, 0, completion)


# What a replay run costs beyond its positions' forward and backward, in positions' worth:
# every run adds every weight's gradient into its buffer once (models/summed_grads.py),
# whatever its length. bench/run_cost.py, SmolLM2-135M on two CPU cores: 0.20-0.21 s, 34-38
# positions' worth (it was ~100 before the summed buffers). And what a forward without grad
# costs per position, as a share of one with grad and its backward (one matmul of three).
RUN_POSITIONS = 35
NO_GRAD_SHARE = 1 / 3
# What running a lean layer again (its norms, rotary embedding, activation, residual adds;
# recompute.py) costs, as a share of running it again whole. Measured on a 670-token
# SmolLM2-135M prompt's forward and backward on two CPU threads, every layer lean or run
# again whole: 0.17-0.35 s and 1.2 s more than with its whole graph kept (3.75-4.2 s).
LEAN_SHARE = 1 / 4


@dataclass(frozen=True)
class KeptLayers:
    """What the decoder layers of a kept span keep for its backward (recompute.py): the first
    `rerun` their input alone, and run again whole in the backward; the next `lean` their
    input and the outputs of their matrix products and attention, and run again only the
    elementwise ops between those; the others their whole graph."""

    rerun: int = 0
    lean: int = 0

    @property
    def cost_layers(self) -> float:
        """What running them again costs, in layers' forward."""
        return self.rerun + LEAN_SHARE * self.lean

    def describe(self, layers: int) -> str:
        if self.lean and self.rerun:
            return f"graph kept ({self.lean} of {layers} layers lean, {self.rerun} run again whole in its backward)"
        if self.lean:
            return f"graph kept ({self.lean} of {layers} layers lean: their elementwise ops run again in its backward)"
        return "graph kept" + (f" ({self.rerun} of {layers} layers run again in its backward)" if self.rerun else "")


@dataclass(frozen=True)
class LayerByLayer:
    """A branching span run layer by layer (layerwise.py): its forward, without grad, keeps
    its layer inputs (with `offload`, in host memory) and its K/V; its backward runs each
    layer again over `chunk` positions at a time."""

    chunk: int
    offload: bool = False

    def describe(self, layers: int) -> str:
        where = " (in host memory)" if self.offload else ""
        return (f"layer by layer (its layer inputs{where} and K/V kept; each of its {layers} layers run again in its "
                f"backward, {self.chunk} positions at a time)")


def layer_choices(layers: int) -> list[KeptLayers]:
    """Every way a kept span's layers may keep less, each holding less than the one before:
    lean layers first (a quarter of a layer's forward run again saves 40% of what it holds
    on SmolLM2), then layers run again whole in place of lean ones."""
    return [KeptLayers(0, n) for n in range(layers + 1)] + [KeptLayers(n, layers - n) for n in range(1, layers + 1)]


def lean_layer_bytes(dims: ModelDims, elt: int, attention_calls: int = 1) -> int:
    """What a lean decoder layer (recompute.py) holds per position: its input, the outputs of
    its seven projections (queries, keys, values, attention output, gate, up, down), the
    output and log-sum-exp of each of its attention kernel's calls (cascade attention calls
    it once more per ancestor), and the keys and values its children attend to (the cache's
    copies, the keys rotated)."""
    h, e = dims.hidden, elt
    products = dims.q_dim + 2 * dims.kv_dim + 2 * h + 2 * dims.intermediate
    attention = attention_calls * (dims.q_dim * e + max(4, e) * dims.heads)
    return (h + products + 2 * dims.kv_dim) * e + attention


def kept_bytes(dims: ModelDims, elt: int, width: int, start: int, entries: int, layers: KeptLayers,
               cascade: bool = False, ancestors: int = 0) -> int:
    """What a kept span of `width` positions after `start` (and `ancestors` spans) holds for
    its backward (as ActivationMeter counts it): its forward's saved activations, less what
    its lean and rerun layers (`layers`, recompute.py) do not keep. A rerun layer holds its
    input and its keys and values alone (the children attend to those, and save them), a
    lean one lean_layer_bytes; with no layer keeping its whole graph, none saves the rotary
    tables either."""
    full = saved_bytes(dims, elt, 1, width, start, entries, cascade)
    per_layer = (full - saved_bytes(replace(dims, layers=0), elt, 1, width, start, entries, cascade)) // dims.layers
    rerun_held = width * (dims.hidden + 2 * dims.kv_dim) * elt
    lean_held = width * lean_layer_bytes(dims, elt, 1 + ancestors if cascade and start else 1)
    rotary = width * 2 * dims.head_dim * elt if layers.rerun + layers.lean == dims.layers else 0
    return full - layers.rerun * (per_layer - rerun_held) - layers.lean * (per_layer - lean_held) - rotary


def layer_by_layer_bytes(dims: ModelDims, elt: int, width: int, offload: bool = False) -> int:
    """What a span of `width` positions run layer by layer (layerwise.py) holds from its
    forward to the end of its backward, as ActivationMeter counts it, less its K/V's gradient:
    the inputs of its layers but the first (the embedding's, recomputed) on the device, or
    with `offload` two at a time (the one running, the one fetched); the gradient of its
    hidden states; its K/V; and the positions and rotary tables of its calls (int64, and
    cos and sin in the model's dtype)."""
    h, e = dims.hidden, elt
    inputs = min(2, dims.layers - 1) if offload else dims.layers - 1
    return width * ((inputs + 1) * h * e + kv_bytes_per_position(dims, e) + 8 + 2 * dims.head_dim * e)


def share_bytes(dims: ModelDims, elt: int, width: int, before: int, offload: bool = False) -> int:
    """What one rank's share of `width` positions of a prompt split over ranks (context
    parallelism, lsreplay.distributed.context) holds from its forward to the end of its
    backward: what a span of its width run layer by layer holds and its K/V's gradient, and,
    one layer at a time, the keys and values of the `before` positions of the shares before
    it and (in the backward) their gradient, while its own layers run (gathered_bytes)."""
    return (layer_by_layer_bytes(dims, elt, width, offload) + kv_bytes_per_position(dims, elt) * width
            + gathered_bytes(dims, elt, before))


def gathered_bytes(dims: ModelDims, elt: int, before: int) -> int:
    """One layer's keys and values of `before` positions and their gradient: what a share of a
    split prompt holds of the shares before it while its own layer runs (not while its
    subtree does)."""
    return 2 * before * 2 * dims.kv_dim * elt


def layer_run_bytes(dims: ModelDims, elt: int, chunk: int) -> int:
    """What one decoder layer's recompute over `chunk` positions of a span run layer by
    layer saves for its backward (it attends to the span's ancestors and earlier chunks in
    place, held already): one layer's share of saved_bytes, but its input, whose float32
    copy in a float32 model is the kept input itself."""
    layered = saved_bytes(dims, elt, 1, chunk, 1, 0, cascade=True)
    per_layer = (layered - saved_bytes(replace(dims, layers=0), elt, 1, chunk, 1, 0, cascade=True)) // dims.layers
    return per_layer - (4 * dims.hidden * chunk if elt == 4 and dims.layers > 1 else 0)


def layer_workspace_bytes(dims: ModelDims, elt: int, positions: int, repeated_kv: bool = False) -> int:
    """What a layer's backward over `positions` allocates for a moment and the meter does not
    see (estimate, not measured on a GPU): twice what the layer saves."""
    return 2 * positions * (per_position_bytes(dims, elt, repeated_kv) // max(dims.layers, 1))


def top_run_bytes(dims: ModelDims, elt: int, rows: int, entries: int) -> int:
    """What differentiating the scores of `entries` at `rows` positions of a span run layer by
    layer down to its last layer's output saves: the final norm over those rows, the entries."""
    return rows * (4 * dims.hidden + 4 + dims.hidden * elt) + entries * entry_bytes(dims, elt)


def top_runs(span: Span, chunk: int) -> list[tuple[int, int]]:
    """(rows, entries) of each chunk of `chunk` positions of `span` that has entries."""
    out: dict[int, list] = {}
    for position in span.entry_pos:
        out.setdefault(position // chunk, []).append(position)
    return [(len(set(at)), len(at)) for at in out.values()]


def layer_by_layer_chunk(dims: ModelDims, elt: int, span: Span, room: int, grads: int) -> int:
    """The most positions at a time (0 if not even one) that a span run layer by layer may
    recompute a layer over within `room` (what the budget leaves next to what the span and
    the path above hold, its K/V's gradient (`grads`) included; which its forward, where the
    top's scores are differentiated, does not hold yet), in even chunks. A layer's recompute
    and backward also allocate for a moment what the meter does not see: the chunk leaves
    room for that too (layer_workspace_bytes)."""
    per_position = layer_run_bytes(dims, elt, 1) + layer_workspace_bytes(dims, elt, 1)
    chunk = min(len(span.tokens), max(room // per_position, 0))
    while chunk and max((top_run_bytes(dims, elt, *r) for r in top_runs(span, chunk)), default=0) > room + grads:
        chunk //= 2
    if chunk:
        chunk = -(-len(span.tokens) // -(-len(span.tokens) // chunk))
    return chunk


def kept_spans(spans: list[Span], dims: ModelDims, elt: int, budget: int, cascade: bool = False,
               layer_by_layer: bool = False, offload: bool = False) -> dict[int, KeptLayers | LayerByLayer]:
    """The branching spans of a replay view (view.py) that replay forwards once before their
    subtree, each with what it keeps for its backward: its graph (KeptLayers: some of its
    layers may keep less and run again in the backward, recompute.py), or, with
    `layer_by_layer` (where the model takes cascade attention, layerwise.py), its layer
    inputs and K/V alone (LayerByLayer: each layer runs again in the backward, in chunks of
    positions; with `offload`, the inputs in host memory). The others take their K/V as
    leaf tensors (from the caching pass, or computed without grad) and run again with grad
    after their subtree (the fallback).

    Per span, top down, the cheapest choice whose memory (next to what the path above holds
    and one row of its longest child) fits `budget`, in positions' worth of compute: layers
    run again cost their share of the span's forward without grad (NO_GRAD_SHARE, the
    fallback and layer by layer the whole of it; a lean layer LEAN_SHARE of a layer's), and
    the less the span holds the more of its leaf children share a micro-batch, each run
    costing RUN_POSITIONS, as each chunk does of a span run layer by layer. (A [4, 2] tree of
    the default config at its default budget: the prompt's whole graph leaves room for one
    leaf per run; with 15 of its 30 layers lean, four leaves share a run.) Without
    `layer_by_layer` the fallback is the last resort, whatever it holds. With it, the
    fallback must fit too (its whole graph, run after its subtree), and so must a kept graph's
    layers run again in its backward (one layer's graph over the span at a time), and a
    choice must leave room for the least its subtree can hold (least_below); where nothing
    fits with room for a row of its longest leaf, its leaves run over the budget (a leaf a
    micro-batch, as leaf_rows cuts them) beside the way that holds least; where nothing fits
    even so, ConfigError says what the budget needs. Decided from the view alone, so the
    caching pass knows which K/V the backward will read."""
    return _Choices(spans, dims, elt, budget, cascade, layer_by_layer, offload).choose()


def split_spans(spans: list[Span], dims: ModelDims, elt: int, budget: int, share: Span, before: int,
                offload: bool = False) -> dict[int, KeptLayers | LayerByLayer]:
    """kept_spans for a tree whose root span is split over ranks (context parallelism): this
    rank's `share` of it (a span of its positions and entries, `before` positions of other
    shares before it) runs layer by layer in the largest chunks the budget leaves room for
    beside what it holds (share_bytes), and the spans below the root are chosen as kept_spans
    chooses them below a root that holds that. Raises ConfigError where not even one position
    at a time fits."""
    choices = _Choices(spans, dims, elt, budget, True, True, offload)
    width, grads = len(share.tokens), kv_bytes_per_position(dims, elt) * len(share.tokens)
    held = share_bytes(dims, elt, width, before, offload)
    chunk = layer_by_layer_chunk(dims, elt, share, budget - held, grads)
    if not chunk:
        need = held + layer_run_bytes(dims, elt, 1) + layer_workspace_bytes(dims, elt, 1)
        raise ConfigError(f"replay.budget_mb={budget / MiB:.6g} is too small for a rank's share of {width} positions "
                          f"of a prompt split over ranks: it holds {held / MiB:.1f} MiB of layer inputs, K/V and their "
                          f"gradient, and the K/V of the {before} positions before it, one layer at a time; raise "
                          f"replay.budget_mb to at least {-(-need // MiB)}, or split over more ranks "
                          "(replay.context_parallel)")
    choices.kept[spans[0].id] = LayerByLayer(chunk, offload)
    for c in spans[0].children:
        choices.visit(spans[c], held, 1)
    return choices.kept


def least_budget(spans: list[Span], dims: ModelDims, elt: int, cascade: bool = True, offload: bool = False,
                 leaves: bool = True) -> int:
    """The least budget at which kept_spans (with layer_by_layer) runs a replay view: what its
    backward holds at once run the way that holds least, a row of each leaf beside it (or,
    `leaves` false, not: the least it refuses below)."""
    return _Choices(spans, dims, elt, 0, cascade, True, offload).least_of(spans[0], 0, leaves)


@dataclass(frozen=True)
class _Way:
    """One way of running a branching span: `choice` (None: the fallback), what it holds
    while its subtree runs (`held`), the most it holds at once but beside its leaves
    (`peak`), and with one row of its longest leaf (`with_leaf`)."""

    choice: KeptLayers | LayerByLayer | None
    held: int
    peak: int
    with_leaf: int


class _Choices:
    """kept_spans's choice, span by span."""

    def __init__(self, spans: list[Span], dims: ModelDims, elt: int, budget: int, cascade: bool,
                 layer_by_layer: bool, offload: bool):
        self.spans, self.dims, self.elt, self.budget, self.cascade = spans, dims, elt, budget, cascade
        self.layer_by_layer, self.offload = layer_by_layer, offload
        self.kept: dict[int, KeptLayers | LayerByLayer] = {}
        self.least: dict[tuple[int, bool], int] = {}

    def choose(self) -> dict[int, KeptLayers | LayerByLayer]:
        self.visit(self.spans[0], 0, 0)
        return self.kept

    def visit(self, span: Span, held: int, depth: int) -> None:
        if span.is_leaf:
            return
        options = self.fitting(span, held, depth, True)
        best = min(options, key=lambda o: (o[0], o[1] is None)) if options else None
        if best is None and self.layer_by_layer:
            # A leaf too long for the budget still runs, a micro-batch of its own (leaf_rows):
            # then what holds least beside it.
            options = self.fitting(span, held, depth, False)
            best = min(options, key=lambda o: (o[2], o[0])) if options else None
        if best is None:
            need = self.least_of(self.spans[0], 0, False)
            raise ConfigError(_too_small(self.dims, self.elt, self.spans[0], self.budget, need, self.offload))
        if best[1] is not None:
            self.kept[span.id] = best[1]
        for c in span.children:
            self.visit(self.spans[c], best[2], depth + 1)

    def fitting(self, span: Span, held: int, depth: int, leaves: bool) -> list:
        """(cost, choice, what the path holds below it) of each way of running `span` that
        fits the budget after `held`, leaving room for a row of its longest leaf or not."""
        below = self.least_below(span, depth, leaves) if self.layer_by_layer else 0
        return [(self.cost(span, w.choice, held + w.held), w.choice, held + w.held)
                for w in self.ways(span, depth, self.budget - held)
                if (w.choice is None and not self.layer_by_layer)
                or held + max(w.with_leaf if leaves else w.peak, w.held + below) <= self.budget]

    def ways(self, span: Span, depth: int, room: int | None) -> list[_Way]:
        """Every way of running `span`, one run layer by layer in the largest chunks that fit
        `room` (None: one position at a time, the least)."""
        dims, elt, cascade, length = self.dims, self.elt, self.cascade, len(span.tokens)
        # One row of its longest child; with layer_by_layer of its longest leaf, as least_below
        # counts the branching children's subtrees.
        width = max((len(self.spans[c].tokens) for c in span.children
                     if self.spans[c].is_leaf or not self.layer_by_layer), default=0)
        child = saved_bytes(dims, elt, 1, width, span.end, width - 1, cascade) if width else 0
        grads = kv_bytes_per_position(dims, elt) * length
        run = saved_bytes(dims, elt, 1, length, span.start, len(span.entry_ids), cascade)
        out = [_Way(None, 2 * grads, 2 * grads + run, 2 * grads + max(child, run))]  # its K/V, their gradient
        graph = (run - saved_bytes(replace(dims, layers=0), elt, 1, length, span.start, len(span.entry_ids),
                                   cascade)) // dims.layers  # one layer's: what one run again holds at once
        for layers in layer_choices(dims.layers):
            held = grads + kept_bytes(dims, elt, length, span.start, len(span.entry_ids), layers, cascade, depth)
            again = graph if self.layer_by_layer and layers.rerun + layers.lean else 0
            out.append(_Way(layers, held, held + again, held + max(child, again)))
        if self.layer_by_layer:
            held = grads + layer_by_layer_bytes(dims, elt, length, self.offload)
            chunk = 1 if room is None else layer_by_layer_chunk(dims, elt, span, room - held, grads)
            if chunk:
                top = max((top_run_bytes(dims, elt, *r) for r in top_runs(span, chunk)), default=0)
                peak = max(held + layer_run_bytes(dims, elt, chunk), held - grads + top)
                out.append(_Way(LayerByLayer(chunk, self.offload), held, peak, max(peak, held + child)))
        return out

    def least_below(self, span: Span, depth: int, leaves: bool) -> int:
        """The least that the subtrees of `span`'s branching children hold at once, each run
        the way that holds least (with layer_by_layer only: without it nothing is refused)."""
        return max((self.least_of(self.spans[c], depth + 1, leaves) for c in span.children
                    if not self.spans[c].is_leaf), default=0)

    def least_of(self, span: Span, depth: int, leaves: bool) -> int:
        if (span.id, leaves) not in self.least:
            below = self.least_below(span, depth, leaves)
            self.least[span.id, leaves] = min(max(w.with_leaf if leaves else w.peak, w.held + below)
                                              for w in self.ways(span, depth, None))
        return self.least[span.id, leaves]

    def cost(self, span: Span, choice: KeptLayers | LayerByLayer | None, held: int) -> float:
        """In positions' worth: what runs again of the span, and its leaves' micro-batches."""
        length = len(span.tokens)
        if isinstance(choice, LayerByLayer):
            again = NO_GRAD_SHARE * length + RUN_POSITIONS * -(-length // choice.chunk)
        else:
            again = NO_GRAD_SHARE * length * (1 if choice is None else choice.cost_layers / self.dims.layers)
        widths = sorted((len(self.spans[c].tokens) for c in span.children if self.spans[c].is_leaf), reverse=True)
        runs = leaf_batch_rows(self.dims, self.elt, widths, span.end, self.budget - held, self.cascade)
        return again + RUN_POSITIONS * len(runs)


def _too_small(dims: ModelDims, elt: int, root: Span, budget: int, need: int, offload: bool) -> str:
    """Why no way of running a tree fits `budget`: the least it needs, and what its prompt's
    layer inputs and K/V (and their gradient) take."""
    width = len(root.tokens)
    prompt = layer_by_layer_bytes(dims, elt, width, offload) + kv_bytes_per_position(dims, elt) * width
    where = " (two layers on the device, the others in host memory)" if offload else ""
    return (f"replay.budget_mb={budget / MiB:.6g} is too small for this tree: the least its backward can hold at "
            f"once, its leaves aside, is {need / MiB:.2f} MiB (its prompt of {width} tokens, run layer by layer, "
            f"holds {prompt / MiB:.1f} MiB of layer inputs{where}, K/V and their gradient); raise replay.budget_mb to "
            f"at least {-(-need // MiB)}, or shorten the prompts (data.max_prompt_tokens)")


def leaf_batch_rows(dims: ModelDims, elt: int, widths: list[int], past: int, budget: int,
                    cascade: bool = False) -> list[int]:
    """The micro-batches sibling leaves of `widths` new positions (longest first) after
    `past` positions replay in: their sizes, in order (leaf_rows cuts each)."""
    out, at = [], 0
    while at < len(widths):
        out.append(leaf_rows(dims, elt, len(widths) - at, widths[at], past, budget, cascade))
        at += out[-1]
    return out


def leaf_rows(dims: ModelDims, elt: int, count: int, width: int, past: int, budget: int,
              cascade: bool = False) -> int:
    """How many of `count` sibling leaves of at most `width` new positions after `past`
    positions go into the first micro-batch: as few micro-batches as fit `budget` (a leaf
    each at least), of even sizes, since every micro-batch reads the whole past again;
    `cascade` as in saved_bytes."""
    fit = 1
    while fit < count and saved_bytes(dims, elt, fit + 1, width, past, (fit + 1) * (width - 1), cascade) <= budget:
        fit += 1
    batches = -(-count // fit)
    return -(-count // batches)
