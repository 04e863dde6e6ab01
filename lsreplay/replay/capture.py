"""The caching pass: one no-grad forward over a rollout tree.

It visits every trie position once and records what the later stages need: the K/V of
every branching node (replayed by the backward), every entry's score by each head asked
for (heads.py: the logprob under the sampling distribution for the KL term, PPO's old
logprobs and DPO; a critic's old values) and the last hidden state of every position
(drafter training). A pass that needs none of them visits only the branching nodes, and
given the nodes whose K/V are wanted (`kv_nodes`: those the backward reads) only those and
their ancestors: the replay view joins short branching nodes into their children
(view.py), whose K/V nothing reads.
It computes each node exactly as the replay backward recomputes it, so the cached K/V
are bit-identical to what the backward would produce itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from lsreplay.models.families import family
from lsreplay.replay.heads import LOGPROB, Heads
from lsreplay.replay.segments import PrefixKV, concat_kv, forward_segments, new_kv
from lsreplay.tree import Node, RolloutTree


@dataclass
class TreeActivations:
    prefix_kv: dict[int, PrefixKV] = field(default_factory=dict)  # branching nodes only
    entry_logprobs: torch.Tensor | None = None  # (num_entries,); None: not scored
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # node id -> (len, d)
    ref_entry_logprobs: torch.Tensor | None = None  # the reference model's, when a KL penalty needs them
    entry_scores: dict[str, torch.Tensor] = field(default_factory=dict)  # head name -> (num_entries,)

    def path_sequences(self, tree: RolloutTree) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tokens, hidden states) of every root-to-leaf path: the drafter's training data."""
        out = []
        for node in tree.nodes:
            if node.is_leaf:
                path = [tree.nodes[i] for i in tree.path(node.id)]
                tokens = torch.tensor([t for n in path for t in n.tokens], dtype=torch.long)
                out.append((tokens, torch.cat([self.hidden[n.id] for n in path])))
        return out


def _new_activations(tree: RolloutTree, heads: Heads) -> TreeActivations:
    def zeros():
        return torch.zeros(tree.num_entries, dtype=torch.float64)

    return TreeActivations(entry_logprobs=zeros() if LOGPROB in heads else None,
                           entry_scores={name: zeros() for name in heads if name != LOGPROB})


def _record_scores(acts: TreeActivations, heads: Heads, model, hidden: torch.Tensor, entry_ids: list[int],
                   positions: list[int], targets: list[int]) -> None:
    """Every head's scores of some entries, from one row of hidden states: the logprob's
    into entry_logprobs, the others' into entry_scores."""
    for name, head in heads.items():
        scores = acts.entry_logprobs if name == LOGPROB else acts.entry_scores[name]
        scores[entry_ids] = head(model, hidden, positions, targets).double().cpu()


@torch.no_grad()
def capture_tree(model: PreTrainedModel, tree: RolloutTree, keep_hidden: bool = True,
                 leaf_batch: int = 16, *, heads: Heads, kv_nodes: set[int] | None = None) -> TreeActivations:
    """heads: what every entry is scored by (heads.py; the logprob's scores go to
    entry_logprobs; {} scores nothing); keep_hidden: every position's last hidden state;
    kv_nodes: the branching nodes whose K/V are kept (None: all of them)."""
    family(model.config)  # replay is exact on its family, or refuses it
    acts = _new_activations(tree, heads)
    scored = keep_hidden or bool(heads)
    wanted = _with_ancestors(tree, kv_nodes) if kv_nodes is not None and not scored else None

    def record(nodes: list[Node], hidden: torch.Tensor) -> None:
        for row, n in enumerate(nodes):
            if n.entry_ids:
                _record_scores(acts, heads, model, hidden[row], n.entry_ids, n.entry_pos, n.entry_targets)
            if keep_hidden:
                acts.hidden[n.id] = hidden[row, : len(n.tokens)].cpu().clone()

    def visit(node: Node, ancestors: list[PrefixKV]) -> None:
        hidden, cache = forward_segments(model, [node.tokens], node.start, concat_kv(ancestors))
        record([node], hidden)
        if node.is_leaf:
            return
        kv = tuple([t.clone() for t in half] for half in new_kv(cache, node.start))
        del cache  # the concatenated past is no longer needed
        if kv_nodes is None or node.id in kv_nodes:
            acts.prefix_kv[node.id] = kv
        below = ancestors + [kv]
        leaves = [tree.nodes[c] for c in node.children if tree.nodes[c].is_leaf] if scored else []
        for i in range(0, len(leaves), leaf_batch):
            batch = leaves[i : i + leaf_batch]
            hidden, _ = forward_segments(model, [n.tokens for n in batch], batch[0].start, concat_kv(below))
            record(batch, hidden)
        for c in node.children:
            if not tree.nodes[c].is_leaf and (wanted is None or c in wanted):
                visit(tree.nodes[c], below)

    if wanted is None or tree.root.id in wanted:
        visit(tree.root, [])
    return acts


def _with_ancestors(tree: RolloutTree, nodes: set[int]) -> set[int]:
    """`nodes` and every node on their paths from the root."""
    return {a for n in nodes for a in tree.path(n)}


@torch.no_grad()
def capture_rollouts(model: PreTrainedModel, tree: RolloutTree, batch: int = 16, *, heads: Heads) -> TreeActivations:
    """The per-rollout baseline's scoring pass: every rollout's full sequence (prompt and
    completion) forward, `batch` rollouts at a time, right-padded; every entry scored by
    `heads` (as capture_tree). A shared entry gets the value of the last rollout that holds it."""
    acts = _new_activations(tree, heads)
    rollouts = [(j, c) for j, c in enumerate(tree.completions) if c]
    for i in range(0, len(rollouts), batch):
        chunk = rollouts[i : i + batch]
        hidden, _ = forward_segments(model, [tree.prompt_ids + c for _, c in chunk], 0, None)
        for row, (j, completion) in enumerate(chunk):
            at = list(range(tree.prompt_len - 1, tree.prompt_len - 1 + len(completion)))
            _record_scores(acts, heads, model, hidden[row], tree.entry_index[j], at, completion)
    return acts
