"""Tree leaves, weighted by the samples they stand for, estimate what flat rollouts estimate.

A tiny float64 Llama over 3 tokens (EOS and two others) has an exactly enumerable
distribution over completions of up to 3 tokens: 15 of them, 21 (prefix, token) entries.
Its rollout trees are [2, 2, 2] with a branch point after every token, so about half of
the first-level answers end before a branch point (count 4 or 2, of G = 8). The real
sampler draws TREES trees; the real loss code turns each into per-token weights. Every
estimate is then a combination of the 21 entries' logprob gradients, so its mean over the
trees can be compared with the exact expectation, projected on fixed directions, within
Z standard errors that the test computes from the trees' own spread.
"""

import itertools
import math

import pytest
import torch
from conftest import tiny_model

from lsreplay.algos.grpo import GRPOBatch, group_advantages, grpo_loss
from lsreplay.algos.weights import loss_and_weights
from lsreplay.models.distribution import SamplingParams
from lsreplay.rollout.tree_sampler import sample_trees
from lsreplay.stages.common import leaf_subtrees
from lsreplay.stages.trees import group_stats

EOS, PROMPT = 0, [1, 2]
BRANCHING, SEGMENTS, MAX_NEW = [2, 2, 2], [1, 1], 3
G = math.prod(BRANCHING)
SHARED_BY = [4, 2, 1]  # virtual leaves sharing the token at completion position 0, 1, 2
TREES = 2000
# |z| <= 4.5: two-sided p = 6.8e-6 per comparison, under 1e-4 over the test's 13 comparisons.
Z = 4.5


def reward(y: list[int]) -> float:
    """Right when the answer ends within two tokens (as short answers were on the default
    task), half credit for a 3-token answer that ends and starts with token 1."""
    if y[-1] == EOS and len(y) <= 2:
        return 1.0
    return 0.5 if y[-1] == EOS and y[0] == 1 else 0.0


@pytest.fixture(scope="module")
def setup():
    # initializer_range 0.2: P(EOS first) = 0.32, P(length 2) = 0.20, the rest run to the last level.
    model = tiny_model("llama", vocab=3, dtype=torch.float64, hidden_size=8, intermediate_size=16,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2)
    entries = [k for n in range(MAX_NEW) for k in itertools.product(*[(1, 2)] * n, (0, 1, 2))]
    index = {k: e for e, k in enumerate(entries)}
    logp, grads = [], []
    for k in entries:  # log p(token | prompt + prefix) and its parameter gradient, per entry
        model.zero_grad()
        logits = model(input_ids=torch.tensor([PROMPT + list(k)])).logits[0, -2]
        lp = torch.log_softmax(logits.double(), -1)[k[-1]]
        lp.backward()
        logp.append(lp.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    completions = [list(k) for k in entries if k[-1] == EOS or len(k) == MAX_NEW]
    assert len(completions) == 15
    prob = {tuple(y): math.exp(sum(logp[index[tuple(y[:t + 1])]] for t in range(len(y)))) for y in completions}
    assert sum(prob.values()) == pytest.approx(1, abs=1e-9)
    trees, _ = sample_trees(model, [PROMPT] * TREES, BRANCHING, SEGMENTS, MAX_NEW, SamplingParams(), EOS,
                            [torch.Generator().manual_seed(i) for i in range(TREES)])
    records = [{"completions": t.completions, "rewards": [reward(y) for y in t.completions], "counts": t.counts,
                "paths": t.paths, "logprobs": t.logprobs} for t in trees]
    # (tree, entry) of every sampled token, in the order of the records' completions
    trees_of, entries_of = zip(*[(i, index[tuple(y[:t + 1])]) for i, r in enumerate(records)
                                 for y in r["completions"] for t in range(len(y))])
    return dict(index=index, grads=torch.stack(grads), prob=prob, records=records,
                token_entries=(torch.tensor(trees_of), torch.tensor(entries_of)))


def exact_entry_weights(s, shrink) -> torch.Tensor:
    """sum over completions y of p(y) r(y) shrink(position) on each of y's entries."""
    out = torch.zeros(len(s["index"]), dtype=torch.float64)
    for y, p in s["prob"].items():
        for t in range(len(y)):
            out[s["index"][y[:t + 1]]] += p * reward(list(y)) * shrink(t)
    return out


def per_tree_entry_weights(s, advantages, counts) -> torch.Tensor:
    """Each tree's Dr. GRPO loss gradient as weights on the 21 entries: the whole batch's
    loss through the real loss code (ratio 1), TREES times each tree's share of it."""
    records = s["records"]
    logprobs = [[torch.tensor(lp, dtype=torch.float64) for lp in r["logprobs"]] for r in records]
    batch = GRPOBatch(advantages=advantages, old_logprobs=logprobs, loss_agg="seq-mean-token-sum-norm",
                      max_tokens=MAX_NEW, counts=counts)
    _, weights = loss_and_weights(lambda lp: grpo_loss(lp, batch), logprobs)
    out = torch.zeros(len(records), len(s["index"]), dtype=torch.float64)
    out.index_put_(s["token_entries"], TREES * torch.cat([w for tree in weights for w in tree]), accumulate=True)
    return out


def z_scores(per_tree: torch.Tensor, exact: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """(mean - exact) / standard error of the mean, per direction (rows of `directions`)."""
    x, e = per_tree @ directions.T, exact @ directions.T
    return (x.mean(0) - e) / (x.std(0) / math.sqrt(len(x)))


def gradient_directions(s, exact_gradient: torch.Tensor) -> torch.Tensor:
    """The exact gradient's direction and 3 fixed random ones in parameter space, as
    entry-space functionals: u . (sum_e W_e grad_e) = W . (grads @ u)."""
    g = torch.Generator().manual_seed(0)
    u = torch.cat([exact_gradient[None] / exact_gradient.norm(),
                   torch.randn(3, s["grads"].shape[1], generator=g, dtype=torch.float64)])
    return (s["grads"] @ u.T).T


def test_weighted_mean_reward_is_unbiased_and_unweighted_is_not(setup):
    records = setup["records"]
    assert all(sum(r["counts"]) == G for r in records)
    assert sum(len(r["completions"]) for r in records) / TREES < 0.7 * G  # many leaves stand for several (5.2 of 8)
    exact = sum(p * reward(list(y)) for y, p in setup["prob"].items())
    weighted = torch.tensor([group_stats([r])["reward_mean"] for r in records], dtype=torch.float64)
    unweighted = torch.tensor([sum(r["rewards"]) / len(r["rewards"]) for r in records], dtype=torch.float64)
    assert group_stats(records)["reward_mean"] == pytest.approx(float(weighted.mean()), rel=1e-12)
    se = float(weighted.std()) / math.sqrt(TREES)
    assert abs(float(weighted.mean()) - exact) <= Z * se
    assert abs(float(unweighted.mean()) - exact) > Z * se  # short right answers were under-counted


def test_reinforce_and_grpo_gradients_match_their_exact_expectations(setup):
    """Dr. GRPO's loss (ratio 1, scale_rewards=false): with advantage = reward (REINFORCE, no
    baseline) its expected gradient is -grad J / T; with the independent baseline it is
    -(1 - 1/G) grad J / T, flat GRPO's; with the group baseline the tokens that N of the G
    samples share get (1 - N/G) instead of (1 - 1/G) (docs/algorithms.md's formula)."""
    s, records = setup, setup["records"]
    counts = [r["counts"] for r in records]
    rewards = [torch.tensor(r["rewards"], dtype=torch.float64) for r in records]
    reinforce = exact_entry_weights(s, lambda t: -1 / MAX_NEW)
    directions = gradient_directions(s, s["grads"].T @ reinforce)
    flat_grpo = (1 - 1 / G) * reinforce
    group = exact_entry_weights(s, lambda t: -(1 - SHARED_BY[t] / G) / MAX_NEW)

    weighted = per_tree_entry_weights(s, rewards, counts)
    assert z_scores(weighted, reinforce, directions).abs().max() <= Z
    unweighted = per_tree_entry_weights(s, rewards, None)  # today's leaves: each counts once
    assert z_scores(unweighted, reinforce, directions)[0].abs() > Z

    independent = [group_advantages(r, scale=False, counts=n, subtrees=leaf_subtrees(rec))
                   for r, n, rec in zip(rewards, counts, records)]
    assert z_scores(per_tree_entry_weights(s, independent, counts), flat_grpo, directions).abs().max() <= Z

    grouped = per_tree_entry_weights(s, [group_advantages(r, scale=False, counts=n) for r, n in zip(rewards, counts)],
                                     counts)
    assert z_scores(grouped, group, directions).abs().max() <= Z
    # ... which is not flat GRPO's expectation: along the difference, far outside the bound.
    difference = (s["grads"].T @ (group - flat_grpo))
    along = (s["grads"] @ (difference / difference.norm()))[None]
    assert z_scores(grouped, flat_grpo, along).abs().item() > Z

