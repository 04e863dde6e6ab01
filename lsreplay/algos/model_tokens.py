"""Episodes' environment tokens: in the tree, out of every loss term.

A multi-turn episode's completion holds the model's replies and, between them, what the
environment said (tool results, its messages, the chat template's tokens around them).
Those tokens are part of the sequence the model reads, so the trie and replay keep them,
but the model did not sample them: they carry no loss, no advantage, no KL and count in no
denominator (TRL's tool mask). `sampled[i][j]` marks completion j of tree i's tokens the
model drew (True) and the environment's (False).

Every loss here is written over the model's tokens only: `model_tokens` keeps those of a
nested score, and `on_model_tokens` wraps a loss so that it sees only them. Its gradient
with respect to an environment token's score is then exactly 0, and the token-mean,
seq-mean and Dr. GRPO aggregations, GAE and whitening count the model's tokens alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from lsreplay.algos.weights import NestedLogprobs

# sampled[i][j]: a bool tensor, one flag per token of completion j of tree i (None: all sampled).
NestedSampled = list[list[torch.Tensor]] | None


def sampled_flags(record: dict) -> list[list[bool]]:
    """A rollout record's flags: per completion, per token, whether the model sampled it
    (False: an episode's environment tokens). Single-turn records carry none: all True."""
    return record.get("sampled") or [[True] * len(c) for c in record["completions"]]


def sampled_masks(flags: list[list[list[bool]]]) -> NestedSampled:
    """Per-token flags (as the rollout records keep them) as bool tensors; None where every
    token was sampled (single-turn rollouts), so that nothing is selected at all."""
    if all(all(row) for tree in flags for row in tree):
        return None
    return [[torch.tensor(row, dtype=torch.bool) for row in tree] for tree in flags]


def model_tokens(nested: NestedLogprobs, sampled: NestedSampled) -> NestedLogprobs:
    """Each completion's scores at the tokens the model sampled (all of them without flags)."""
    if sampled is None:
        return nested
    if len(nested) != len(sampled):
        raise ValueError(f"scores cover {len(nested)} trees, the sampled flags {len(sampled)}")
    out = []
    for i, (row, flags) in enumerate(zip(nested, sampled)):
        if len(row) != len(flags) or any(x.numel() != f.numel() for x, f in zip(row, flags)):
            raise ValueError(f"tree {i}: the sampled flags do not match its completions' tokens")
        out.append([x[f.to(x.device)] for x, f in zip(row, flags)])
    return out


def model_token_scores(scores, sampled: NestedSampled):
    """Scores (nested, or by head as {name: nested}) at the model's tokens only."""
    if isinstance(scores, Mapping):
        return {name: model_tokens(nested, sampled) for name, nested in scores.items()}
    return model_tokens(scores, sampled)


def on_model_tokens(loss_fn: Callable, sampled: NestedSampled) -> Callable:
    """loss_fn over the model's tokens of its scores (nested, or by head as {name: nested})."""
    if sampled is None:
        return loss_fn
    return lambda scores: loss_fn(model_token_scores(scores, sampled))
