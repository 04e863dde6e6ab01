"""What replay differentiates at a scored position: a head.

A head maps the last hidden states of chosen positions of one row (and the tokens those
positions predict) to one scalar each: `head(model, hidden (T, d), positions, targets)`.
Every entry of a tree (a position and the token it predicts, see tree.py) is scored by
every head, and a loss over those scores reduces to dL/dscore per entry. The gradient of

    sum over heads h, entries e of weight_h[e] * head_h(hidden at e)

is what `replay_backward` accumulates, for any heads: the chain rule through the hidden
states is the same whatever maps them to the scored quantity, and replay recomputes the
hidden states exactly. The token logprob (`LOGPROB`, the LM head's, under the distribution
the rollouts were drawn from: `LogprobHead`) is one head; a critic's value head
(lsreplay.algos.critic) is another. A loss over the logprob alone takes nested logprobs;
over several heads, scores by head name (`by_head`). Every function that scores takes its
heads, and a logprob head its distribution, with no default: scoring the policy's own
(RAW) where the rollouts were drawn tempered or truncated is a bias no ratio reveals, so a
caller names the distribution (RAW included) and forgetting it is a TypeError.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from lsreplay.models.distribution import SamplingParams
from lsreplay.replay.segments import target_logprobs

Head = Callable[[PreTrainedModel, torch.Tensor, list[int], list[int]], torch.Tensor]
Heads = Mapping[str, Head]

LOGPROB = "logprob"


@dataclass(frozen=True)
class LogprobHead:
    """The head `logprob`: each target token's logprob under the distribution `sampling`
    draws from (RAW: the policy's own, temperature 1)."""

    sampling: SamplingParams

    def __call__(self, model: PreTrainedModel, hidden: torch.Tensor, positions, targets) -> torch.Tensor:
        return target_logprobs(model, hidden, positions, targets, self.sampling)


def logprob_heads(sampling: SamplingParams) -> Heads:
    """The logprob alone, under `sampling`'s distribution."""
    return {LOGPROB: LogprobHead(sampling)}


def by_head(heads: Heads) -> bool:
    """Whether a loss over `heads` takes (and its weights come as) scores by head name; a
    loss over the logprob alone takes nested logprobs."""
    return set(heads) != {LOGPROB}


def per_head(weights, heads: Heads) -> tuple[dict, Heads]:
    """(weights by head name, heads): nested per-token weights alone are the logprob's."""
    if not by_head(heads) and not isinstance(weights, Mapping):
        return {LOGPROB: weights}, heads
    if not isinstance(weights, Mapping) or set(weights) != set(heads):
        got = sorted(weights) if isinstance(weights, Mapping) else "one nested list"
        raise ValueError(f"weights must be given per head ({sorted(heads)}), got {got}")
    return dict(weights), heads
