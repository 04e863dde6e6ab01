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

from lsreplay.replay.view import Span


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


def kept_spans(spans: list[Span], dims: ModelDims, elt: int, budget: int,
               cascade: bool = False) -> dict[int, KeptLayers]:
    """The branching spans of a replay view (view.py) that replay forwards once with grad and
    keeps while their subtree replays (their K/V feed the children, their graph takes the
    children's dK/dV afterwards), each with what its decoder layers keep (KeptLayers: some
    may keep less and run again in the backward, recompute.py). The others take their K/V
    as leaf tensors (from the caching pass, or computed without grad) and run again with
    grad after their subtree: the fallback that bounds memory.

    Per span, top down, the cheapest choice whose held memory (next to what the path above
    holds and one row of its longest child) fits `budget`, in positions' worth of compute:
    layers run again cost their share of the span's forward without grad (NO_GRAD_SHARE,
    the fallback the whole of it; a lean layer LEAN_SHARE of a layer's), and the less the
    span holds the more of its leaf children share a micro-batch, each run costing
    RUN_POSITIONS. (A [4, 2] tree of the default config at its default budget: the prompt's
    whole graph leaves room for one leaf per run; with 15 of its 30 layers lean, four leaves
    share a run.) Decided from the view alone, so the caching pass knows which K/V the
    backward will read."""
    kv = kv_bytes_per_position(dims, elt)
    choices = layer_choices(dims.layers)
    kept: dict[int, KeptLayers] = {}

    def leaf_runs(span: Span, held: int) -> int:
        widths = sorted((len(spans[c].tokens) for c in span.children if spans[c].is_leaf), reverse=True)
        return len(leaf_batch_rows(dims, elt, widths, span.end, budget - held, cascade))

    def visit(span: Span, held: int, depth: int) -> None:
        if span.is_leaf:
            return
        width, length = max(len(spans[c].tokens) for c in span.children), len(span.tokens)
        child = saved_bytes(dims, elt, 1, width, span.end, width - 1, cascade)
        grads = kv * length
        # (cost, what the layers keep or None for the fallback, what the path holds below it)
        fallback_held = held + 2 * grads  # the K/V as leaf tensors, and their gradient
        best = (NO_GRAD_SHARE * length + RUN_POSITIONS * leaf_runs(span, fallback_held), None, fallback_held)
        for layers in choices:
            kept_held = held + grads + kept_bytes(dims, elt, length, span.start, len(span.entry_ids), layers,
                                                  cascade, depth)
            if kept_held + child <= budget:
                cost = (NO_GRAD_SHARE * length * layers.cost_layers / dims.layers
                        + RUN_POSITIONS * leaf_runs(span, kept_held))
                # On a tie the kept span (no K/V written and read back), keeping the most.
                best = min(best, (cost, layers, kept_held), key=lambda option: (option[0], option[1] is None))
        if best[1] is not None:
            kept[span.id] = best[1]
        for c in span.children:
            visit(spans[c], best[2], depth + 1)

    visit(spans[0], 0, 0)
    return kept


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
