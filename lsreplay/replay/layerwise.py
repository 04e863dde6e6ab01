"""A long branching span run layer by layer: it keeps its layer inputs and its K/V, no graph.

A branching span (a long prompt, most often) whose graph does not fit the replay budget,
even with its layers lean or run again (recompute.py), and whose whole graph would not fit
either when it runs again after its subtree (the fallback, backward.py), runs layer by
layer (memory.LayerByLayer, chosen by memory.kept_spans):

- its forward runs without grad one layer at a time over all its positions, in chunks of
  positions (each chunk attends through cascade attention to the span's ancestors and, as
  one more prefix part, to the span's own keys and values before it), and keeps each
  decoder layer's input and the span's K/V. The K/V, as leaf tensors, feed its subtree,
  whose dK/dV accumulate in them. The scores of the span's own entries (a prompt's last
  position, predicting each child's first token) are differentiated at once down to the
  last layer's output: that gradient is all the top of the backward needs;
- after its subtree, its backward runs the layers again one at a time from the top: layer
  l over one chunk at a time, the last chunk first, recomputed with grad from its kept
  input and backpropagated with the gradient of its output (what layer l + 1 sent back to
  its input) and the dK/dV of its keys and values: the subtree's, plus what the span's
  later chunks, already done, sent them. What a chunk's queries send to the keys and values
  of the chunks before it waits there for their turn. Layer 0's input is the embedding,
  recomputed from the tokens, so that the embedding's gradient follows.

Memory then holds the layer inputs, the K/V and their gradient, one gradient of the hidden
states, and one layer's graph over one chunk (memory.layer_by_layer_bytes,
layer_chunk_bytes). With `offload` on CUDA the layer inputs go to pinned host memory as the
forward makes them and come back one layer ahead in the backward, copied on a side stream
while the layer above computes (_LayerInputs); on a CPU they stay where they are, on the
same code path.

A span split over ranks (context parallelism, lsreplay.distributed.context) is one rank's
share of a prompt run this way, with `peers` (SpanPeers): at each layer of the forward the
share's keys and values are computed first (the layer run up to its attention) and the
K/V of the positions before the share come from the ranks that hold them, one more prefix
part; in the backward the gradient the share's queries send to those K/V goes back to their
holders, and the gradient the later ranks' queries sent this share's keys and values is
backpropagated through the layer up to its attention (the same partial run, with grad),
after the layer's chunks: by linearity, the same gradient as if it had entered with theirs.

Each decoder layer is called directly, with the arguments the model's forward calls it
with: captured, chunk by chunk, by a run of the model's decoder whose layers only record
their arguments (position embeddings, the model's keyword arguments, whatever the family
passes), which also gives layer 0's input; with a fresh cache that hands back the chunk's
keys and values, and the chunk's prefix parts, under cascade attention (cascade.py). So this
applies where cascade attention does (cascade.cascade_applies), on the layers and final norm
of the model's decoder (hf_compat.decoder).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch
from torch.utils._pytree import tree_flatten
from transformers import Cache, PreTrainedModel

from lsreplay.models.attention_switch import attention_for_thread, model_configs
from lsreplay.models.hf_compat import CACHE_KEYWORD, decoder, decoder_layers, full_cache, with_cache
from lsreplay.replay.attention.windows import layer_visibility
from lsreplay.replay.cascade import IMPLEMENTATION, CascadePrefix, KeysOnly
from lsreplay.replay.memory import ActivationMeter
from lsreplay.replay.segments import PrefixKV, padded_batch

log = logging.getLogger(__name__)

# The keyword the decoder hands its layers (and their attention) the prefix parts by.
PREFIX_KEYWORD = "cascade_prefix"

# (hidden states of some of the span's positions after the final norm (R, d), entry ids,
# their rows in it, their targets) -> the entries' weighted scores summed, with grad.
Score = Callable[[torch.Tensor, list[int], list[int], list[int]], torch.Tensor]


def layer_by_layer_applies(model: PreTrainedModel) -> bool:
    """Whether the model has the decoder layers and final norm this runs one at a time, and
    no other weights in its decoder than theirs and the input embedding's: others may compute
    what the layers are called with (Gemma 4's per-layer inputs), which the backward passes
    as the forward computed them, without grad. (It must take cascade attention too:
    cascade.cascade_applies.)"""
    layers, norm = decoder_layers(model), getattr(decoder(model), "norm", None)
    if not layers or not isinstance(norm, torch.nn.Module):
        return False
    known = {id(p) for module in (*layers, norm, model.get_input_embeddings()) for p in module.parameters()}
    return all(id(p) in known for p in decoder(model).parameters())


class SpanPeers(Protocol):
    """What one rank's share of a span split over ranks exchanges with the others at each
    layer (lsreplay.distributed.context implements it; one device has none)."""

    def before(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
               grad: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer `layer`'s keys and values of the positions before this share, in parts in
        order (leaf tensors with `grad`, whose .grad collects what this share's queries send
        them), given this share's own `keys` and `values` of the layer, which the ranks after
        it read."""

    def sent_back(self, layer: int,
                  before: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hand the gradients `before`'s parts collected to their holders; the gradient of this
        share's keys and values of layer `layer` from the later ranks' queries (None: none)."""


def _at_layer(layer: int, layers: int, keys: torch.Tensor, values: torch.Tensor) -> PrefixKV:
    """A prefix part of one layer's keys and values (the attention of layer `layer` reads its
    own entry only, cascade.cascade_attention)."""
    k, v = [None] * layers, [None] * layers
    k[layer], v[layer] = keys, values
    return k, v


class LayerByLayerSpan:
    """One branching span of `tokens` at positions start.. after `ancestors` (their K/V as
    the path holds them), run layer by layer in chunks of `chunk` positions; what it holds
    counts in `meter`. `peers`: the other ranks' shares where this is one rank's share of a
    span split over ranks (None: the whole span, on this device)."""

    def __init__(self, model: PreTrainedModel, tokens: list[int], start: int, ancestors: list[PrefixKV],
                 chunk: int, meter: ActivationMeter, offload: bool = False, peers: SpanPeers | None = None):
        self.model, self.tokens, self.start, self.ancestors, self.meter = model, tokens, start, ancestors, meter
        self.peers = peers
        self.layers = decoder_layers(model)
        self.chunks = [(lo, min(lo + chunk, len(tokens))) for lo in range(0, len(tokens), chunk)]
        param = next(model.parameters())
        shape = (1, len(tokens), model.config.hidden_size)
        self.inputs = _LayerInputs(len(self.layers), shape, param.dtype, param.device,
                                   offload and param.device.type == "cuda", meter)
        # The gradient of the layer output being backpropagated, at every position.
        self.grad = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.keys: list[torch.Tensor | None] = [None] * len(self.layers)
        self.values: list[torch.Tensor | None] = [None] * len(self.layers)
        self.calls: list[list[tuple[tuple, dict]]] = []  # per chunk, per layer: (args after the input, kwargs)
        self.exchanged: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # the running layer's from the peers
        self.cache_keyword = CACHE_KEYWORD
        # The meter's handles: of what the span holds throughout, and of each layer's K/V.
        self.counted = [meter.keep(self.grad)]
        self.counted_kv: list[list] = [[] for _ in self.layers]

    # -- forward ------------------------------------------------------------------------
    def forward(self, score: Score, ids: list[int], positions: list[int], targets: list[int]) -> PrefixKV:
        """Run the span forward without grad, layer by layer, keep its layer inputs and K/V,
        and differentiate its entries (`ids` at `positions` of the span, predicting
        `targets`) down to the last layer's output. Returns its K/V as leaf tensors for its
        subtree (their .grad take its dK/dV)."""
        log.info("a span of %d positions at %d runs layer by layer, %d chunk(s) of %d: forward", len(self.tokens),
                 self.start, len(self.chunks), self.chunks[0][1])
        start = time.perf_counter()
        for lo, hi in self.chunks:
            self.calls.append(self._captured_calls(lo, hi))
            self.counted += [self.meter.keep(t) for t in _tensors(self.calls[-1])]  # rotary tables, positions
        last = len(self.layers) - 1
        with torch.no_grad(), attention_for_thread(model_configs(self.model), IMPLEMENTATION):
            hidden = None  # the running layer's input at every position (layer 0's: embedded chunk by chunk)
            for layer in range(len(self.layers)):
                log.debug("span at %d: layer %d forward, %.1f s in", self.start, layer, time.perf_counter() - start)
                before = self._peers_before(layer, hidden, grad=False)
                out = self.inputs.output_buffer(layer + 1) if layer < last else None
                for index, (lo, hi) in enumerate(self.chunks):
                    x = hidden[:, lo:hi] if layer else self._embedded(lo, hi)
                    y, new = self._call(layer, index, x, before + self._own_before(lo, layer))
                    self._keep_kv(layer, lo, hi, new)
                    if out is not None:
                        out[:, lo:hi] = y
                    elif mine := [(i, p - lo, t) for i, p, t in zip(ids, positions, targets) if lo <= p < hi]:
                        self._differentiate_top(score, y, lo, hi, mine)
                del before
                self.exchanged = None
                if out is not None:
                    self.inputs.written(layer + 1)
                self.inputs.forwarded(layer)
                hidden = out
        for t in self.keys + self.values:
            t.requires_grad_()
        return self.keys, self.values

    def _captured_calls(self, lo: int, hi: int) -> list[tuple[tuple, dict]]:
        """The arguments every decoder layer is called with for positions lo..hi (after its
        input): the model's decoder run with its layers only recording them."""
        calls, _ = self._decoder_run(lo, hi, record=True)
        return calls

    def _embedded(self, lo: int, hi: int) -> torch.Tensor:
        """Layer 0's input at positions lo..hi (with grad where grad is on): the model's
        forward up to its first layer (the embedding, and whatever the family does to it)."""
        _, hidden = self._decoder_run(lo, hi, record=False)
        return hidden

    def _decoder_run(self, lo: int, hi: int, record: bool) -> tuple[list, torch.Tensor]:
        """Run the model's decoder over positions lo..hi with every layer passing its input
        on unchanged: (each layer's call arguments after its input, if `record`; layer 0's input)."""
        ids, positions = padded_batch(self.model, [self.tokens[lo:hi]], self.start + lo)
        calls: list = [None] * len(self.layers)
        first: list[torch.Tensor] = []

        def recorder(index: int):
            def forward(hidden_states, *args, **kwargs):
                if index == 0:
                    first.append(hidden_states)
                if record:
                    # Not the cache: each call gets its own (named as this transformers names it to a layer).
                    self.cache_keyword = next((k for k, v in kwargs.items() if isinstance(v, Cache)), CACHE_KEYWORD)
                    calls[index] = (tuple(args), {k: v for k, v in kwargs.items() if k != self.cache_keyword})
                if index == (len(self.layers) - 1 if record else 0):
                    raise _Stop()  # nothing after it is needed (the final norm would save its input under grad)
                return hidden_states
            return forward

        if clash := [i for i, layer in enumerate(self.layers) if "forward" in layer.__dict__]:
            raise RuntimeError(f"decoder layers {clash} have their forward replaced already (a hook library's?)")
        for index, layer in enumerate(self.layers):  # an instance attribute shadows the class's forward until deleted
            layer.forward = recorder(index)
        prefix = CascadePrefix([], self.start + lo, layer_visibility(self.model.config))
        try:
            with attention_for_thread(model_configs(self.model), IMPLEMENTATION):
                decoder(self.model)(input_ids=ids, position_ids=positions, use_cache=True, cascade_prefix=prefix,
                                    **with_cache(full_cache(self.model)))
        except _Stop:
            pass
        finally:
            for layer in self.layers:
                del layer.forward
        if not first:
            raise RuntimeError(f"{type(self.model).__name__} never called its first decoder layer")
        return calls, first[0]

    def _call(self, layer: int, index: int, x: torch.Tensor, parts: list, keys_only: bool = False):
        """Decoder layer `layer` over chunk `index`'s input `x`, attending to `parts`: its
        output and the cache layer holding the chunk's keys and values. `keys_only`: the layer
        runs up to its attention only (output None)."""
        args, kwargs = self.calls[index][layer]
        cache = full_cache(self.model)
        prefix = replace(kwargs[PREFIX_KEYWORD], parts=self.ancestors + parts, layers_run=set(), keys_only=keys_only)
        try:
            out = self.layers[layer](x, *args, **{**kwargs, self.cache_keyword: cache, PREFIX_KEYWORD: prefix})
        except KeysOnly:
            if not keys_only:
                raise
            return None, cache.layers[layer]
        return (out[0] if isinstance(out, tuple) else out), cache.layers[layer]

    def _keep_kv(self, layer: int, lo: int, hi: int, new) -> None:
        """The chunk's keys and values of layer `layer` into the span's."""
        if self.keys[layer] is None:
            self.keys[layer] = _span_sized(new.keys, len(self.tokens))
            self.values[layer] = _span_sized(new.values, len(self.tokens))
            self.counted_kv[layer] = [self.meter.keep(self.keys[layer]), self.meter.keep(self.values[layer])]
        self.keys[layer][..., lo:hi, :] = new.keys
        self.values[layer][..., lo:hi, :] = new.values

    def _peers_before(self, layer: int, hidden: torch.Tensor | None, grad: bool) -> list[PrefixKV]:
        """With peers, the K/V of the positions before this share at layer `layer` (in the
        forward, once this share's own are computed: the layer run up to its attention)."""
        if self.peers is None:
            return []
        if self.keys[layer] is None:
            for index, (lo, hi) in enumerate(self.chunks):
                _, new = self._call(layer, index, hidden[:, lo:hi] if layer else self._embedded(lo, hi), [],
                                    keys_only=True)
                self._keep_kv(layer, lo, hi, new)
        self.exchanged = self.peers.before(layer, self.keys[layer].detach(), self.values[layer].detach(), grad)
        return [_at_layer(layer, len(self.layers), k, v) for k, v in self.exchanged]

    def _differentiate_top(self, score: Score, top: torch.Tensor, lo: int, hi: int, entries) -> None:
        """The gradient of the chunk's entries' scores at the last layer's output, into self.grad."""
        rows = sorted({p for _, p, _ in entries})
        at = {p: r for r, p in enumerate(rows)}
        with torch.enable_grad():
            last = top[:, rows].detach().requires_grad_()
            objective = score(decoder(self.model).norm(last)[0], [i for i, _, _ in entries],
                              [at[p] for _, p, _ in entries], [t for _, _, t in entries])
            if objective.requires_grad:
                objective.backward()
        if last.grad is not None:
            self.grad[:, [lo + r for r in rows]] = last.grad

    def _own_before(self, lo: int, layer: int, grad: bool = False) -> list[PrefixKV]:
        """Layer `layer`'s K/V of the span's own positions before lo as one more prefix part
        (none at 0); with `grad`, as leaf tensors whose .grad collects what is sent to them."""
        if lo == 0:
            return []
        keys, values = self.keys[layer][..., :lo, :], self.values[layer][..., :lo, :]
        if grad:
            keys, values = keys.detach().requires_grad_(), values.detach().requires_grad_()
        return [_at_layer(layer, len(self.layers), keys, values)]

    # -- backward -----------------------------------------------------------------------
    def backward(self) -> None:
        """After the subtree: every layer again, the top one first, chunk by chunk, the last
        chunk first, each backpropagated with its output's gradient and its K/V's; with
        peers, then the later ranks' gradient of the share's K/V through the layer's keys
        and values."""
        start = time.perf_counter()
        with attention_for_thread(model_configs(self.model), IMPLEMENTATION):
            for layer in reversed(range(len(self.layers))):
                log.debug("span at %d: layer %d again, %.1f s in", self.start, layer, time.perf_counter() - start)
                inputs = self.inputs.take(layer) if layer else None
                key_grad = _grad_of(self.keys[layer])
                value_grad = _grad_of(self.values[layer])
                before = self._peers_before(layer, None, grad=True)
                for index in reversed(range(len(self.chunks))):
                    self._backward_chunk(layer, index, inputs, before, key_grad, value_grad)
                if self.peers is not None and (later := self.peers.sent_back(layer, self.exchanged)) is not None:
                    for index in range(len(self.chunks)):
                        self._backward_keys(layer, index, inputs, *later)
                # What only this layer needed.
                self.keys[layer] = self.values[layer] = inputs = key_grad = value_grad = before = self.exchanged = None
                self.counted_kv[layer] = []
                self.inputs.drop(layer)
        self.counted = []
        log.info("the span of %d positions at %d: its %d layers run again in %.1f s", len(self.tokens), self.start,
                 len(self.layers), time.perf_counter() - start)

    def _input(self, layer: int, index: int, inputs: torch.Tensor | None) -> torch.Tensor:
        """Chunk `index`'s input of layer `layer`, with grad: kept, or (layer 0) embedded again."""
        lo, hi = self.chunks[index]
        return inputs[:, lo:hi].detach().requires_grad_() if layer else self._embedded(lo, hi)

    def _backward_chunk(self, layer: int, index: int, inputs: torch.Tensor | None, before: list[PrefixKV],
                        key_grad: torch.Tensor, value_grad: torch.Tensor) -> None:
        lo, hi = self.chunks[index]
        x = self._input(layer, index, inputs)
        own = self._own_before(lo, layer, grad=True)
        out, new = self._call(layer, index, x, before + own)
        outputs = [(out, self.grad[:, lo:hi]), (new.keys, key_grad[..., lo:hi, :]),
                   (new.values, value_grad[..., lo:hi, :])]
        live = [(o, g) for o, g in outputs if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        if layer:
            self.grad[:, lo:hi] = x.grad
        if own:
            for earlier, grad in zip((own[0][0][layer], own[0][1][layer]), (key_grad, value_grad)):
                if earlier.grad is not None:
                    grad[..., :lo, :] += earlier.grad

    def _backward_keys(self, layer: int, index: int, inputs: torch.Tensor | None, key_grad: torch.Tensor,
                       value_grad: torch.Tensor) -> None:
        """Backpropagate `key_grad` and `value_grad` (the share's, from the later ranks)
        through layer `layer`'s keys and values of chunk `index`, into its input's gradient."""
        lo, hi = self.chunks[index]
        x = self._input(layer, index, inputs)
        _, new = self._call(layer, index, x, [], keys_only=True)
        live = [(o, g[..., lo:hi, :]) for o, g in ((new.keys, key_grad), (new.values, value_grad)) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        if layer and x.grad is not None:
            self.grad[:, lo:hi] += x.grad


class _Stop(Exception):
    """Raised by a recording layer to end the decoder's run there."""


def _span_sized(chunk: torch.Tensor, width: int) -> torch.Tensor:
    """An empty tensor like `chunk` (1, heads, positions, d) of `width` positions."""
    return chunk.new_empty((*chunk.shape[:-2], width, chunk.shape[-1]))


def _grad_of(t: torch.Tensor) -> torch.Tensor:
    """A leaf's accumulated gradient (zeros if nothing reached it)."""
    if t.grad is None:
        t.grad = torch.zeros_like(t)
    return t.grad


def _tensors(calls: list[tuple[tuple, dict]]) -> list[torch.Tensor]:
    """Every tensor the captured calls hold."""
    leaves, _ = tree_flatten(calls)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


class _LayerInputs:
    """The inputs of a span's layers 1.. (layer 0's is recomputed from the tokens), kept on
    the device; with `offload` (CUDA) in pinned host memory instead: the forward writes each
    layer's input on the device, copies it there on a side stream and drops it once the
    layer has run, and the backward fetches each back one layer ahead of its need. What is
    on the device counts in `meter`."""

    def __init__(self, layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, offload: bool,
                 meter: ActivationMeter):
        self.shape, self.dtype, self.device, self.offload, self.meter = shape, dtype, device, offload, meter
        place = dict(dtype=dtype, pin_memory=True) if offload else dict(dtype=dtype, device=device)
        self.kept = [None] + [torch.empty(shape, **place) for _ in range(1, layers)]
        self.counted = [] if offload else [meter.keep(t) for t in self.kept[1:]]
        self.stream = torch.cuda.Stream(device) if offload else None
        self.staged: dict[int, tuple[torch.Tensor, object]] = {}  # the forward's, on the device (offload)
        self.fetched: dict[int, tuple[torch.Tensor, object, torch.cuda.Event]] = {}

    def output_buffer(self, layer: int) -> torch.Tensor:
        """Where the forward writes layer `layer`'s input (layer - 1's output): the kept
        tensor, or with offload one on the device until `forwarded(layer)`."""
        if not self.offload:
            return self.kept[layer]
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.staged[layer] = (tensor, self.meter.keep(tensor))
        return tensor

    def written(self, layer: int) -> None:
        """The forward wrote all of layer `layer`'s input: with offload, copied to host memory
        on the side stream."""
        if not self.offload:
            return
        tensor = self.staged[layer][0]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.kept[layer].copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # not reused before the copy is done

    def forwarded(self, layer: int) -> None:
        """The forward ran layer `layer`: with offload, its input leaves the device."""
        self.staged.pop(layer, None)

    def take(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s input on the device (with offload: fetched, and the next layer
        down's fetch started)."""
        if not self.offload:
            return self.kept[layer]
        if layer not in self.fetched:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward's copies, the frees before
            self._fetch(layer)
        tensor, _, ready = self.fetched[layer]
        torch.cuda.current_stream(self.device).wait_event(ready)
        tensor.record_stream(torch.cuda.current_stream(self.device))
        if layer > 1:
            self._fetch(layer - 1)
        return tensor

    def _fetch(self, layer: int) -> None:
        with torch.cuda.stream(self.stream):
            tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            tensor.copy_(self.kept[layer], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.fetched[layer] = (tensor, self.meter.keep(tensor), ready)

    def drop(self, layer: int) -> None:
        """What layer `layer` kept is no longer needed."""
        if self.offload:
            self.fetched.pop(layer, None)
        elif layer:
            self.kept[layer] = None
            self.counted[layer - 1] = None
