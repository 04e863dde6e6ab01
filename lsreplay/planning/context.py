"""The plan's model of context parallelism (replay.context_parallel, distributed/context.py).

A tree whose prompt the update splits over N ranks is planned at its largest share with the
most positions before it (an upper bound over the ranks: ceil(P / N) positions after
P - floor(P / N)), `Split`. Per rank it counts what the share holds (its layer inputs, on the
device or in host memory, its K/V and their gradient, one layer's K/V of the positions before
it and their gradient: memory.share_bytes) beside a share of the prompt's subtree, which
attends to the whole prompt through rounds of queries. And per step, for the busiest rank:

- traffic: in the forward each share's keys and values of every layer go to every later rank,
  in the backward again, with their gradient back; every run of the subtree sends its queries
  of every layer to every rank and takes back an output and log-sum-exp per share (the
  backward: the merged output, its gradient and the queries, and the queries' gradient back),
  in float32 for narrower dtypes (distributed/context.py); the rank that sends the most
  (the first share's holder in the forward, the last's in the backward) at
  pool.interconnect_gbps, not overlapped with compute;
- compute: the prompt's forward without grad (its share's matrix products over its
  positions, its attention to every position before and, causally, its own; the keys-only
  pass of each layer), its backward (the layers run again with grad: three forwards' worth),
  and the subtree's forward and backward, its attention to the prompt spread over the
  shares; the last share attends to the most keys, and the step waits for it. At
  pool.device_tflops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lsreplay.replay.memory import ModelDims, gathered_bytes, kv_bytes_per_position, layer_by_layer_bytes


@dataclass(frozen=True)
class Split:
    """A prompt of `prompt` positions split over `ranks`, planned at a share of `width`
    positions after `before` positions (the largest share, with the most before it)."""

    ranks: int
    prompt: int

    @property
    def width(self) -> int:
        return -(-self.prompt // self.ranks)

    @property
    def before(self) -> int:
        return self.prompt - self.prompt // self.ranks


def matmul_flops(dims: ModelDims) -> int:
    """A position's matrix products through one decoder layer, forward: 2 x the weights it
    multiplies (attention projections, the active MLP)."""
    h = dims.hidden
    return 2 * (2 * h * dims.q_dim + 2 * h * dims.kv_dim + 3 * h * dims.intermediate)


def attention_flops(dims: ModelDims) -> int:
    """One query position against one key position in one layer, forward: q k^T and p v."""
    return 4 * dims.heads * dims.head_dim


def projection_flops(dims: ModelDims) -> int:
    """A position's keys-only pass through one layer (its queries, keys and values)."""
    return 2 * dims.hidden * (dims.q_dim + 2 * dims.kv_dim)


@dataclass
class ContextPlan:
    """Per rank: what the share holds, (label, bytes) lines; per step for the busiest rank (its
    group's `trees` in turn): bytes sent, FLOPs of the prompts' forward (prefill) and of the
    backward (the subtrees' forward and backward, and the prompts' backward), and their seconds
    where known; and the per-rollout pipeline's FLOPs for the same trees."""

    split: Split
    trees: int  # split trees a group replays a step
    lines: list[tuple[str, int]]
    host: int  # the share's layer inputs in host memory (replay.offload_prefix), per device
    sent: int
    prefill_flops: float
    backward_flops: float
    per_rollout_flops: float
    gbps: float
    tflops: float

    def comm_seconds(self) -> float | None:
        return self.sent / (self.gbps * 1e9) if self.gbps else None

    def seconds(self, flops: float) -> float | None:
        return flops / (self.tflops * 1e12) if self.tflops else None


def context_plan(dims: ModelDims, elt: int, split: Split, offload: bool, subtree: int, runs_width: int,
                 per_rollout_positions: int, rollouts: int, trees: int, gbps: float, tflops: float) -> ContextPlan:
    """The plan of a prompt split as `split` says, with `subtree` positions below it (every
    answer's, replayed `runs_width` positions a run at most), in a model of `elt`-byte
    elements, for the `trees` such trees a group replays a step, one after the other;
    `per_rollout_positions` and `rollouts`: what the per-rollout pipeline runs of a tree (for
    its FLOPs)."""
    n, w, before, layers = split.ranks, split.width, split.before, dims.layers
    kv_layer = 2 * dims.kv_dim * elt  # a position's keys and values of one layer
    inputs = layer_by_layer_bytes(dims, elt, w, offload) - kv_bytes_per_position(dims, elt) * w
    lines = [(f"the share's layer inputs ({'two layers on the device' if offload else 'all layers'}), "
              "its hidden-state gradient, rotary tables", inputs),
             (f"the share's K/V ({w:,} positions x {layers} layers)", kv_bytes_per_position(dims, elt) * w),
             ("their gradient", kv_bytes_per_position(dims, elt) * w),
             (f"while its layers run: one layer's K/V of the {before:,} positions before it, and their gradient",
              gathered_bytes(dims, elt, before))]
    host = (layers - 1) * w * dims.hidden * elt if offload else 0
    # Traffic a layer: the first share's holder sends its K/V to n - 1 ranks (forward, backward
    # again); the last share's holder sends the gradients of n - 1 shares back.
    wire = max(4, elt)
    share_kv = w * kv_layer
    prompt_sent = layers * (2 * (n - 1) * share_kv + (n - 1) * share_kv)
    # Rounds: every rank's queries (q_dim) to every other, answers back (q_dim + heads); the
    # backward sends 3 q_dim + heads, and q_dim comes back. A rank holds 1 / n of the subtree.
    per_position = (6 * dims.q_dim + 2 * dims.heads) * wire
    rounds_sent = layers * (n - 1) * math.ceil(subtree / n) * per_position
    # Compute of the last share (the most keys before it), the rest's even share.
    own_keys = before * w + w * (w + 1) // 2
    prefill = layers * (w * (matmul_flops(dims) + projection_flops(dims)) + own_keys * attention_flops(dims))
    prompt_backward = 3 * prefill
    subtree_flops = 3 * layers * (math.ceil(subtree / n) * matmul_flops(dims)
                                  + subtree * w * attention_flops(dims)  # its queries against this share
                                  + math.ceil(subtree / n) * runs_width * attention_flops(dims) // 2)
    full = per_rollout_positions // max(rollouts, 1)  # one rollout's positions
    per_rollout = 3 * rollouts * layers * (full * matmul_flops(dims) + full * (full + 1) // 2 * attention_flops(dims))
    return ContextPlan(split, trees, lines, host, trees * (prompt_sent + rounds_sent), trees * prefill,
                       trees * (prompt_backward + subtree_flops), trees * per_rollout, gbps, tflops)
