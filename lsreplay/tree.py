"""RolloutTree: the token trie of one prompt's rollouts.

Rollouts of one prompt share the prompt and often the start of their answers. The trie
stores every token position once, compressed into segments (radix nodes): a node's tokens
are shared by every completion in its subtree, and a node ends where completions diverge
or where one of them ends. Each unique completion token is an *entry*: the pair
(position that predicts it, token). A per-rollout pipeline evaluates one logprob per
completion token; replay evaluates one per entry, and `entry_index` maps between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Node:
    """One radix segment. Positions are absolute (the prompt starts at 0)."""

    id: int
    parent: int  # -1 for the root, which always holds the prompt
    start: int
    tokens: list[int]
    children: list[int] = field(default_factory=list)
    # Entries predicted from this node's positions: entry ids, the position inside the
    # segment whose logits predict them, and the predicted token. The last position
    # predicts the first token of every child, so it may carry several entries.
    entry_ids: list[int] = field(default_factory=list)
    entry_pos: list[int] = field(default_factory=list)
    entry_targets: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children


class RolloutTree:
    """The trie of `completions` after `prompt_ids`; built by `from_sequences`."""

    def __init__(self, prompt_ids: list[int], completions: list[list[int]], nodes: list[Node],
                 entry_index: list[torch.Tensor], num_entries: int):
        self.prompt_ids = prompt_ids
        self.completions = completions
        self.nodes = nodes
        self.entry_index = entry_index  # per completion: entry id of each of its tokens
        self.num_entries = num_entries

    @classmethod
    def from_sequences(cls, prompt_ids: list[int], completions: list[list[int]]) -> RolloutTree:
        if not prompt_ids:
            raise ValueError("a rollout tree needs a non-empty prompt: the first completion token "
                             "is predicted from the prompt's last position")
        prompt_ids = [int(t) for t in prompt_ids]
        completions = [[int(t) for t in c] for c in completions]
        children, ends = _token_trie(completions)
        nodes = _compress(prompt_ids, children, ends)
        token_entry = _assign_entries(nodes, len(prompt_ids))
        entry_index = [_completion_entries(c, nodes, len(prompt_ids), token_entry) for c in completions]
        return cls(prompt_ids, completions, nodes, entry_index, len(token_entry))

    # -- counts ---------------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def total_positions(self) -> int:
        """Positions a per-rollout pipeline runs: the prompt again for every completion."""
        return sum(self.prompt_len + len(c) for c in self.completions)

    @property
    def unique_positions(self) -> int:
        """Positions replay runs: every trie position once."""
        return sum(len(n.tokens) for n in self.nodes)

    @property
    def root(self) -> Node:
        return self.nodes[0]

    @property
    def depth(self) -> int:
        """Number of branch levels below the root (0 for a single chain)."""
        def d(n: Node) -> int:
            return 0 if n.is_leaf else 1 + max(d(self.nodes[c]) for c in n.children)
        return d(self.root)

    def path(self, node_id: int) -> list[int]:
        """Node ids from the root down to `node_id`."""
        out = []
        while node_id >= 0:
            out.append(node_id)
            node_id = self.nodes[node_id].parent
        return out[::-1]

    # -- weights and logprobs -------------------------------------------------------------
    def entry_weights(self, weights: list) -> torch.Tensor:
        """Sum per-completion token weights onto entries (float64).

        Shared tokens have one logprob, so the gradient of sum_j w_j * logp is
        (sum_j w_j) * grad logp: summing weights is exact."""
        if len(weights) != len(self.completions):
            raise ValueError(f"got weights for {len(weights)} completions, the tree has {len(self.completions)}")
        out = torch.zeros(self.num_entries, dtype=torch.float64)
        for j, (w, idx) in enumerate(zip(weights, self.entry_index)):
            w = torch.as_tensor(w, dtype=torch.float64).reshape(-1)
            if w.numel() != idx.numel():
                raise ValueError(f"completion {j} has {idx.numel()} tokens but {w.numel()} weights")
            out.index_add_(0, idx, w)
        return out

    def completion_values(self, entry_values: torch.Tensor) -> list[torch.Tensor]:
        """Spread per-entry values (e.g. logprobs) back to each completion's tokens."""
        return [entry_values[idx] for idx in self.entry_index]

    # -- (de)serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "completions": self.completions}

    @classmethod
    def from_dict(cls, d: dict) -> RolloutTree:
        return cls.from_sequences(d["prompt_ids"], d["completions"])


def _token_trie(completions: list[list[int]]) -> tuple[list[dict[int, int]], list[bool]]:
    """A plain trie, one node per completion token; node 0 is the end of the prompt."""
    children: list[dict[int, int]] = [{}]
    ends = [False]
    for comp in completions:
        cur = 0
        for tok in comp:
            nxt = children[cur].get(tok)
            if nxt is None:
                nxt = children[cur][tok] = len(children)
                children.append({})
                ends.append(False)
            cur = nxt
        ends[cur] = True
    return children, ends


def _compress(prompt_ids: list[int], children: list[dict[int, int]], ends: list[bool]) -> list[Node]:
    """Radix-compress the token trie: extend a segment while the chain neither branches
    nor ends a completion. Nodes come out in depth-first order (children in first-seen order)."""
    nodes: list[Node] = []
    # (trie node to extend from, parent radix id, tokens so far, start position)
    stack = [(0, -1, list(prompt_ids), 0)]
    while stack:
        t, parent, tokens, start = stack.pop()
        while len(children[t]) == 1 and not ends[t]:
            (tok, t), = children[t].items()
            tokens.append(tok)
        node = Node(id=len(nodes), parent=parent, start=start, tokens=tokens)
        nodes.append(node)
        if parent >= 0:
            nodes[parent].children.append(node.id)
        for tok, child in reversed(list(children[t].items())):
            stack.append((child, node.id, [tok], node.end))
    return nodes


def _assign_entries(nodes: list[Node], prompt_len: int) -> dict[tuple[int, int], int]:
    """Give every completion token an entry id and record, on the node holding the
    predicting position, where it is predicted. Returns {(node id, index in node): entry}."""
    token_entry: dict[tuple[int, int], int] = {}
    for node in nodes:
        for i, tok in enumerate(node.tokens):
            pos = node.start + i
            if pos < prompt_len:
                continue
            entry = len(token_entry)
            token_entry[(node.id, i)] = entry
            # Token at `pos` is predicted by position pos-1: inside this node, or the
            # parent's last position for a node's first token.
            owner = node if i > 0 else nodes[node.parent]
            owner.entry_ids.append(entry)
            owner.entry_pos.append(pos - 1 - owner.start)
            owner.entry_targets.append(tok)
    return token_entry


def _completion_entries(comp: list[int], nodes: list[Node], prompt_len: int,
                        token_entry: dict[tuple[int, int], int]) -> torch.Tensor:
    """Walk one completion down the radix tree, collecting the entry of each token."""
    node, i, out = nodes[0], prompt_len, []
    for tok in comp:
        if i == len(node.tokens):
            node = next(nodes[c] for c in node.children if nodes[c].tokens[0] == tok)
            i = 0
        out.append(token_entry[(node.id, i)])
        i += 1
    return torch.tensor(out, dtype=torch.long)
