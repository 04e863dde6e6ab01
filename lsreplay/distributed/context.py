"""Context parallelism: a prompt too long for one device split over the ranks of a step, exact.

A tree whose prompt (the root span of its replay view) is split (`replay.context_parallel=N`,
replay.backward.splits) is replayed by the N ranks of a context-parallel group together,
through replay_backward's `context` (ContextParallel):

- Chunk ownership (`shares`): the root span in N contiguous shares as even as they go; rank r
  holds positions lo_r..hi_r: their layer inputs, keys and values, run layer by layer
  (replay/layerwise.py) as one device runs a whole prompt.
- The shares' forward and backward run a layer at a time on every rank together (ChunkPeers,
  layerwise.SpanPeers): a share's keys and values of the layer go to every later rank, which
  attends to them in place, one prefix part per earlier share; in the backward they are sent
  again, and the gradient they collect goes back to their holder, which adds the later ranks'
  in rank order and backpropagates it through the layer's keys and values. All-gathered per
  layer, not passed around a ring: with grouped-query attention a layer's keys and values are
  a fraction of its hidden states (Qwen2.5-7B: 2 x 4 heads x 128 = 1,024 values a position
  where the hidden state has 3,584), so the K/V before a share, of one layer, is small next to
  what the share holds of every layer (at 1M positions over 8 ranks the last rank receives
  1.75 GiB of bf16 K/V for a layer, beside its share's 7 GiB of K/V and 7 GiB of their
  gradient); then each chunk's attention to them is one cascade of parts, the kernels and the
  merge as one device has them, and each part's gradient has its own leaf to go back from.
  A ring would hold two shares at a time instead, and overlap the transfer with compute;
  the traffic is the same (every share reaches every later rank once a layer).
- The subtree (`ContextParallel.children`): the root's children (leaves, and branching children
  with their subtrees) spread over the ranks, balanced by the positions they run; each rank
  replays its own as one device does, its queries attending to the prompt through a prefix
  part held elsewhere (SharedPrompt, cascade.HeldElsewhere): at every layer of a run the
  queries of every rank's run go to every rank, each attends them to its share and sends back
  output and log-sum-exp, which cascade attention merges with the run's other parts; in the
  backward the merged output, log-sum-exp and output gradient go out, the queries' gradient
  comes back, and each share's dK/dV stays with its holder. Queries, not keys and values: a
  leaf's queries of a layer are its width x hidden, the prompt's keys and values of a layer
  its length x 2 x kv_dim (1,536 x 3,584 against 1,000,000 x 1,024 for Qwen2.5-7B). No rank
  ever holds the whole prompt's K/V. Every exchange is a round that every rank of the group
  joins, with a header saying what it asks; a rank done with its own runs keeps serving
  (SharedPrompt.finish) until all are.
- The data-parallel reduction of the step then sums every rank's gradient once
  (distributed/parallel.py); the shares' gradients are parts of the same sum.

Every rank of a group checks first that all hold the same trees (ContextParallel.agree): a
prompt of another length or other tokens stops every rank at once, naming both. A rank that
dies leaves the others waiting in a collective: the launcher (parallel.launch) ends them and
the stage fails as any stage failure does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lsreplay.replay.attention.kernels import kernel_for
from lsreplay.replay.view import Span
from lsreplay.tree import RolloutTree


def shares(length: int, ranks: int) -> list[tuple[int, int]]:
    """Positions lo..hi of each rank's share of a span of `length` positions: contiguous, the
    first length % ranks shares one longer."""
    base, extra = divmod(length, ranks)
    out, lo = [], 0
    for r in range(ranks):
        hi = lo + base + (r < extra)
        out.append((lo, hi))
        lo = hi
    return out


@dataclass
class Traffic:
    """Bytes this rank sent to the others of its group (K/V, queries, their results and
    gradients, round headers) and the exchanges it joined."""

    sent: int = 0
    exchanges: int = 0


def _exchange(sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]], traffic: Traffic,
              group=None) -> None:
    """Point-to-point: each (global rank, tensor) of `sends` to that rank, each of `receives`
    filled from it; returns when all are done."""
    ops = ([dist.P2POp(dist.isend, t.contiguous(), peer, group) for peer, t in sends]
           + [dist.P2POp(dist.irecv, t, peer, group) for peer, t in receives])
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    traffic.sent += sum(t.numel() * t.element_size() for _, t in sends)
    traffic.exchanges += 1


class ChunkPeers:
    """layerwise.SpanPeers over a context-parallel group: `members` (global ranks, in share
    order), this rank at `index`, the shares' `bounds`."""

    def __init__(self, members: list[int], index: int, bounds: list[tuple[int, int]], traffic: Traffic):
        self.members, self.index, self.bounds, self.traffic = members, index, bounds, traffic
        self.keys_like: torch.Tensor | None = None  # this share's keys of the layer being exchanged
        self.value_shape: torch.Size | None = None

    def _shapes(self, rank: int) -> tuple[torch.Size, torch.Size]:
        """The shapes of share `rank`'s keys and values of a layer."""
        width = self.bounds[rank][1] - self.bounds[rank][0]
        keys = self.keys_like.shape
        return (torch.Size((*keys[:-2], width, keys[-1])),
                torch.Size((*self.value_shape[:-2], width, self.value_shape[-1])))

    def _buffer(self, rank: int) -> torch.Tensor:
        """Room for share `rank`'s keys and values of a layer, flat."""
        key_shape, value_shape = self._shapes(rank)
        return self.keys_like.new_empty(key_shape.numel() + value_shape.numel())

    def _split(self, flat: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        key_shape, value_shape = self._shapes(rank)
        return flat[:key_shape.numel()].view(key_shape), flat[key_shape.numel():].view(value_shape)

    def before(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
               grad: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.keys_like, self.value_shape = keys, values.shape
        received = [self._buffer(rank) for rank in range(self.index)]
        mine = torch.cat([keys.reshape(-1), values.reshape(-1)])
        _exchange([(self.members[r], mine) for r in range(self.index + 1, len(self.members))],
                  [(self.members[r], buffer) for r, buffer in enumerate(received)], self.traffic)
        out = [self._split(buffer, rank) for rank, buffer in enumerate(received)]
        return [(k.requires_grad_(), v.requires_grad_()) for k, v in out] if grad else out

    def sent_back(self, layer: int,
                  before: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        sends = [(self.members[rank], torch.cat([_grad_or_zeros(k).reshape(-1), _grad_or_zeros(v).reshape(-1)]))
                 for rank, (k, v) in enumerate(before)]
        later = [(self.members[r], self._buffer(self.index)) for r in range(self.index + 1, len(self.members))]
        _exchange(sends, later, self.traffic)
        if not later:
            return None
        total = later[0][1]
        for _, grad in later[1:]:  # in rank order: the same sum on every run
            total += grad
        return self._split(total, self.index)


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


# What a round of SharedPrompt asks of the other ranks.
_IDLE, _FORWARD, _BACKWARD = 0, 1, 2


class _Ask:
    """A round's header, read: what a rank asks, of which layer, for queries of which shape."""

    def __init__(self, header: torch.Tensor):
        kind, layer, kv_heads, queries, head_dim, scale = header.tolist()
        self.kind, self.layer, self.scale = int(kind), int(layer), scale
        self.shape = torch.Size((1, int(kv_heads), int(queries), int(head_dim)))
        n, rows = self.shape.numel(), self.shape[:-1].numel()
        # forward: the queries; backward: the output's gradient, queries, output, log-sum-exp.
        self.request_numel = n if self.kind == _FORWARD else 3 * n + rows
        # forward: the output and log-sum-exp; backward: the queries' gradient.
        self.answer_numel = n + rows if self.kind == _FORWARD else n


class SharedPrompt:
    """The prompt's keys and values, each rank of a context-parallel group holding its share,
    as a prefix part of the runs below it (cascade.HeldElsewhere). `keys`, `values`: this
    rank's share, per layer (leaf tensors: their .grad take the dK/dV the runs send them);
    `members`: the group's global ranks, this one at `index`; `positions`: the prompt's."""

    def __init__(self, members: list[int], index: int, positions: int, keys: list[torch.Tensor],
                 values: list[torch.Tensor], traffic: Traffic, group=None):
        self.members, self.index, self.positions, self.traffic, self.group = members, index, positions, traffic, group
        self.keys, self.values = keys, values
        self.dtype = keys[0].dtype
        # What travels: the queries' dtype, widened to float32 where it is narrower (bf16 to
        # float32 and back is exact), so that the log-sum-exps (float32; float64 in a float64
        # model) travel with them.
        self.wire = torch.promote_types(self.dtype, torch.float32)

    # -- the requests (cascade.HeldElsewhere) -----------------------------------------------
    def attend(self, layer: int, query: torch.Tensor, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = query.shape
        answers = self._round(_FORWARD, layer, [query], shape, scale)
        return [(a[:shape.numel()].view(shape).to(self.dtype), a[shape.numel():].view(shape[:-1])) for a in answers]

    def attend_backward(self, layer: int, grad_out: torch.Tensor, query: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: float) -> torch.Tensor:
        answers = self._round(_BACKWARD, layer, [grad_out, query, out, lse], query.shape, scale)
        total = answers[0]
        for part in answers[1:]:  # in rank order
            total = total + part
        return total.view(query.shape).to(query.dtype)

    def finish(self) -> None:
        """Serve the others' rounds until every rank of the group is done with its own."""
        while self._round(_IDLE, 0, [], torch.Size((1, 0, 0, 0)), 0.0) is not None:
            pass

    # -- one round ------------------------------------------------------------------------
    def _round(self, kind: int, layer: int, tensors: list[torch.Tensor], shape: torch.Size,
               scale: float) -> list[torch.Tensor] | None:
        """Every rank says what it asks (a header), sends its request to the others, serves
        every rank's against its share, and gets its answers back, one per share in rank
        order ([] if it asked nothing). None where no rank asks anything: all are done."""
        device = self.keys[0].device
        header = torch.tensor([kind, layer, *shape[1:], scale], dtype=torch.float64, device=device)
        headers = [torch.empty_like(header) for _ in self.members]
        dist.all_gather(headers, header, group=self.group)
        self.traffic.sent += header.numel() * header.element_size() * (len(self.members) - 1)
        asks = {rank: _Ask(h) for rank, h in enumerate(headers) if int(h[0]) != _IDLE}
        if not asks:
            return None
        requests = {rank: torch.empty(ask.request_numel, dtype=self.wire, device=device)
                    for rank, ask in asks.items() if rank != self.index}
        if kind != _IDLE:
            requests[self.index] = torch.cat([t.to(self.wire).reshape(-1) for t in tensors])
            sends = [(self.members[r], requests[self.index]) for r in range(len(self.members)) if r != self.index]
        else:
            sends = []
        _exchange(sends, [(self.members[r], t) for r, t in requests.items() if r != self.index], self.traffic)
        answers = {rank: self._serve(ask, requests[rank]) for rank, ask in sorted(asks.items())}
        mine = []
        if kind != _IDLE:
            mine = [answers[self.index] if r == self.index else
                    torch.empty(asks[self.index].answer_numel, dtype=self.wire, device=device)
                    for r in range(len(self.members))]
        _exchange([(self.members[r], answer) for r, answer in answers.items() if r != self.index],
                  [(self.members[r], t) for r, t in enumerate(mine) if r != self.index], self.traffic)
        return mine

    def _serve(self, ask: _Ask, request: torch.Tensor) -> torch.Tensor:
        """One rank's request against this share of layer `ask.layer`: forward, the output and
        log-sum-exp; backward, the queries' gradient (the keys' and values' stay here)."""
        keys, values = self.keys[ask.layer].detach(), self.values[ask.layer].detach()
        kernel = kernel_for(keys.device.type, self.dtype, ask.shape[-1])
        n = ask.shape.numel()
        if ask.kind == _FORWARD:
            out, lse = kernel.forward(request.view(ask.shape).to(self.dtype), keys, values, False, ask.scale)
            return torch.cat([out.to(self.wire).reshape(-1), lse.to(self.wire).reshape(-1)])
        grad_out, query, out = (request[i * n:(i + 1) * n].view(ask.shape).to(self.dtype) for i in range(3))
        lse = request[3 * n:].view(ask.shape[:-1])
        grad_query, grad_keys, grad_values = kernel.backward(grad_out, query, keys, values, out, lse, False,
                                                             ask.scale)
        with torch.no_grad():
            for leaf, grad in ((self.keys[ask.layer], grad_keys), (self.values[ask.layer], grad_values)):
                if leaf.grad is None:
                    leaf.grad = grad.to(leaf.dtype).clone()
                else:
                    leaf.grad += grad
        return grad_query.to(self.wire).reshape(-1)


# -- the group ----------------------------------------------------------------------------
def _fingerprint(tree: RolloutTree) -> tuple[int, int]:
    """(prompt length, 63 bits of the sha256 of the tree's prompt and completions)."""
    digest = hashlib.sha256(repr((tree.prompt_ids, tree.completions)).encode()).digest()
    return tree.prompt_len, int.from_bytes(digest[:8], "big") >> 1


@dataclass
class ContextParallel:
    """A context-parallel group of the step's process group, as replay_backward takes it:
    `members` (global ranks, in the order of their shares), this rank among them at `index`;
    a prompt (root span) of at least `threshold` positions is split over them (0: where one
    device would need more than the replay budget, replay.backward.splits)."""

    members: list[int]
    index: int
    threshold: int = 0
    group: object = None  # the members' process group (None: the default one, all of them)
    traffic: Traffic = field(default_factory=Traffic)
    number: int = 0  # this group among the step's `groups`
    groups: int = 1

    @property
    def ranks(self) -> int:
        return len(self.members)

    def share(self, length: int) -> tuple[int, int]:
        """This rank's positions of a split span of `length`."""
        return shares(length, self.ranks)[self.index]

    def before(self, length: int) -> int:
        """The positions of a split span of `length` before this rank's share."""
        return self.share(length)[0]

    def peers(self, length: int) -> ChunkPeers:
        return ChunkPeers(self.members, self.index, shares(length, self.ranks), self.traffic)

    @contextmanager
    def serving(self, positions: int, kv) -> Iterator[SharedPrompt]:
        """This rank's share `kv` of a prompt of `positions` as a prefix part of the runs in
        the block; after them, serving the others' until every rank is done."""
        prompt = SharedPrompt(self.members, self.index, positions, kv[0], kv[1], self.traffic, self.group)
        yield prompt
        prompt.finish()

    def children(self, spans: Sequence[Span], children: list[Span]) -> list[Span]:
        """This rank's share of a split root's `children`: whole subtrees, each to the rank
        that runs the fewest positions so far, largest first (ties: the lower rank)."""
        def positions(span: Span) -> int:
            return len(span.tokens) + sum(positions(spans[c]) for c in span.children)

        loads, mine = [0] * self.ranks, []
        for child in sorted(children, key=lambda c: (-positions(c), c.id)):
            rank = min(range(self.ranks), key=lambda r: (loads[r], r))
            loads[rank] += positions(child)
            if rank == self.index:
                mine.append(child)
        return sorted(mine, key=lambda c: c.id)

    def agree(self, trees: Sequence[RolloutTree]) -> None:
        """Every rank of the group holds the same `trees` (those it splits), or every rank
        raises at once, naming two that differ."""
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in self.members]
        dist.all_gather(counts, torch.tensor([len(trees)], device=device), group=self.group)
        counts = [int(c) for c in counts]
        if len(set(counts)) > 1:
            other = next(r for r, c in enumerate(counts) if c != counts[0])
            raise ValueError(f"ranks {self.members[0]} and {self.members[other]} of a context-parallel group split "
                             f"{counts[0]} and {counts[other]} trees (replay.context_parallel): every rank must read "
                             "the same step's trees with the same tokenizer")
        mine = torch.tensor([_fingerprint(t) for t in trees], dtype=torch.long, device=device).reshape(-1, 2)
        every = [torch.empty_like(mine) for _ in self.members]
        dist.all_gather(every, mine, group=self.group)
        for rank, theirs in enumerate(every[1:], start=1):
            differ = (theirs != every[0]).any(-1).nonzero()
            if len(differ):
                tree = int(differ[0])
                (length, digest), (their_length, their_digest) = every[0][tree].tolist(), theirs[tree].tolist()
                raise ValueError(
                    f"ranks {self.members[0]} and {self.members[rank]} of a context-parallel group disagree on the "
                    f"trees they split (replay.context_parallel): rank {self.members[0]}'s tree {tree} has a prompt "
                    f"of {length} tokens (sha {digest:016x}), rank {self.members[rank]}'s one of {their_length} "
                    f"tokens (sha {their_digest:016x}); every rank must read the same step's trees with the same "
                    "tokenizer")


def context_group(rank: int, world: int, ranks: int, threshold: int = 0) -> ContextParallel | None:
    """This rank's context-parallel group where the step's `world` ranks form groups of `ranks`
    consecutive ones (replay.context_parallel; a collective where there are several: every
    rank makes every group); None for `ranks` 1."""
    if ranks <= 1:
        return None
    if world % ranks:
        raise ValueError(f"replay.context_parallel={ranks} does not divide the step's {world} ranks")
    members = [list(range(first, first + ranks)) for first in range(0, world, ranks)]
    handles = [dist.new_group(m) for m in members] if len(members) > 1 else [None]
    number = rank // ranks
    return ContextParallel(members[number], rank % ranks, threshold, handles[number], number=number,
                           groups=len(members))
