"""The replay's view of a tree: short branching segments joined into their children.

Every replay run costs a fixed amount on top of its positions: each run adds every
weight's gradient into its buffer once, whatever its length (for SmolLM2-135M on two CPU
cores ~0.2 s, about 35 positions' worth: bench/run_cost.py, memory.RUN_POSITIONS). A
branching node with k children costs a run of its own; joined into its children, its
positions are run k times instead, inside their runs. Joining pays when (k - 1) x its
length < replay.join_below, and saves a run per joined node and all the micro-batches its
leaves would have had alone.

Exactness does not depend on the choice: a joined node's positions compute the same
activations in every row that carries them, and its entries are scored in one row only
(the span of its first child's line), so every entry's logprob is counted once.
The root (the prompt) is never joined: that is what replay shares.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from lsreplay.tree import Node, RolloutTree


def joins(children: int, length: int, join_below: int) -> bool:
    """Whether a non-root branching node of `length` tokens and `children` children is
    joined into them."""
    return (children - 1) * length < join_below


@dataclass
class Span(Node):
    """A node of the replay view: tree nodes joined along a path (joined ancestors first,
    then the node that keeps its place). Its K/V is theirs, concatenated."""

    sources: list[int] = field(default_factory=list)


def replay_view(tree: RolloutTree, join_below: int) -> list[Span]:
    """The tree's spans in depth-first order, the root's first."""
    nodes = tree.nodes
    joined = {n.id for n in nodes[1:] if not n.is_leaf and joins(len(n.children), len(n.tokens), join_below)}
    spans: list[Span] = []

    def add(node: Node, chain: list[Node], parent: int) -> None:
        lead = [a for a in chain if _first_kept(nodes, a, joined) == node.id]
        span = Span(id=len(spans), parent=parent, start=(chain or [node])[0].start,
                    tokens=[t for a in chain for t in a.tokens] + list(node.tokens),
                    sources=[a.id for a in chain] + [node.id])
        for owner in lead + [node]:  # entries of joined nodes go to one span only
            offset = owner.start - span.start
            span.entry_ids += owner.entry_ids
            span.entry_pos += [p + offset for p in owner.entry_pos]
            span.entry_targets += owner.entry_targets
        spans.append(span)
        if parent >= 0:
            spans[parent].children.append(span.id)
        for c in node.children:
            descend(nodes[c], [], span.id)

    def descend(node: Node, chain: list[Node], parent: int) -> None:
        if node.id in joined:
            for c in node.children:
                descend(nodes[c], chain + [node], parent)
        else:
            add(node, chain, parent)

    add(nodes[0], [], -1)
    return spans


def _first_kept(nodes: list[Node], node: Node, joined: set[int]) -> int:
    """The node whose span carries joined `node`'s entries: down its first children to the
    first one not joined."""
    while node.id in joined:
        node = nodes[node.children[0]]
    return node.id


def read_kv_nodes(spans: list[Span], kept: Container[int] = frozenset()) -> set[int]:
    """The tree nodes whose cached K/V the replay of this view reads: its branching spans',
    but those it forwards before their subtree (`kept`, memory.kept_spans: their graph kept,
    or run layer by layer), which make their own."""
    return {s for span in spans if not span.is_leaf and span.id not in kept for s in span.sources}


def share_of(root: Span, lo: int, hi: int) -> Span:
    """Positions lo..hi of a span, with their entries, as a span of their own with the same
    children (one rank's share of a prompt split over ranks: distributed/context.py)."""
    mine = [(i, p - lo, t) for i, p, t in zip(root.entry_ids, root.entry_pos, root.entry_targets) if lo <= p < hi]
    return Span(id=root.id, parent=root.parent, start=root.start + lo, tokens=root.tokens[lo:hi], children=root.children,
                entry_ids=[i for i, _, _ in mine], entry_pos=[p for _, p, _ in mine],
                entry_targets=[t for _, _, t in mine], sources=root.sources)
