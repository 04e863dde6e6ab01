"""The distribution rollouts are drawn from, and scored under (lsreplay.models.distribution)."""

import torch

from lsreplay.models.distribution import SamplingParams, processed_logits, token_logprobs

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)


def test_a_token_in_the_kept_set_scores_its_renormalised_tempered_probability():
    logits = PROBS.log()[None]
    params = SamplingParams(temperature=0.5, top_k=3)
    tempered = PROBS[:3] ** 2 / (PROBS[:3] ** 2).sum()
    for token in range(3):
        lp = token_logprobs(logits, torch.tensor([token]), params)
        torch.testing.assert_close(lp, tempered[token].log()[None])


def test_a_token_outside_the_kept_set_stays_finite_with_the_set_plus_it():
    """The nucleus of 0.7 keeps {0, 1}; token 3 scored anyway gets p(3) / (p(0) + p(1) + p(3))."""
    logits = PROBS.log()[None]
    lp = token_logprobs(logits, torch.tensor([3]), SamplingParams(top_p=0.7))
    torch.testing.assert_close(lp, (PROBS[3] / (PROBS[0] + PROBS[1] + PROBS[3])).log()[None])
    assert torch.isinf(processed_logits(logits, SamplingParams(top_p=0.7))[0, 3])


def test_the_gradient_reaches_the_kept_tokens_logits_only():
    logits = PROBS.log()[None].clone().requires_grad_()
    params = SamplingParams(temperature=0.8, top_p=0.7)
    token_logprobs(logits, torch.tensor([1]), params).sum().backward()
    kept = (PROBS[:2] ** 1.25 / (PROBS[:2] ** 1.25).sum())
    expected = torch.zeros(4, dtype=torch.float64)
    expected[:2] = (torch.tensor([0.0, 1.0], dtype=torch.float64) - kept) / 0.8
    torch.testing.assert_close(logits.grad[0], expected)


def test_greedy_scores_the_policy_itself():
    logits = PROBS.log()[None]
    lp = token_logprobs(logits, torch.tensor([2]), SamplingParams(temperature=0.0, top_k=2))
    torch.testing.assert_close(lp, PROBS[2].log()[None])
