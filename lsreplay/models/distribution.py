"""The distribution rollouts are drawn from, and the one every logprob is scored under.

`SamplingParams` (temperature, top-k, top-p) turns the LM head's logits into what a
sampler draws from: the logits divided by the temperature, then the tokens top-k and then
top-p cut set to -inf (the order transformers and vLLM apply them in), renormalised by the
softmax. The tree sampler, speculative decoding, the vLLM engine (its processed logprobs),
the caching pass, the reference and the replay forward all score tokens through
`token_logprobs`, so behaviour, old, reference and current logprobs are of one
distribution and ratios, KL terms and the engine's mismatch compare like with like
(TRL and verl divide the logits by the temperature before every logprob for the same
reason).

A scored token outside the kept set. The sampler only draws tokens the set keeps, but a
later scoring can place one just outside it: other weights (PPO's later minibatches),
another kernel's rounding (vLLM), a reference model. The kept set is then taken with the
scored token in it, so its logprob stays finite: the renormalised probability over the
set plus that token, and it is exactly the sampler's wherever the sampler's logits are
the scorer's. Which tokens the set keeps is a constant of the gradient (it moves with
the logits only in jumps); the gradient flows through the kept tokens' logits.

Temperature 0 (greedy) has no distribution to score: rollouts to train on refuse it (the
config), and where greedy decoding records logprobs (evaluation, `lsreplay generate`)
they are the policy's own at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
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

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1


# The policy's own distribution: what a loss over "log p" means without a sampler (DPO on a
# preference dataset, greedy decoding's records). Never a default: callers name it.
RAW = SamplingParams()

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


def scaled_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits / temperature in at least float32 (float64 stays float64); temperature 0 and 1
    leave them as they are (greedy has no temperature to scale by)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if params.temperature in (0, 1) else logits / params.temperature


def cut_tokens(scaled: torch.Tensor, params: SamplingParams) -> torch.BoolTensor | None:
    """The tokens top-k and then top-p cut from tempered logits (..., V); None when neither is on."""
    if not params.truncates:
        return None
    scaled = scaled.detach()
    cut = None
    if 0 < params.top_k < scaled.shape[-1]:
        cut = scaled < scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(cut, float("-inf"))
    if params.top_p < 1:
        ranked, order = scaled.sort(dim=-1, descending=True)
        probs = ranked.softmax(dim=-1)
        # A token is cut when those ranked above it already cover top_p, so the top one always stays.
        if fixed_point(probs):
            above = fixed_point_cdf(probs) - (probs.double() * FIXED_ONE).floor().long()
            cut_ranked = above >= params.top_p * FIXED_ONE
        else:
            cut_ranked = probs.cumsum(dim=-1) - probs >= params.top_p
        by_p = torch.zeros_like(cut_ranked).scatter(-1, order, cut_ranked)
        cut = by_p if cut is None else cut | by_p
    return cut


def processed_logits(logits: torch.Tensor, params: SamplingParams,
                     keep: torch.LongTensor | None = None) -> torch.Tensor:
    """The sampling distribution's logits (..., V): tempered, the cut tokens at -inf; `keep`
    (...,): one token per row kept whatever the cut (the token being scored)."""
    scaled = scaled_logits(logits, params)
    cut = cut_tokens(scaled, params)
    if cut is None:
        return scaled
    if keep is not None:
        cut = cut.scatter(-1, keep[..., None], False)
    return scaled.masked_fill(cut, float("-inf"))


def token_logprobs(logits: torch.Tensor, tokens: torch.LongTensor, params: SamplingParams) -> torch.Tensor:
    """log p(tokens) (...,) under the distribution `params` draws from, given logits (..., V);
    differentiable in the logits. Greedy (temperature 0) scores at temperature 1. `params`
    has no default, here and in every function that scores tokens: a caller says which
    distribution it scores (RAW for the policy's own)."""
    if params.temperature == 0:
        params = RAW
    processed = processed_logits(logits, params, keep=tokens)
    return processed.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
