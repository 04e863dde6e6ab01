"""Tree rollout sampling: tree shape, KV-cache forking instead of re-encoding, EOS, greedy, determinism."""

from itertools import groupby

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lsreplay.models.distribution import SamplingParams
from lsreplay.rollout.sampling import sample_next
from lsreplay.rollout.tree_sampler import sample_tree

VOCAB = 128
# An id outside the vocabulary: the model can never emit it, so no sequence ends early.
NO_EOS = VOCAB
PROMPT = [int(t) for t in torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).float().eval()


def _tree(model, branching=(3, 2), segment=(5,), max_new=12, eos=NO_EOS, seed=0, **params):
    return sample_tree(
        model, PROMPT, list(branching), list(segment), max_new, SamplingParams(**params), eos,
        torch.Generator().manual_seed(seed),
    )


def test_shape_and_shared_segments(model):
    tree = _tree(model)
    assert len(tree.completions) == 6 and not any(tree.finished) and tree.counts == [1] * 6
    assert all(len(c) == 12 for c in tree.completions)
    assert [len(lp) for lp in tree.logprobs] == [12] * 6
    for k in range(3):
        assert tree.completions[2 * k][:5] == tree.completions[2 * k + 1][:5]
        assert tree.completions[2 * k][5:] != tree.completions[2 * k + 1][5:]
    assert len({tuple(c[:5]) for c in tree.completions}) == 3


def test_forks_the_cache_instead_of_recomputing(model):
    counted = []
    # The sampler runs the base model (then the LM head on the last position only).
    hook = model.base_model.register_forward_hook(
        lambda module, args, kwargs, out: counted.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        tree = _tree(model)
    finally:
        hook.remove()
    # Sampled token t of a row is encoded only if token t+1 follows: 5 steps at batch 3, 6 at batch 6.
    assert tree.forward_positions == sum(counted) == len(PROMPT) + 3 * 5 + 6 * 6
    per_rollout = 6 * (len(PROMPT) + 11)
    assert tree.forward_positions < per_rollout / 2


def _assert_logprobs_match_a_fresh_forward(model, tree):
    """Each completion re-encoded from scratch (no cache) must give the recorded logprobs."""
    for completion, recorded in zip(tree.completions, tree.logprobs):
        ids = torch.tensor([PROMPT + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(recorded), expected, atol=1e-5, rtol=0)


def test_recorded_logprobs_match_a_fresh_forward(model):
    _assert_logprobs_match_a_fresh_forward(model, _tree(model))


def test_eos_ends_branches_early_and_they_are_not_forked(model):
    eos = list(range(12))  # ~10% of a random model's near-uniform mass: some branches end, some don't
    tree = _tree(model, branching=(4, 2), eos=eos, seed=1626)
    for completion, done in zip(tree.completions, tree.finished):
        assert done == (completion[-1] in eos)
        assert not any(t in eos for t in completion[:-1])
        assert len(completion) == 12 or done
    lengths = [len(c) for c in tree.completions]
    # This seed covers: an EOS inside the first segment, one exactly at the branch point (5),
    # one in the second level, one on the very last token, and unfinished leaves.
    assert {4, 5, 8} <= set(lengths) and True in tree.finished and False in tree.finished
    assert any(n == 12 and done for n, done in zip(lengths, tree.finished))
    # Leaves are depth-first: siblings share the first segment and sit together; a first-level
    # branch that ended within its segment is a lone leaf, the others have two children.
    groups = [list(g) for _, g in groupby(tree.completions, key=lambda c: tuple(c[:5]))]
    assert len(groups) == 4
    for group in groups:
        assert len(group) == (1 if len(group[0]) <= 5 else 2)
    # A leaf that ended before the branch point stands for the 2 leaves it would have been
    # forked into: the counts sum to the 4 x 2 samples of the tree shape.
    assert tree.counts == [2 if len(c) <= 5 else 1 for c in tree.completions] and sum(tree.counts) == 8
    assert [p[0] for p in tree.paths] == [k for k, group in enumerate(groups) for _ in group]
    assert all(len(p) == (1 if n == 2 else 2) for p, n in zip(tree.paths, tree.counts))
    # Dropping finished rows must keep each survivor's own cache rows.
    _assert_logprobs_match_a_fresh_forward(model, tree)


def test_greedy_branches_agree_with_generate(model):
    tree = _tree(model, temperature=0.0)
    assert all(c == tree.completions[0] for c in tree.completions)
    out = model.generate(
        torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        do_sample=False, max_new_tokens=12, eos_token_id=NO_EOS, pad_token_id=0,
    )
    assert tree.completions[0] == out[0, len(PROMPT) :].tolist()


def test_same_seed_same_tree(model):
    first, again, other = _tree(model, seed=7), _tree(model, seed=7), _tree(model, seed=8)
    assert first == again
    assert first.completions != other.completions


def test_the_recorded_logprob_is_that_of_the_tempered_truncated_distribution_sampled_from():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs)[None].repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_next(logits, SamplingParams(top_p=0.7), gen)
    assert set(tokens.tolist()) == {0, 1}
    kept = probs[:2] / probs[:2].sum()  # the nucleus, renormalised
    torch.testing.assert_close(logprobs, kept.log()[tokens])
    tokens, logprobs = sample_next(logits, SamplingParams(temperature=0.5), gen)
    tempered = probs**2 / (probs**2).sum()  # softmax(log p / 0.5)
    torch.testing.assert_close(logprobs, tempered.log()[tokens])
    frequency = torch.bincount(tokens, minlength=4) / len(tokens)
    assert (frequency - tempered).abs().max() < 0.04
    tokens, logprobs = sample_next(logits, SamplingParams(top_k=2, temperature=2.0), gen)
    assert set(tokens.tolist()) == {0, 1}
    hot = probs[:2] ** 0.5 / (probs[:2] ** 0.5).sum()
    torch.testing.assert_close(logprobs, hot.log()[tokens])


def test_rejects_mismatched_shape(model):
    with pytest.raises(ValueError):
        _tree(model, branching=(2, 2), segment=())


def test_many_trees_batched_with_left_padding_match_each_tree_alone(model):
    """Prompts of different lengths in one batch: every tree's recorded logprobs equal a
    fresh per-rollout forward, and each tree is the one its generator draws alone."""
    from lsreplay.rollout.tree_sampler import sample_trees

    prompts = [PROMPT[:n] for n in (40, 7, 23)]
    seeds = [3, 4, 5]
    eos = list(range(8))  # some sequences finish early, so rows leave the batch
    trees, trace = sample_trees(model, prompts, [2, 2], [4], 12, SamplingParams(), eos,
                                [torch.Generator().manual_seed(s) for s in seeds])
    for prompt, seed, tree in zip(prompts, seeds, trees):
        alone = sample_trees(model, [prompt], [2, 2], [4], 12, SamplingParams(), eos,
                             [torch.Generator().manual_seed(seed)])[0][0]
        assert tree.completions == alone.completions
        assert tree.forward_positions == alone.forward_positions
        for completion, recorded in zip(tree.completions, tree.logprobs):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(recorded), expected, atol=1e-5, rtol=0)
    lengths = [len(c) for t in trees for c in t.completions]
    summary = trace.summary(lengths)
    assert summary["length_max"] == max(lengths) and 0 <= summary["tail_time_share"] <= 1
    assert trace.live[0] == 6 and trace.finished[-1] == len(lengths)


def test_draws_in_fixed_point_are_the_float64_draws():
    """Under pool.deterministic on a GPU the sampler's running sums go in int64 fixed point
    (torch refuses a floating-point cumsum there, or replaces it by a V x V masked sum): the
    same uniforms pick the same tokens as the float64 inverse CDF, over a vocabulary of
    SmolLM2's size and a peaked distribution alike; nothing of zero probability is drawn."""
    from lsreplay.rollout.sampling import draw, fixed_point

    vocab = 49152
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits[32:] *= 12  # peaked rows
    probs = logits.softmax(-1).float()
    probs[:, 7] = 0.0
    fixed, floating = (draw(probs, torch.Generator().manual_seed(1), exact_sums=e) for e in (True, False))
    assert torch.equal(fixed, floating) and not bool((fixed == 7).any())
    assert not fixed_point(probs)  # a CPU tensor keeps the float64 sums (the rollouts' bits stay)
