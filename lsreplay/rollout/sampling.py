"""Next-token sampling for rollouts: temperature, top-k, top-p, greedy, and the logprob to record.

The recorded logprob is always that of the raw policy (softmax of the unmodified logits),
whatever the sampling distribution was; see `sample_next` for why.
"""

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """How to pick the next token. temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.LongTensor, torch.FloatTensor]:
    """Pick one token per row of `logits` (B, V); return the tokens (B,) and their logprobs (B,).

    The logprob is log_softmax of the raw logits (temperature 1, no truncation): the policy's
    own probability of the token. That is the quantity the trainer recomputes (old/reference
    logprobs, the replay forward), so PPO ratios and KL terms compare like with like. It is not
    the probability under the tempered/truncated distribution actually sampled from: when
    temperature != 1 or top-k/top-p cut the tail, the rollouts are mildly off-policy and these
    logprobs do not correct for that. `generator` must live on the device of `logits`.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        scaled = _truncate(logits.float() / params.temperature, params)
        tokens = draw(torch.softmax(scaled, dim=-1), generator)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


# Probabilities as integer multiples of 2**-52 (float64's resolution at 1): their running
# sums are exact in any order of addition.
FIXED_ONE = 2**52


def fixed_point(probs: torch.Tensor) -> bool:
    """Whether running sums of probabilities go in fixed point: on a GPU under torch's
    deterministic mode (pool.deterministic), where a floating-point cumsum is refused or,
    in some torch versions, replaced by a V x V masked sum (gigabytes for a vocabulary)."""
    return probs.is_cuda and torch.are_deterministic_algorithms_enabled()


def fixed_point_cdf(probs: torch.Tensor) -> torch.LongTensor:
    """Running sums over the last dim of probs in [0, 1], in units of 1 / FIXED_ONE (int64)."""
    return (probs.double() * FIXED_ONE).floor().long().cumsum(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None, exact_sums: bool | None = None) -> torch.LongTensor:
    """One draw per row of probs (R, V), by inverse CDF in float64 (`exact_sums`, default
    `fixed_point(probs)`: in fixed point, which moves each token's probability by < 2**-52).

    Exact like torch.multinomial, which on a CPU costs about 1.3 ms per row over a 49k
    vocabulary (some 25x this; 9% of a 16-row rollout stage of SmolLM2-135M).
    """
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    if exact_sums is None:
        exact_sums = fixed_point(probs)
    if exact_sums:
        cdf = fixed_point_cdf(probs)
        at = (u * cdf[:, -1:]).long()
    else:
        cdf = probs.double().cumsum(-1)
        at = u * cdf[:, -1:]
    # The first token whose cdf exceeds u * total has probability > 0; the clamp only
    # guards the rounding of u * total up to the total itself.
    return torch.searchsorted(cdf, at, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def _truncate(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Mask to -inf the tokens top-k and then top-p exclude (the order transformers uses)."""
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        ranked, order = logits.sort(dim=-1, descending=True)
        probs = ranked.softmax(dim=-1)
        # A token is cut when those ranked above it already cover top_p, so the top one always stays.
        if fixed_point(probs):
            above = fixed_point_cdf(probs) - (probs.double() * FIXED_ONE).floor().long()
            cut_ranked = above >= params.top_p * FIXED_ONE
        else:
            cut_ranked = probs.cumsum(dim=-1) - probs >= params.top_p
        cut = torch.zeros_like(cut_ranked).scatter(-1, order, cut_ranked)
        logits = logits.masked_fill(cut, float("-inf"))
    return logits
