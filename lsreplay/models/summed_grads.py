"""Every weight's gradient summed in place over a backward's many autograd calls, on CPU.

Branch replay runs one autograd backward per replayed run of sibling spans, the
per-rollout reference one per rollout. In each, autograd builds every weight's gradient
densely whatever the run's length and adds it into `.grad`: a linear layer's product
fills a fresh weight-sized tensor, which is then added into `.grad` (three more passes
over it); the embedding scatters into a zeroed vocab x hidden tensor, the head's product
fills another, and the two are summed when tied. On CPU, where a pass over memory costs
about what a short run's matmuls do, that is a fixed cost per run whatever its length:
for SmolLM2-135M on two cores about as much as 100 positions' forward and backward, which
replay, with many short runs, pays more often than the per-rollout backward does. (With
the buffers below a run still costs about 35 positions' worth: bench/run_cost.py.)

Here each product goes straight into one buffer per weight (`addmm_` with the buffer as
its accumulator: a linear layer's in `_LinearInPlace`, the head's in
lsreplay.models.logits), the embedding's rows are added into it (`index_add_`), and
autograd receives each buffer once when the backward ends: `.grad`, its hooks (float32
masters, lsreplay.models.train_state) and the sum are those of one gradient, up to the
order of the additions. The price is the buffers: one more copy of the trainable weights
(in float32 at least) while the backward runs, which the activation meter does not count.

On CUDA the passes are cheap next to the buffers' memory (2.2 GB in float32 for
Qwen2.5-7B's embedding alone), so the usual per-call path stays there, as it does for
sharded (DTensor) weights and for linear layers computing in bfloat16 (whose products
would need a float32 copy of their inputs to go into a float32 buffer).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

# The dtypes that compute and accumulate as they are (the others: bfloat16, float16).
FULL_PRECISION = (torch.float32, torch.float64)


@dataclass
class Accumulator:
    """Where one weight's gradient goes while `summed_in_place` runs (float32 at least). The
    buffer is made by the first backward that reaches the weight: a backward that trains
    nothing allocates none (zeroing buffers for all of SmolLM2-135M's weights took 2 s)."""

    shape: torch.Size
    dtype: torch.dtype
    buffer: torch.Tensor | None = None
    # What the outputs' graph hangs on in place of the weight: with the weight an input,
    # autograd would run its AccumulateGrad (and hooks) on every call, with no gradient.
    anchor: torch.Tensor = field(default_factory=lambda: torch.zeros((), requires_grad=True))

    def zeroed(self) -> torch.Tensor:
        """The buffer, made of zeros if no gradient reached it yet."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.shape, dtype=self.dtype)
        return self.buffer

    def add_product(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """buffer += a @ b (the first product is the buffer)."""
        if self.buffer is None:
            self.buffer = (a @ b).to(self.dtype)
        else:
            self.buffer.addmm_(a, b)


_ACTIVE = WeakIdKeyDictionary()  # weight -> Accumulator


def accumulator(weight: torch.Tensor) -> Accumulator | None:
    return _ACTIVE.get(weight)


def _applies(weight: torch.Tensor | None) -> bool:
    return (weight is not None and weight.requires_grad and weight.device.type == "cpu"
            and type(weight.data) is torch.Tensor)


@contextmanager
def summed_in_place(model: torch.nn.Module):
    """Within the block, the gradients of the embedding, the LM head and every linear layer
    in float32 or float64 go into one buffer per weight; on leaving it normally, into
    `.grad` by one autograd call. (On an exception they are dropped with the rest of the
    half-done backward.)"""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    linears = [m for m in model.modules() if _plain_linear(m)]
    weights = {id(w): w for w in (embedding.weight, getattr(head, "weight", None), *(m.weight for m in linears))
               if _applies(w)}
    if not weights or not torch.is_grad_enabled() or any(w in _ACTIVE for w in weights.values()):
        yield
        return
    for w in weights.values():
        _ACTIVE[w] = Accumulator(w.shape, torch.promote_types(w.dtype, torch.float32))
    hook = embedding.register_forward_hook(_embedding_into_buffer) if _plain_lookup(embedding) else None
    for m in linears:  # an instance attribute shadows the class's forward until deleted
        m.forward = _LinearForward(m)
    try:
        yield
        live = [(w, _ACTIVE[w].buffer) for w in weights.values() if _ACTIVE[w].buffer is not None]
        if live:
            torch.autograd.backward([w.view_as(w) for w, _ in live], [b.to(w.dtype) for w, b in live])
    finally:
        if hook is not None:
            hook.remove()
        for m in linears:
            del m.forward
        for w in weights.values():
            _ACTIVE.pop(w, None)


def _plain_lookup(embedding: torch.nn.Module) -> bool:
    """An nn.Embedding whose output is its weight's rows (no scale, as Gemma's subclass
    applies, no max_norm renormalising them): what the hook may recompute."""
    return type(embedding) is torch.nn.Embedding and embedding.max_norm is None and embedding.weight in _ACTIVE


def _plain_linear(module: torch.nn.Module) -> bool:
    """An nn.Linear computing in full precision whose forward nothing else replaced (as
    accelerate's hooks do, by an instance attribute)."""
    return (type(module) is torch.nn.Linear and "forward" not in module.__dict__ and _applies(module.weight)
            and module.weight.dtype in FULL_PRECISION)


def _embedding_into_buffer(module, args, output):
    """Forward hook: the same rows, with a backward that adds into the buffer."""
    if not output.requires_grad:
        return output
    acc = _ACTIVE[module.weight]
    return _EmbeddingInPlace.apply(args[0], module.weight.detach(), acc.anchor, acc, module.padding_idx)


class _EmbeddingInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, anchor, acc, padding_idx):
        ctx.ids, ctx.acc, ctx.padding_idx = ids, acc, padding_idx
        return weight[ids]

    @staticmethod
    def backward(ctx, grad):
        ids = ctx.ids.reshape(-1)
        rows = grad.reshape(-1, grad.shape[-1]).to(ctx.acc.dtype)
        if ctx.padding_idx is not None:  # nn.Embedding leaves that row's gradient 0
            rows = rows.masked_fill((ids == ctx.padding_idx).unsqueeze(1), 0)
        ctx.acc.zeroed().index_add_(0, ids, rows)
        return None, None, None, None, None


class _LinearForward:
    """A linear layer's forward while its weight's gradient goes into a buffer; the bias
    (small) takes autograd's own path."""

    def __init__(self, module: torch.nn.Linear):
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        if not torch.is_grad_enabled():
            return torch.nn.functional.linear(x, weight, bias)
        acc = _ACTIVE[weight]
        out = _LinearInPlace.apply(x, weight.detach(), acc.anchor, acc)
        return out if bias is None else out + bias


class _LinearInPlace(torch.autograd.Function):
    """x @ weight.T, the weight's gradient added into the accumulator's buffer. It saves
    what autograd's linear saves: its input (and the weight, a parameter)."""

    @staticmethod
    def forward(ctx, x, weight, anchor, acc):
        ctx.save_for_backward(x, weight)
        ctx.acc = acc
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.acc.add_product(grad.reshape(-1, grad.shape[-1]).T, x.reshape(-1, x.shape[-1]))
        return (grad @ weight if ctx.needs_input_grad[0] else None), None, None, None
