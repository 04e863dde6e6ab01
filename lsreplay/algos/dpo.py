"""DPO over pairs of completions of one prompt (leaves of one tree, sharing a prefix).

    L = mean over pairs (c, r) of -log sigmoid(beta * ((lp_c - ref_c) - (lp_r - ref_r)))

with lp = the sequence logprob (sum of token logprobs) of a completion under the policy and
ref the same under the frozen reference. dL/dlogp per token is the same for every token of
a completion (+-beta * sigmoid(-margin) / pairs), and on a prefix shared by the chosen and
the rejected completion the two weights cancel on the tree's shared entries: the shared
prefix of a pair gets no gradient from it, as it should.

Given `counts`, a leaf that stands for n samples (see grpo: it ended before a branch
point) makes a pair stand for n_c * n_r pairs of samples, and the mean weighs it so; the
online pairs below pass none.

The policy's sequence logprobs come from the caching pass (no grad), `loss_and_weights`
gives the per-token weights, and the replay backward injects them.

Online, the pairs of a tree are its best leaf against its worst (`best_worst_pairs`): one
pair per tree, as Self-Rewarding LMs and online DPO recipes pick them, so every tree weighs
the same whatever its leaf count, and the leaves between the two carry no weight (replay
skips them). Every pair with a margin would weigh a tree by its spread of rewards and cost
quadratically many pairs. Each leaf of a pair stands for itself: the copies a count says
a leaf stands for would be the same completion, and a best-against-worst pick of a flat
group of them picks one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from lsreplay.algos.backward import capture_logprobs
from lsreplay.algos.grpo import NestedCounts, sample_counts
from lsreplay.algos.weights import NestedLogprobs
from lsreplay.models.distribution import SamplingParams
from lsreplay.replay.heads import logprob_heads
from lsreplay.tree import RolloutTree

# per tree: (chosen completion index, rejected completion index) pairs
Pairs = list[list[tuple[int, int]]]


def best_worst_pairs(rewards: list[list[float | None]]) -> Pairs:
    """Per tree: [(the first leaf of the highest reward, the first of the lowest)], or [] when
    every leaf scored alike (no preference to learn). Unscorable leaves (None) take no part."""
    pairs = []
    for r in rewards:
        scored = [j for j in range(len(r)) if r[j] is not None]
        if not scored:
            pairs.append([])
            continue
        best, worst = max(scored, key=lambda j: (r[j], -j)), min(scored, key=lambda j: (r[j], j))
        pairs.append([(best, worst)] if r[best] != r[worst] else [])
    return pairs


def sequence_logprobs(logprobs: NestedLogprobs) -> list[torch.Tensor]:
    """Per tree: the sum of each completion's token logprobs (0 for an empty one)."""
    return [torch.stack([lp.sum() for lp in tree]) if tree else torch.zeros(0, dtype=torch.float64)
            for tree in logprobs]


def reference_sequence_logprobs(reference: PreTrainedModel, trees: list[RolloutTree],
                                sampling: SamplingParams) -> list[torch.Tensor]:
    """Sequence logprobs of every completion under the frozen reference (no-grad caching
    pass), under `sampling`'s distribution: the rollouts' for online DPO, RAW (the policy's
    own) for a preference dataset's answers, which nothing here sampled."""
    logprobs, _ = capture_logprobs(reference, trees, keep_kv=False, heads=logprob_heads(sampling))
    return [s.detach() for s in sequence_logprobs(logprobs)]


def dpo_loss(logprobs: NestedLogprobs, pairs: Pairs, ref_seq_logprobs: list[torch.Tensor],
             beta: float = 0.1, counts: NestedCounts = None) -> torch.Tensor:
    """-log sigmoid(beta * policy-minus-reference margin), averaged over all pairs of all
    trees, each pair weighted by the pairs of samples it stands for (counts: see grpo)."""
    if not (len(logprobs) == len(pairs) == len(ref_seq_logprobs)):
        raise ValueError(f"logprobs, pairs and reference cover {len(logprobs)}, {len(pairs)} and "
                         f"{len(ref_seq_logprobs)} trees")
    counts = [None] * len(logprobs) if counts is None else counts
    if len(counts) != len(logprobs):
        raise ValueError(f"counts cover {len(counts)} trees, logprobs {len(logprobs)}")
    margins, pair_weights = [], []
    for i, (lps, tree_pairs, ref, ns) in enumerate(zip(logprobs, pairs, ref_seq_logprobs, counts)):
        n = sample_counts(ns, len(lps))
        if len(ref) != len(lps):
            raise ValueError(f"tree {i}: {len(lps)} completions but {len(ref)} reference sequence logprobs")
        for c, r in tree_pairs:
            if not (0 <= c < len(lps) and 0 <= r < len(lps)) or c == r:
                raise ValueError(f"tree {i}: pair ({c}, {r}) must name two completions of the {len(lps)}")
            lp_c, lp_r = lps[c].sum(), lps[r].sum()
            margins.append((lp_c - ref[c].to(lp_c)) - (lp_r - ref[r].to(lp_r)))
            pair_weights.append(n[c] * n[r])
    if not margins:
        return torch.zeros((), dtype=torch.float64)
    w = torch.stack(pair_weights)
    return -(F.logsigmoid(beta * torch.stack(margins)) * w.to(margins[0])).sum() / w.sum()
