"""A long branching span run layer by layer: it keeps its layer inputs and its K/V, no graph.

A branching span (a long prompt, most often) whose graph does not fit the replay budget,
even with its layers lean or run again (recompute.py), and whose whole graph would not fit
either when it runs again after its subtree (the fallback, backward.py), runs layer by
layer (memory.LayerByLayer, chosen by memory.kept_spans):

- its forward runs without grad in chunks of positions (forward_cascade: a chunk attends
  to the span's ancestors and, as one more prefix part, to the span's own keys and values
  before it), and keeps each decoder layer's input and the span's K/V. The K/V, as leaf
  tensors, feed its subtree, whose dK/dV accumulate in them. The scores of the span's own
  entries (a prompt's last position, predicting each child's first token) are
  differentiated at once down to the last layer's output: that gradient is all the top of
  the backward needs;
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

Each decoder layer is called directly, with the arguments the forward called it with
(captured by forward pre-hooks: position embeddings, masks, the model's keyword arguments,
whatever the family passes), a fresh cache that hands back the chunk's keys and values, and
its recompute's prefix parts; the attention implementation the forward ran with (cascade.py's)
is switched on again for it. So this applies where cascade attention does
(cascade.cascade_applies), on the layers and final norm of the model's decoder (hf_compat.decoder).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.utils._pytree import tree_flatten
from transformers import Cache, PreTrainedModel

from lsreplay.models.attention_switch import attention_for_thread, model_configs
from lsreplay.models.hf_compat import CACHE_KEYWORD, decoder, decoder_layers, full_cache
from lsreplay.replay.cascade import CascadePrefix, forward_cascade
from lsreplay.replay.memory import ActivationMeter
from lsreplay.replay.segments import PrefixKV, padded_batch

log = logging.getLogger(__name__)

# The keyword forward_cascade hands the model (and its attention reads) the prefix parts by.
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


class _Stop(Exception):
    """Raised by a forward pre-hook to end a forward there, with the input it was given."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class LayerByLayerSpan:
    """One branching span of `tokens` at positions start.. after `ancestors` (their K/V as
    the path holds them), run layer by layer in chunks of `chunk` positions; what it holds
    counts in `meter`."""

    def __init__(self, model: PreTrainedModel, tokens: list[int], start: int, ancestors: list[PrefixKV],
                 chunk: int, meter: ActivationMeter, offload: bool = False):
        self.model, self.tokens, self.start, self.ancestors, self.meter = model, tokens, start, ancestors, meter
        self.layers = decoder_layers(model)
        self.chunks = [(lo, min(lo + chunk, len(tokens))) for lo in range(0, len(tokens), chunk)]
        param = next(model.parameters())
        shape = (1, len(tokens), model.config.hidden_size)
        self.inputs = _LayerInputs(len(self.layers), shape, param.dtype, param.device,
                                   offload and param.device.type == "cuda", meter)
        # The gradient of the layer output being backpropagated, at every position.
        self.grad = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.calls: list[list[tuple[tuple, dict]]] = []  # per chunk, per layer: (args after the input, kwargs)
        self.implementation = model.config._attn_implementation
        self.cache_keyword = CACHE_KEYWORD
        # The meter's handles: of what the span holds throughout, and of each layer's K/V.
        self.counted = [meter.keep(self.grad)]
        self.counted_kv: list[list] = []

    # -- forward ------------------------------------------------------------------------
    def forward(self, score: Score, ids: list[int], positions: list[int], targets: list[int]) -> PrefixKV:
        """Run the span forward without grad, keep its layer inputs and K/V, and differentiate
        its entries (`ids` at `positions` of the span, predicting `targets`) down to the last
        layer's output. Returns its K/V as leaf tensors for its subtree (their .grad take
        its dK/dV)."""
        log.info("a span of %d positions at %d runs layer by layer, %d chunk(s) of %d: forward", len(self.tokens),
                 self.start, len(self.chunks), self.chunks[0][1])
        for lo, hi in self.chunks:
            top = self._forward_chunk(lo, hi)
            mine = [(i, p - lo, t) for i, p, t in zip(ids, positions, targets) if lo <= p < hi]
            if mine:
                self._differentiate_top(score, top, lo, hi, mine)
        for t in self.keys + self.values:
            t.requires_grad_()
        return self.keys, self.values

    def _forward_chunk(self, lo: int, hi: int) -> torch.Tensor:
        """Positions lo..hi through every layer without grad: their layer inputs and K/V
        kept, the arguments of every layer's call captured. Returns the last layer's output."""
        calls: list = [None] * len(self.layers)
        top = []

        def capture(index: int):
            def hook(module, args, kwargs):
                self.implementation = self.model.config._attn_implementation
                hidden = args[0] if args else kwargs["hidden_states"]
                # Not the cache (it would hold the chunk's K/V a second time; named as this
                # transformers names it to a layer) nor the prefix's parts (they would hold the
                # K/V of every layer until the last is done): the backward passes its own.
                self.cache_keyword = next((k for k, v in kwargs.items() if isinstance(v, Cache)), CACHE_KEYWORD)
                calls[index] = (tuple(args[1:]), {k: v for k, v in kwargs.items() if k not in
                                                  (self.cache_keyword, PREFIX_KEYWORD, "hidden_states")})
                calls[index][1][PREFIX_KEYWORD] = replace(kwargs[PREFIX_KEYWORD], parts=[])
                if index:
                    self.inputs.write(index, lo, hi, hidden)
            return hook

        hooks = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(self.layers)]
        hooks.append(decoder(self.model).norm.register_forward_pre_hook(lambda module, args: top.append(args[0])))
        try:
            with torch.no_grad():
                _, cache = forward_cascade(self.model, [self.tokens[lo:hi]], self.start + lo,
                                           self.ancestors + self._own_before(lo))
        finally:
            for h in hooks:
                h.remove()
        for layer, cached in enumerate(cache.layers):
            if len(self.keys) == layer:
                self.keys.append(_span_sized(cached.keys, len(self.tokens)))
                self.values.append(_span_sized(cached.values, len(self.tokens)))
                self.counted_kv.append([self.meter.keep(self.keys[layer]), self.meter.keep(self.values[layer])])
            self.keys[layer][..., lo:hi, :] = cached.keys
            self.values[layer][..., lo:hi, :] = cached.values
        self.calls.append(calls)
        self.counted += [self.meter.keep(t) for t in _tensors(calls)]  # rotary tables, positions
        return top[0]

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

    def _own_before(self, lo: int, layer: int | None = None) -> list[PrefixKV]:
        """The span's own K/V before position lo as one more prefix part (none at 0); with
        `layer`, only that layer's, as leaf tensors whose .grad collects what is sent to them."""
        if lo == 0:
            return []
        if layer is None:
            return [([k[..., :lo, :] for k in self.keys], [v[..., :lo, :] for v in self.values])]
        # The attention of layer `layer` reads its own entry only (cascade.cascade_attention).
        keys, values = [None] * len(self.layers), [None] * len(self.layers)
        keys[layer] = self.keys[layer].detach()[..., :lo, :].requires_grad_()
        values[layer] = self.values[layer].detach()[..., :lo, :].requires_grad_()
        return [(keys, values)]

    # -- backward -----------------------------------------------------------------------
    def backward(self) -> None:
        """After the subtree: every layer again, the top one first, chunk by chunk, the last
        chunk first, each backpropagated with its output's gradient and its K/V's."""
        start = time.perf_counter()
        with attention_for_thread(model_configs(self.model), self.implementation):
            for layer in reversed(range(len(self.layers))):
                log.debug("span at %d: layer %d again, %.1f s in", self.start, layer, time.perf_counter() - start)
                inputs = self.inputs.take(layer) if layer else None
                key_grad = _grad_of(self.keys[layer])
                value_grad = _grad_of(self.values[layer])
                for index in reversed(range(len(self.chunks))):
                    self._backward_chunk(layer, index, inputs, key_grad, value_grad)
                # What only this layer needed.
                self.keys[layer] = self.values[layer] = inputs = key_grad = value_grad = None
                self.counted_kv[layer] = []
                self.inputs.drop(layer)
        self.counted = []
        log.info("the span of %d positions at %d: its %d layers run again in %.1f s", len(self.tokens), self.start,
                 len(self.layers), time.perf_counter() - start)

    def _backward_chunk(self, layer: int, index: int, inputs: torch.Tensor | None, key_grad: torch.Tensor,
                        value_grad: torch.Tensor) -> None:
        lo, hi = self.chunks[index]
        x = inputs[:, lo:hi].detach().requires_grad_() if layer else self._embedded(lo, hi)
        own = self._own_before(lo, layer)
        args, kwargs = self.calls[index][layer]
        cache = full_cache(self.model)
        prefix: CascadePrefix = replace(kwargs[PREFIX_KEYWORD], parts=self.ancestors + own, layers_run=set())
        kwargs = {**kwargs, self.cache_keyword: cache, PREFIX_KEYWORD: prefix}
        out = self.layers[layer](x, *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        new = cache.layers[layer]
        outputs = [(out, self.grad[:, lo:hi]), (new.keys, key_grad[..., lo:hi, :]),
                   (new.values, value_grad[..., lo:hi, :])]
        live = [(o, g) for o, g in outputs if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        if layer:
            self.grad[:, lo:hi] = x.grad
        if own:
            for before, grad in zip((own[0][0][layer], own[0][1][layer]), (key_grad, value_grad)):
                if before.grad is not None:
                    grad[..., :lo, :] += before.grad

    def _embedded(self, lo: int, hi: int) -> torch.Tensor:
        """Layer 0's input at positions lo..hi, with grad: the model's forward up to its first
        layer (the embedding, and whatever the family does to it)."""
        ids, positions = padded_batch(self.model, [self.tokens[lo:hi]], self.start + lo)

        def stop(module, args, kwargs):
            raise _Stop(args[0] if args else kwargs["hidden_states"])

        hook = self.layers[0].register_forward_pre_hook(stop, with_kwargs=True)
        try:
            decoder(self.model)(input_ids=ids, position_ids=positions)
        except _Stop as stopped:
            return stopped.hidden
        finally:
            hook.remove()
        raise RuntimeError(f"{type(self.model).__name__} never called its first decoder layer")


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
    the device; with `offload` (CUDA) in pinned host memory instead, each copied there on a
    side stream as the forward makes it, and back one layer ahead of the backward's need.
    What is on the device counts in `meter`."""

    def __init__(self, layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, offload: bool,
                 meter: ActivationMeter):
        self.shape, self.dtype, self.device, self.offload, self.meter = shape, dtype, device, offload, meter
        place = dict(dtype=dtype, pin_memory=True) if offload else dict(dtype=dtype, device=device)
        self.kept = [None] + [torch.empty(shape, **place) for _ in range(1, layers)]
        self.counted = [] if offload else [meter.keep(t) for t in self.kept[1:]]
        self.stream = torch.cuda.Stream(device) if offload else None
        self.fetched: dict[int, tuple[torch.Tensor, object, torch.cuda.Event]] = {}

    def write(self, layer: int, lo: int, hi: int, hidden: torch.Tensor) -> None:
        """Layer `layer`'s input at positions lo..hi, from the forward."""
        if not self.offload:
            self.kept[layer][:, lo:hi] = hidden
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.kept[layer][:, lo:hi].copy_(hidden, non_blocking=True)
        hidden.record_stream(self.stream)  # not reused before the copy is done

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
