"""Losses over trees: advantages, aggregations, PPO clip, KL estimators, DPO, ppo_update, the critic,
and the GRPO refinements (clip-higher, overlong, LR schedules)."""

import copy
import logging
import math

import pytest
import torch
import transformers

from conftest import RAW_LOGPROB

import lsreplay.algos.backward as naive_module
import lsreplay.algos.ppo as ppo_module
from lsreplay.algos.backward import capture_logprobs, naive_logprobs, naive_loss_backward, replay_loss_backward
from lsreplay.algos.critic import (CriticBatch, attach_value_head, explained_variance, gae, split_critic,
                                   value_clip_fraction, value_loss, value_scores, whiten)
from lsreplay.algos.dpo import best_worst_pairs, dpo_loss, reference_sequence_logprobs, sequence_logprobs
from lsreplay.algos.grpo import GRPOBatch, aggregate, clip_fractions, group_advantages, grpo_loss
from lsreplay.algos.kl import kl_loss, kl_per_token, reference_logprobs, with_kl
from lsreplay.algos.overlong import length_penalty
from lsreplay.algos.ppo import PPOBatch, ppo_loss, ppo_update
from lsreplay.algos.weights import loss_and_weights
from lsreplay.core.config import LOSS_AGGS, OptimConfig
from lsreplay.models.distribution import RAW
from lsreplay.models.train_state import lr_factor
from lsreplay.replay.capture import capture_tree
from lsreplay.tree import RolloutTree



def tiny_llama(dtype=torch.float64) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=1.0)
    return model


def small_trees() -> list[RolloutTree]:
    return [
        RolloutTree.from_sequences([5, 6, 7], [[1, 2, 3], [1, 2, 4, 5], [1, 6], [7, 8, 9, 10]]),
        RolloutTree.from_sequences([11, 12, 13, 14, 15], [[20, 21], [20, 22, 23], [24]]),
        RolloutTree.from_sequences([30], [[31, 32, 33, 34], [31, 32, 35], [31, 32, 33, 36]]),
        RolloutTree.from_sequences([40, 41], [[42], [43, 44], [42, 45, 46]]),
    ]


def nested(*lengths_per_tree, value=0.0):
    return [[torch.full((n,), value, dtype=torch.float64) for n in tree] for tree in lengths_per_tree]


# -- advantages and aggregation ---------------------------------------------------------------

def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    centred = group_advantages(r, scale=False)
    assert torch.allclose(centred, torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64))
    scaled = group_advantages(r)
    assert torch.allclose(scaled, centred / (r.double().std() + 1e-6))
    assert abs(float(scaled.mean())) < 1e-12 and abs(float(scaled.std()) - 1) < 1e-5
    assert torch.equal(group_advantages(torch.tensor([3.0, 3.0, 3.0])), torch.zeros(3, dtype=torch.float64))
    assert torch.equal(group_advantages(torch.tensor([2.0])), torch.zeros(1, dtype=torch.float64))


def test_aggregations_on_uneven_lengths():
    """Lengths 1 and 3, advantages +1 / -1, ratio 1: the per-token loss is -A."""
    lp = nested([1, 3])
    adv = [torch.tensor([1.0, -1.0], dtype=torch.float64)]

    def run(agg, max_tokens=None):
        batch = GRPOBatch(advantages=adv, old_logprobs=lp, loss_agg=agg, max_tokens=max_tokens)
        return loss_and_weights(lambda x: grpo_loss(x, batch), lp)

    loss, w = run("token-mean")  # (-1 + 3) / 4 tokens: the long negative completion dominates
    assert loss == pytest.approx(0.5)
    assert torch.allclose(w[0][0], torch.tensor([-0.25], dtype=torch.float64))
    assert torch.allclose(w[0][1], torch.full((3,), 0.25, dtype=torch.float64))
    loss, w = run("seq-mean")  # each completion counts once: (-1 + 1) / 2
    assert loss == pytest.approx(0.0)
    assert torch.allclose(w[0][0], torch.tensor([-0.5], dtype=torch.float64))
    assert torch.allclose(w[0][1], torch.full((3,), 0.5 / 3, dtype=torch.float64))
    loss, w = run("seq-mean-token-sum-norm", max_tokens=8)  # Dr. GRPO: sum / (G * max_tokens)
    assert loss == pytest.approx(2 / 16)
    assert torch.allclose(w[0][0], torch.tensor([-1 / 16], dtype=torch.float64))
    assert torch.allclose(w[0][1], torch.full((3,), 1 / 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_tokens"):
        run("seq-mean-token-sum-norm", max_tokens=2)
    with pytest.raises(ValueError, match="loss_agg"):
        run("sum")


def test_aggregate_skips_empty_completions():
    t = [torch.tensor([1.0, 3.0], dtype=torch.float64), torch.zeros(0, dtype=torch.float64)]
    assert float(aggregate(t, "token-mean")) == 2.0
    assert float(aggregate(t, "seq-mean")) == 2.0
    assert float(aggregate(t, "seq-mean-token-sum-norm", max_tokens=4)) == 4.0 / (2 * 4)
    assert float(aggregate([], "token-mean")) == 0.0


# -- leaves that stand for several samples --------------------------------------------------------

def test_a_leaf_with_count_n_counts_as_n_identical_completions():
    """Every loss_agg, GRPO's group statistics, KL: counts [3, 1, 2] equal the completions
    repeated 3, 1 and 2 times; counts of 1 change nothing."""
    g = torch.Generator().manual_seed(0)
    lengths, counts = [2, 5, 3], [3, 1, 2]
    lp = [[-torch.rand(n, dtype=torch.float64, generator=g) for n in lengths]]
    ref = [[x - torch.rand(len(x), dtype=torch.float64, generator=g) for x in lp[0]]]
    rewards = torch.tensor([1.0, 0.0, 0.5])
    copies = [j for j, n in enumerate(counts) for _ in range(n)]
    repeated = [[lp[0][j] for j in copies]]
    adv = group_advantages(rewards, counts=counts)
    assert torch.allclose(adv[copies], group_advantages(rewards[copies]))
    assert torch.equal(group_advantages(rewards, counts=[1, 1, 1]), group_advantages(rewards))
    for agg in LOSS_AGGS:
        weighted = GRPOBatch(advantages=[adv], old_logprobs=lp, loss_agg=agg, max_tokens=8, counts=[counts])
        plain = GRPOBatch(advantages=[adv[copies]], old_logprobs=repeated, loss_agg=agg, max_tokens=8)
        moved = [[x + 0.1 for x in lp[0]]]  # ratio != 1
        assert float(grpo_loss(moved, weighted)) == pytest.approx(float(grpo_loss([[moved[0][j] for j in copies]], plain)))
        kl = float(kl_loss(lp, ref, "k3", agg, 8, counts=[counts]))
        assert kl == pytest.approx(float(kl_loss(repeated, [[ref[0][j] for j in copies]], "k3", agg, 8)))
    with pytest.raises(ValueError, match="counts"):
        group_advantages(rewards, counts=[1, 0, 2])
    with pytest.raises(ValueError, match="counts"):
        aggregate([torch.ones(2)], "token-mean", counts=[1, 1])


def test_grpo_at_ratio_one_needs_no_old_logprobs():
    """One update per batch evaluates the loss where the ratio is 1: the loss and every
    token's weight are the same whatever the old logprobs are, so the caching pass does not
    score them without a KL term; unscored, it still caches the same prefix K/V."""
    model, trees = tiny_llama(), small_trees()
    scored = [capture_tree(model, t, keep_hidden=False, heads=RAW_LOGPROB) for t in trees]
    unscored = [capture_tree(model, t, keep_hidden=False, heads={}) for t in trees]
    for a, b in zip(scored, unscored):
        assert b.entry_logprobs is None and a.prefix_kv.keys() == b.prefix_kv.keys()
        assert all(torch.equal(x, y) for n in a.prefix_kv for half in (0, 1)
                   for x, y in zip(a.prefix_kv[n][half], b.prefix_kv[n][half]))
    old = [t.completion_values(a.entry_logprobs) for t, a in zip(trees, scored)]
    zeros = [[torch.zeros_like(x) for x in row] for row in old]
    advantages = [group_advantages(torch.arange(len(t.completions), dtype=torch.float64)) for t in trees]
    counts = [[1 + j % 2 for j in range(len(t.completions))] for t in trees]

    def at(logprobs, agg):
        batch = GRPOBatch(advantages=advantages, old_logprobs=logprobs, loss_agg=agg, max_tokens=8, counts=counts)
        return loss_and_weights(lambda lp: grpo_loss(lp, batch), logprobs)

    for agg in LOSS_AGGS:
        (loss, weights), (zeros_loss, zeros_weights) = at(old, agg), at(zeros, agg)
        assert loss == zeros_loss, agg
        assert all(torch.equal(x, y) for r, z in zip(weights, zeros_weights) for x, y in zip(r, z)), agg


def test_independent_baseline_leaves_out_the_leafs_own_subtree():
    """Subtrees {0, 1} and {2}: leaf 0's baseline is leaf 2's reward, leaf 2's the count-
    weighted mean of leaves 0 and 1; scaled by 1 - 1/G (flat GRPO's factor), G = 4."""
    rewards, counts, subtrees = torch.tensor([1.0, 0.0, 0.0]), [1, 1, 2], [0, 0, 1]
    adv = group_advantages(rewards, scale=False, counts=counts, subtrees=subtrees)
    assert torch.allclose(adv, 0.75 * torch.tensor([1.0 - 0.0, 0.0 - 0.0, 0.0 - 0.5], dtype=torch.float64))
    # With each leaf its own subtree it is the group mean: flat GRPO, and records without paths.
    r = torch.tensor([1.0, 0.0, 0.0, 2.0])
    assert torch.allclose(group_advantages(r, subtrees=[0, 1, 2, 3]), group_advantages(r))
    with pytest.raises(ValueError, match="branching"):
        group_advantages(rewards, counts=counts, subtrees=[0, 0, 0])


def test_dpo_pair_stands_for_the_pairs_of_its_samples():
    lp = nested([2, 3, 1], value=-0.5)
    lp[0][1] = lp[0][1] - 0.2
    ref = sequence_logprobs(nested([2, 3, 1], value=-0.5))
    pairs = [[(0, 1), (2, 1)]]
    per_pair = [float(dpo_loss(lp, [[p]], ref)) for p in pairs[0]]
    # counts 3, 2, 1: pair (0, 1) stands for 6 pairs of samples, pair (2, 1) for 2
    weighted = float(dpo_loss(lp, pairs, ref, counts=[[3, 2, 1]]))
    assert weighted == pytest.approx((6 * per_pair[0] + 2 * per_pair[1]) / 8)
    assert float(dpo_loss(lp, pairs, ref)) == pytest.approx(sum(per_pair) / 2)


def test_counts_survive_identical_leaves_in_the_trie():
    """Two leaves with the same tokens share every trie entry; a count of 2 on one of them
    gives the gradient of three copies, by replay as by the per-rollout reference."""
    model = tiny_llama()
    prompt, same, other = [5, 6, 7], [1, 2, 3], [1, 4]
    counted = [RolloutTree.from_sequences(prompt, [same, same, other])]
    copied = [RolloutTree.from_sequences(prompt, [same, same, same, other])]
    assert counted[0].unique_positions == copied[0].unique_positions
    rewards = torch.tensor([1.0, 1.0, 0.0])

    def gradient(trees, counts, mode):
        old, acts = capture_logprobs(model, trees, heads=RAW_LOGPROB)
        r = rewards if counts else torch.tensor([1.0, 1.0, 1.0, 0.0])
        batch = GRPOBatch(advantages=[group_advantages(r, counts=counts and counts[0])], old_logprobs=old,
                          counts=counts)
        model.zero_grad(set_to_none=True)
        if mode == "replay":
            replay_loss_backward(model, trees, lambda lp: grpo_loss(lp, batch), activations=acts, heads=RAW_LOGPROB)
        else:
            naive_loss_backward(model, trees, lambda lp: grpo_loss(lp, batch), heads=RAW_LOGPROB)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    reference = gradient(copied, None, "naive")
    assert reference.abs().max() > 1e-4
    for mode in ("replay", "naive"):  # HF's float32 RMSNorm: float64 models agree to ~1e-7
        got = gradient(counted, [[2, 1, 1]], mode)
        assert (got - reference).abs().max() <= 1e-6 * reference.abs().max(), mode


# -- PPO clip -----------------------------------------------------------------------------------

def test_ppo_clip_zeroes_gradient_beyond_clip_range():
    ratios = torch.tensor([1.5, 1.05, 0.5, 1.5, 0.5, 0.95], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    old = [[torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))]]
    lp = [[old[0][0] + ratios.log()]]
    batch = PPOBatch(advantages=[[adv]], old_logprobs=old, clip_eps=0.2)
    loss, w = loss_and_weights(lambda x: ppo_loss(x, batch), lp)
    w = w[0][0]
    # beyond the range on the side the advantage pushes towards: clipped, no gradient
    assert w[0] == 0 and w[2] == 0
    # inside the range, or beyond it on the other side: d/dlogp of -r A / N = -r A / N
    for t in (1, 3, 4, 5):
        assert float(w[t]) == pytest.approx(float(-ratios[t] * adv[t] / 6))
    expected = -torch.minimum(ratios * adv, ratios.clamp(0.8, 1.2) * adv).mean()
    assert loss == pytest.approx(float(expected))


def test_ppo_accepts_scalar_and_per_token_advantages():
    lp = nested([2, 3])
    scalar = PPOBatch(advantages=[[1.0, torch.tensor(-2.0)]], old_logprobs=lp)
    per_token = PPOBatch(advantages=[[torch.ones(2), torch.full((3,), -2.0)]], old_logprobs=lp)
    assert float(ppo_loss(lp, scalar)) == float(ppo_loss(lp, per_token)) == pytest.approx(-(2 - 6) / 5)


# -- KL -----------------------------------------------------------------------------------------

def test_kl_estimators():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(100, dtype=torch.float64, generator=g) * 5
    ref = -torch.rand(100, dtype=torch.float64, generator=g) * 5
    k3 = kl_per_token(lp, ref, "k3")
    assert (k3 >= 0).all()
    assert torch.allclose(k3, torch.exp(ref - lp) - (ref - lp) - 1)
    assert torch.equal(kl_per_token(lp, lp, "k3"), torch.zeros(100, dtype=torch.float64))
    assert torch.equal(kl_per_token(lp, ref, "k1"), lp - ref)
    assert torch.equal(kl_per_token(lp, lp, "k1"), torch.zeros(100, dtype=torch.float64))
    # At equality k3 has zero gradient (a minimum); k1's gradient is 1 per token.
    _, w3 = loss_and_weights(lambda x: kl_loss(x, [[lp]], "k3", "token-mean"), [[lp]])
    _, w1 = loss_and_weights(lambda x: kl_loss(x, [[lp]], "k1", "token-mean"), [[lp]])
    assert torch.equal(w3[0][0], torch.zeros(100, dtype=torch.float64))
    assert torch.allclose(w1[0][0], torch.full((100,), 0.01, dtype=torch.float64))
    with pytest.raises(ValueError, match="estimator"):
        kl_per_token(lp, ref, "k4")


def test_with_kl_composes():
    lp, ref = nested([2, 3], value=-1.0), nested([2, 3], value=-2.0)
    batch = GRPOBatch(advantages=[torch.tensor([1.0, -1.0])], old_logprobs=lp)
    base = lambda x: grpo_loss(x, batch)  # noqa: E731
    total = with_kl(base, ref, kl_coef=0.3, estimator="k3")
    k3 = math.exp(-1) + 1 - 1
    assert float(total(lp)) == pytest.approx(float(base(lp)) + 0.3 * k3)
    assert with_kl(base, ref, kl_coef=0.0) is base


def test_reference_logprobs_match_per_rollout_forward():
    model, trees = tiny_llama(), small_trees()
    ref = reference_logprobs(model, trees, sampling=RAW)
    with torch.no_grad():
        direct = naive_logprobs(model, trees, sampling=RAW)
    for a_tree, b_tree in zip(ref, direct):
        for a, b in zip(a_tree, b_tree):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)


# -- DPO ----------------------------------------------------------------------------------------

def test_dpo_loss_at_equality_is_log2_and_shared_prefix_cancels():
    tree = RolloutTree.from_sequences([1, 2], [[3, 4, 5], [3, 4, 6, 7], [8]])
    g = torch.Generator().manual_seed(0)
    lp = [tree.completion_values(-torch.rand(tree.num_entries, dtype=torch.float64, generator=g))]
    pairs = [[(0, 1), (2, 1)]]
    ref = sequence_logprobs(lp)
    loss, w = loss_and_weights(lambda x: dpo_loss(x, pairs, ref, beta=0.5), lp)
    assert loss == pytest.approx(math.log(2))
    # dL/dlogp = -beta * sigmoid(0) / pairs per chosen token, + for rejected ones
    assert torch.allclose(w[0][0], torch.full((3,), -0.125, dtype=torch.float64))
    assert torch.allclose(w[0][1], torch.full((4,), 0.25, dtype=torch.float64))  # rejected twice
    assert torch.allclose(w[0][2], torch.full((1,), -0.125, dtype=torch.float64))
    # On the tree, completion 0's and 1's shared prefix [3, 4] gets 0.25 - 0.125 from both
    entry = tree.entry_weights(w[0])
    shared = tree.entry_index[0][:2]
    assert torch.allclose(entry[shared], torch.full((2,), -0.125 + 0.25, dtype=torch.float64))
    # A pair of completions with the same margin relative to the reference: still log 2
    shifted = [[x + 1.0 for x in lp[0]]]
    assert float(dpo_loss(shifted, [[(0, 2)]], sequence_logprobs(shifted), beta=1.0)) == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="pair"):
        dpo_loss(lp, [[(0, 0)]], ref)


def test_dpo_prefers_chosen():
    lp = nested([2, 2])
    ref = sequence_logprobs(lp)
    up = [[lp[0][0] + 0.1, lp[0][1]]]
    assert float(dpo_loss(up, [[(0, 1)]], ref)) < math.log(2) < float(dpo_loss(up, [[(1, 0)]], ref))


def test_reference_sequence_logprobs():
    model, trees = tiny_llama(), small_trees()
    seq = reference_sequence_logprobs(model, trees, sampling=RAW)
    lps, _ = capture_logprobs(model, trees, heads=RAW_LOGPROB)
    for s, tree_lps in zip(seq, lps):
        assert torch.allclose(s, torch.stack([x.sum() for x in tree_lps]))


# -- ppo_update ---------------------------------------------------------------------------------

def advantages_for(trees, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(len(c), dtype=torch.float64, generator=g) for c in t.completions] for t in trees]


def test_ppo_update_rebuilds_cache_after_every_step(monkeypatch, caplog):
    model, trees = tiny_llama(), small_trees()
    initial, _ = capture_logprobs(model, trees, heads=RAW_LOGPROB)
    captures = []  # (tree, a parameter's value when the caching pass ran)
    seen = []  # (old logprobs, current logprobs) the loss was evaluated at, per minibatch
    probe = model.model.layers[0].self_attn.q_proj.weight
    real_capture, real_loss = naive_module.capture_tree, ppo_module.ppo_loss

    def counting_capture(m, tree, **kw):
        captures.append((trees.index(tree), probe.detach().clone()))
        return real_capture(m, tree, **kw)

    def recording_loss(lp, batch):
        seen.append(([[x.clone() for x in t] for t in batch.old_logprobs],
                     [[x.detach().clone() for x in t] for t in lp]))
        return real_loss(lp, batch)

    monkeypatch.setattr(naive_module, "capture_tree", counting_capture)
    monkeypatch.setattr(ppo_module, "ppo_loss", recording_loss)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # later minibatches clip 70-85% of tokens
    with caplog.at_level(logging.WARNING):
        losses = ppo_update(model, optimizer, trees, advantages_for(trees), epochs=2, minibatch_trees=2,
                            mode="replay", clip_eps=0.1, sampling=RAW)
    assert len(losses) == 4 and len(seen) == 4
    assert not [r for r in caplog.records if "recomputed" in r.getMessage()]  # the fresh K/V was used
    # One initial pass over all 4 trees (old logprobs; its K/V also serves minibatch 1,
    # whose weights they are), then a fresh pass for each later minibatch's 2 trees.
    assert [t for t, _ in captures] == [0, 1, 2, 3, 2, 3, 0, 1, 2, 3]
    weights_at = [w for _, w in captures]
    assert all(torch.equal(w, weights_at[0]) for w in weights_at[:4])
    for k in range(1, 4):  # every later pass saw the weights after one more optimizer step
        a, b = weights_at[2 + 2 * k], weights_at[3 + 2 * k]
        assert torch.equal(a, b) and not torch.equal(a, weights_at[2 * k])
    minibatches = [[0, 1], [2, 3], [0, 1], [2, 3]]
    for k, (idx, (old, now)) in enumerate(zip(minibatches, seen)):
        for i, tree_old, tree_now in zip(idx, old, now):
            for x, ref in zip(tree_old, initial[i]):
                assert torch.equal(x, ref)  # old logprobs stay those of the first pass
            moved = max((x - y).abs().max().item() for x, y in zip(tree_now, initial[i]))
            assert (moved == 0) if k == 0 else (moved > 1e-3), (k, i, moved)


def test_ppo_update_replay_matches_naive():
    """2 epochs x 2 minibatches, shuffled, with a KL term: the same weights either way."""
    base, trees = tiny_llama(), small_trees()
    ref = reference_logprobs(base, trees, sampling=RAW)
    adv = advantages_for(trees)
    results = {}
    for mode in ("replay", "naive"):
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        losses = ppo_update(model, optimizer, trees, adv, epochs=2, minibatch_trees=2, mode=mode, clip_eps=0.1,
                            loss_agg="seq-mean", ref_logprobs=ref, kl_coef=0.1, max_grad_norm=10.0,
                            generator=torch.Generator().manual_seed(3), sampling=RAW)
        results[mode] = (losses, dict(model.named_parameters()))
    (loss_r, params_r), (loss_n, params_n) = results["replay"], results["naive"]
    assert loss_r == pytest.approx(loss_n, rel=1e-6, abs=1e-9)
    worst, moved = 0.0, 0.0
    for name, p in params_n.items():
        diff = (params_r[name] - p).abs().max().item()
        worst = max(worst, diff / p.abs().max().item())
        moved = max(moved, (p - dict(base.named_parameters())[name]).abs().max().item())
    assert worst <= 1e-6, worst
    assert moved > 1e-2  # the policy did move


def test_ppo_update_rejects_bad_arguments():
    model, trees = tiny_llama(), small_trees()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="mode"):
        ppo_update(model, optimizer, trees, advantages_for(trees), mode="fast", sampling=RAW)
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_update(model, optimizer, trees, advantages_for(trees), kl_coef=0.1, sampling=RAW)


# -- the refinements: clip-higher, overlong, dynamic sampling's test, LR schedules ---------------

def test_clip_higher_lets_a_positive_advantage_grow_further():
    """Ratios 1.25 and 0.75: with eps 0.2 both clip; clip_eps_high=0.28 frees the ratio
    above 1 (its token keeps a gradient), the one below stays clipped at 0.8."""
    old = [[torch.zeros(2, dtype=torch.float64)]]
    lp = [[torch.log(torch.tensor([1.25, 0.75], dtype=torch.float64))]]
    adv = [[torch.tensor([1.0, -1.0], dtype=torch.float64)]]
    _, sym = loss_and_weights(lambda x: ppo_loss(x, PPOBatch(advantages=adv, old_logprobs=old)), lp)
    _, high = loss_and_weights(lambda x: ppo_loss(x, PPOBatch(advantages=adv, old_logprobs=old, clip_eps_high=0.28)),
                               lp)
    assert sym[0][0].tolist() == [0.0, 0.0]
    assert high[0][0][0] == pytest.approx(-1.25 / 2) and high[0][0][1] == 0.0
    assert clip_fractions(lp, old, adv, 0.2)["clip_ratio/region_mean"] == 1.0
    assert clip_fractions(lp, old, adv, 0.2, 0.28)["clip_ratio/region_mean"] == 0.5


def test_masked_completions_count_nowhere():
    """A masked completion is out of the loss and of every aggregation's denominator: the
    loss equals the loss of the batch without it, for every loss_agg."""
    lp = [[-torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n)) for n in (2, 4, 3)]]
    adv = [torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)]
    for agg in LOSS_AGGS:
        masked = GRPOBatch(advantages=adv, old_logprobs=lp, loss_agg=agg, max_tokens=8, counts=[[1, 2, 1]],
                           mask=[[True, False, True]])
        without = GRPOBatch(advantages=[adv[0][[0, 2]]], old_logprobs=[[lp[0][0], lp[0][2]]], loss_agg=agg,
                            max_tokens=8, counts=[[1, 1]])
        moved = [[x + 0.1 for x in lp[0]]]
        assert float(grpo_loss(moved, masked)) == pytest.approx(float(grpo_loss([[moved[0][0], moved[0][2]]], without)))
        _, w = loss_and_weights(lambda x, b=masked: grpo_loss(x, b), moved)
        assert not w[0][1].any()


def test_overlong_penalty_grows_over_the_buffer():
    assert [length_penalty(n, 10, 4) for n in (5, 6, 7, 8, 10)] == [0.0, 0.0, 0.25, 0.5, 1.0]
    assert length_penalty(10, 10, 4, factor=0.5) == 0.5


def test_best_worst_pairs():
    assert best_worst_pairs([[0.0, 1.0, 1.0, 0.0], [0.5, 0.5], [2.0, -1.0, 0.0]]) == [[(1, 0)], [], [(0, 1)]]


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedules_warm_up_then_decay_to_the_last_update(schedule):
    optim = OptimConfig(schedule=schedule, warmup_steps=2)
    factors = [lr_factor(optim, u, 6) for u in range(6)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    if schedule == "constant":
        assert factors == [0.5] + [1.0] * 5
    else:
        assert all(a > b > 0 for a, b in zip(factors[2:], factors[3:]))  # down, never to 0 inside the run
        assert factors[4] == pytest.approx(0.5)  # half way through the decay
    if schedule == "linear":  # the docs' formula: the last update at lr / (updates - warmup)
        assert factors[5] == pytest.approx(1 / 4)
    assert lr_factor(OptimConfig(), 0, 1) == 1.0


# -- the critic ---------------------------------------------------------------------------------

def test_gae_and_returns():
    values = torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64)
    adv, ret = gae(values, 2.0, gamma=0.9, lam=0.5)
    d = [0.9 * 0.25 - 0.5, 0.9 * 1.0 - 0.25, 2.0 - 1.0]
    expected = [d[0] + 0.45 * (d[1] + 0.45 * d[2]), d[1] + 0.45 * d[2], d[2]]
    assert adv.tolist() == pytest.approx(expected)
    assert ret.tolist() == pytest.approx([a + v for a, v in zip(expected, values.tolist())])
    _, mc = gae(values, 2.0, gamma=1.0, lam=1.0)  # Monte Carlo: every token's return is the reward
    assert mc.tolist() == pytest.approx([2.0, 2.0, 2.0])
    white = whiten([[torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([3.0], dtype=torch.float64)]],
                   counts=[[1, 2]])
    flat = torch.cat([white[0][0], white[0][1], white[0][1]])  # the count-2 completion twice
    # verl's masked_whiten: mean 0 and the unbiased variance 1 (to its eps of 1e-8)
    assert float(flat.mean()) == pytest.approx(0.0, abs=1e-12) and float(flat.var()) == pytest.approx(1.0, rel=1e-7)


def test_one_mask_leaves_a_completion_out_of_the_whitening_and_the_value_loss():
    advantages = [[torch.tensor(a, dtype=torch.float64) for a in row] for row in [[[1.0, 2.0], [30.0]], [[3.0]]]]
    white = whiten(advantages, mask=[[True, False], [True]])
    kept = torch.cat([white[0][0], white[1][0]])
    assert float(kept.mean()) == pytest.approx(0.0, abs=1e-12) and float(kept.var()) == pytest.approx(1.0, rel=1e-7)
    old = [[torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]]
    ret = [[torch.ones(2, dtype=torch.float64), torch.full((1,), 10.0, dtype=torch.float64)]]
    values = [[torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]]
    batch = CriticBatch(old_values=old, returns=ret, clip=0.0, mask=[[True, False]])
    assert float(value_loss(values, batch)) == pytest.approx(0.5)  # the masked return of 10 counts nowhere


def test_value_loss_clips_and_the_head_starts_at_zero():
    old, ret = [[torch.tensor([0.0, 0.0], dtype=torch.float64)]], [[torch.tensor([1.0, -1.0], dtype=torch.float64)]]
    batch = CriticBatch(old_values=old, returns=ret, clip=0.2)
    # V moved +0.5 on both: token 0 towards its return (the clipped value 0.2 is further: loss 0.5 * 0.8^2),
    # token 1 away from it (unclipped 0.5 * 1.5^2 is the larger)
    values = [[torch.tensor([0.5, 0.5], dtype=torch.float64)]]
    assert float(value_loss(values, batch)) == pytest.approx((0.5 * 0.8 ** 2 + 0.5 * 1.5 ** 2) / 2)
    assert value_clip_fraction(values, batch) == 1.0
    assert explained_variance(ret, ret) == 1.0 and explained_variance(old, ret) == 0.0
    model = attach_value_head(tiny_llama())
    hidden = torch.randn(4, 32, dtype=torch.float64)
    assert torch.equal(value_scores(model, hidden, [0, 2], [0, 0]), torch.zeros(2, dtype=torch.float64))
    assert split_critic(dict(model.named_parameters()))[1].keys() == {"value_head.weight", "value_head.bias"}
