"""KL penalty to a frozen reference model, per token, composed onto a policy loss.

With d = ref_logp - logp at each sampled token (Schulman's estimators of KL(pi || ref)):

- k1 = -d                   unbiased, can be negative
- k2 = d^2 / 2              biased, low variance
- k3 = exp(d) - d - 1       unbiased, >= 0 (GRPO's choice)

The reference logprobs come from a no-grad caching pass of the reference model over the
same trees (`reference_logprobs`), under the distribution the completions were drawn from
(tempered, truncated), as the policy's; they are constants of the loss. The penalty is
aggregated like the policy loss and added with a coefficient (`with_kl`), so the composed
loss is again one function of the nested logprobs: replay and the per-rollout reference
differentiate it the same way.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from lsreplay.algos.backward import LossFn, capture_logprobs
from lsreplay.algos.grpo import NestedCounts, NestedMask, aggregate, flat_counts, kept
from lsreplay.algos.weights import NestedLogprobs
from lsreplay.core.config import KL_ESTIMATORS
from lsreplay.models.distribution import SamplingParams
from lsreplay.replay.heads import logprob_heads
from lsreplay.tree import RolloutTree


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) at the sampled tokens."""
    d = ref_logprobs.to(logprobs) - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def kl_loss(logprobs: NestedLogprobs, ref_logprobs: NestedLogprobs, estimator: str = "k3",
            loss_agg: str = "token-mean", max_tokens: int | None = None,
            counts: NestedCounts = None, mask: NestedMask = None) -> torch.Tensor:
    """The per-token KL estimate of every completion, aggregated over the batch (a leaf
    counted as many times as the samples it stands for, see grpo.aggregate; those `mask`
    leaves out not at all, as in the policy loss)."""
    if len(logprobs) != len(ref_logprobs):
        raise ValueError(f"{len(logprobs)} trees of logprobs but {len(ref_logprobs)} of reference logprobs")
    per_token = []
    for i, (lps, refs) in enumerate(zip(logprobs, ref_logprobs)):
        if len(lps) != len(refs):
            raise ValueError(f"tree {i}: {len(lps)} completions but {len(refs)} reference logprobs")
        per_token.extend(kl_per_token(lp, ref, estimator) for lp, ref in zip(lps, refs))
    losses, flat = kept(per_token, flat_counts(counts, logprobs), mask)
    return aggregate(losses, loss_agg, max_tokens, flat)


def with_kl(loss_fn: LossFn, ref_logprobs: NestedLogprobs, kl_coef: float, estimator: str = "k3",
            loss_agg: str = "token-mean", max_tokens: int | None = None, counts: NestedCounts = None,
            mask: NestedMask = None) -> LossFn:
    """total(logprobs) = loss_fn(logprobs) + kl_coef * kl_loss(logprobs, ref_logprobs)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if not kl_coef:
        return loss_fn

    def total(logprobs: NestedLogprobs) -> torch.Tensor:
        return loss_fn(logprobs) + kl_coef * kl_loss(logprobs, ref_logprobs, estimator, loss_agg, max_tokens, counts,
                                                     mask)

    return total


def reference_logprobs(reference: PreTrainedModel, trees: list[RolloutTree],
                       sampling: SamplingParams) -> NestedLogprobs:
    """Per-token logprobs of the frozen reference model under `sampling`'s distribution (the
    one the completions were drawn from, as the policy's are scored): a no-grad caching pass
    per tree."""
    logprobs, _ = capture_logprobs(reference, trees, keep_kv=False, heads=logprob_heads(sampling))
    return logprobs
