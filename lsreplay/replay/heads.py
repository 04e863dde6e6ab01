"""What replay differentiates at a scored position: a head.

A head maps the last hidden states of chosen positions of one row (and the tokens those
positions predict) to one scalar each: `head(model, hidden (T, d), positions, targets)`.
Every entry of a tree (a position and the token it predicts, see tree.py) is scored by
every head, and a loss over those scores reduces to dL/dscore per entry. The gradient of

    sum over heads h, entries e of weight_h[e] * head_h(hidden at e)

is what `replay_backward` accumulates, for any heads: the chain rule through the hidden
states is the same whatever maps them to the scored quantity, and replay recomputes the
hidden states exactly. The token logprob (`LOGPROB`, the LM head's) is one head; a
critic's value head (lsreplay.algos.critic) is another.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from transformers import PreTrainedModel

from lsreplay.replay.segments import target_logprobs

Head = Callable[[PreTrainedModel, torch.Tensor, list[int], list[int]], torch.Tensor]
Heads = Mapping[str, Head]

LOGPROB = "logprob"
LOGPROB_HEADS: Heads = {LOGPROB: target_logprobs}


def per_head(weights, heads: Heads | None) -> tuple[dict, Heads]:
    """(weights by head name, heads): nested per-token weights alone are the logprob's."""
    if heads is None:
        return {LOGPROB: weights}, LOGPROB_HEADS
    if not isinstance(weights, Mapping) or set(weights) != set(heads):
        got = sorted(weights) if isinstance(weights, Mapping) else "one nested list"
        raise ValueError(f"weights must be given per head ({sorted(heads)}), got {got}")
    return dict(weights), heads
