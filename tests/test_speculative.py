"""Speculative decoding is lossless (greedy: identical tokens; sampled: the target's distribution); the bandit learns."""

import math

import pytest
import torch
import transformers

from lsreplay.drafter.distill import distill
from lsreplay.drafter.model import Drafter
from lsreplay.rollout import speculative
from lsreplay.rollout.bandit import DraftLengthBandit
from lsreplay.models.distribution import SamplingParams, processed_logits
from lsreplay.rollout.speculative import (
    SpecStats,
    greedy_generate,
    speculative_generate,
)



def _tiny_llama(vocab: int, hidden: int, seed: int, embed_std: float | None = None):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.2,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    if embed_std is not None:
        # A large-norm tied embedding makes the next token sharp, as in a trained LM (see test_drafter).
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(std=embed_std)
    return model


def _prompts(count: int, vocab: int, lengths: range, seed: int) -> list[torch.LongTensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (lengths[i % len(lengths)],), generator=g) for i in range(count)]


def _left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


def _hf_greedy(target, prompts, max_new_tokens, eos, pad):
    ids, mask = _left_pad(prompts)
    out = target.generate(
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=pad,
    )
    return out[:, ids.shape[1]:]


# ---------------------------------------------------------------- greedy: identical tokens

GREEDY_VOCAB, NEW_TOKENS, PAD = 64, 20, 0


@pytest.fixture(scope="module")
def greedy_setup():
    target = _tiny_llama(GREEDY_VOCAB, 48, seed=0, embed_std=1.0)
    prompts = _prompts(24, GREEDY_VOCAB, range(2, 26), seed=1)  # lengths 2..25
    # EOS: a token that ends some greedy completions early but not all.
    free = _hf_greedy(target, prompts, NEW_TOKENS, eos=None, pad=PAD)
    share = {t: (free == t).any(1).float().mean().item() for t in range(1, GREEDY_VOCAB)}
    eos = min(share, key=lambda t: abs(share[t] - 0.4))
    reference = torch.cat([_hf_greedy(target, prompts[i:i + 8], NEW_TOKENS, eos, PAD) for i in range(0, 24, 8)])

    torch.manual_seed(1)
    untrained = Drafter.from_target(target)
    # The agreeing drafter: distilled on the target's own greedy continuations of other prompts.
    train_prompts = _prompts(512, GREEDY_VOCAB, range(2, 26), seed=2)
    completions = torch.cat([greedy_generate(target, train_prompts[i:i + 64], 24) for i in range(0, 512, 64)])
    by_length: dict[int, list[torch.LongTensor]] = {}
    for prompt, completion in zip(train_prompts, completions):
        by_length.setdefault(len(prompt), []).append(torch.cat([prompt, completion]))
    sequences = []
    with torch.no_grad():
        for group in by_length.values():
            ids = torch.stack(group)
            sequences += list(zip(ids, target.base_model(ids).last_hidden_state))
    torch.manual_seed(1)
    trained = Drafter.from_target(target)
    distill(trained, sequences, steps=300, lr=3e-3, batch_size=32, generator=torch.Generator().manual_seed(0),
            progress=False)
    return target, prompts, eos, reference, {"untrained": untrained, "trained": trained}


def _same_tokens(ours: torch.LongTensor, reference: torch.LongTensor) -> None:
    width = max(ours.shape[1], reference.shape[1])

    def pad(t):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=PAD)

    assert torch.equal(pad(ours), pad(reference))


def test_greedy_generate_matches_hf_generate(greedy_setup):
    target, prompts, eos, reference, _ = greedy_setup
    for i in range(0, 24, 8):
        ours = greedy_generate(target, prompts[i:i + 8], NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD)
        _same_tokens(ours, reference[i:i + 8])
    lengths = ((reference == eos).long().cumsum(1) == 0).sum(1)
    assert 0 < (lengths < NEW_TOKENS).sum() < 24, "EOS should end some completions early, not all"


@pytest.mark.parametrize("draft_len", [1, 4, 6])
@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_greedy_speculative_matches_plain_greedy(greedy_setup, which, draft_len):
    target, prompts, eos, reference, drafters = greedy_setup
    stats = SpecStats()
    for i in range(0, 24, 8):
        ours = speculative_generate(target, drafters[which], prompts[i:i + 8], NEW_TOKENS, draft_len=draft_len,
                                    eos_token_id=eos, pad_token_id=PAD, stats=stats)
        _same_tokens(ours, reference[i:i + 8])
    print(which, draft_len, f"acceptance {stats.acceptance:.3f} accept_len {stats.accept_len:.2f}")
    assert 0 < stats.accepted < stats.drafted, "drafts must be both accepted and rejected"
    if which == "untrained":
        assert stats.acceptance < 0.25, stats
    else:
        assert stats.acceptance > 0.3, stats
        assert stats.accept_len > (2.5 if draft_len >= 4 else 1.4), stats


def test_greedy_with_tensor_input_reduced_vocab_and_bandit(greedy_setup):
    target, prompts, eos, reference, drafters = greedy_setup
    ids, mask = _left_pad(prompts[8:16])
    vocab = torch.arange(0, GREEDY_VOCAB, 2)  # half the tokens: the other half can never be drafted
    bandit = DraftLengthBandit(arms=(2, 3, 5), seed=3)
    stats = SpecStats()
    ours = speculative_generate(target, drafters["trained"], ids, NEW_TOKENS, draft_len=bandit, eos_token_id=eos,
                                attention_mask=mask, pad_token_id=PAD, draft_vocab=vocab, stats=stats)
    _same_tokens(ours, reference[8:16])
    assert set(stats.draft_lens) <= {1, 2, 3, 5} and len(bandit.history) == len(stats.draft_lens)
    assert 0 < stats.accepted < stats.drafted


def test_single_rows_match(greedy_setup):
    """Batch size one: no mask at all, caches cropped exactly."""
    target, prompts, eos, reference, drafters = greedy_setup
    for i in (0, 5, 13):
        ours = speculative_generate(target, drafters["trained"], prompts[i][None], NEW_TOKENS, draft_len=5,
                                    eos_token_id=eos, pad_token_id=PAD)
        _same_tokens(ours, reference[i:i + 1, :ours.shape[1]])


def test_no_eos_runs_to_max_new_tokens(greedy_setup):
    target, prompts, _, _, drafters = greedy_setup
    plain = greedy_generate(target, prompts[:6], 17)
    ours = speculative_generate(target, drafters["trained"], prompts[:6], 17, draft_len=4)
    assert ours.shape == (6, 17) and torch.equal(ours, plain)


def test_drafter_forward_with_holes_matches_compact_rows(greedy_setup):
    """A masked cache column is invisible: a row with holes gives what the same row gives without them."""
    drafter = greedy_setup[4]["trained"]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(GREEDY_VOCAB, (2, 7), generator=g)
    feats = torch.randn(2, 7, 48, generator=g)
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        # Unmasked: identical to the drafter's own forward.
        cache = transformers.DynamicCache()
        full = drafter(ids, feats, pos, cache=transformers.DynamicCache())
        torch.testing.assert_close(drafter(ids, feats, pos, cache=cache), full)
        # Row 0 holds junk at columns 2 and 4 (hidden); its other columns carry positions 0..4.
        keep = torch.tensor([0, 1, 3, 5, 6])
        junk_ids, junk_feats = ids.clone(), feats.clone()
        junk_ids[0, [2, 4]] = 1
        junk_feats[0, [2, 4]] = 9.0
        junk_pos = pos.clone()
        junk_pos[0, keep] = torch.arange(5)
        mask = torch.ones(2, 7, dtype=torch.bool)
        mask[0, [2, 4]] = False
        cache = transformers.DynamicCache()
        out = drafter(junk_ids[:, :5], junk_feats[:, :5], junk_pos[:, :5], cache=cache, attention_mask=mask[:, :5])
        out2 = drafter(junk_ids[:, 5:], junk_feats[:, 5:], junk_pos[:, 5:], cache=cache, attention_mask=mask)
        alone = drafter(ids[:1, keep], feats[:1, keep], torch.arange(5)[None])
        torch.testing.assert_close(torch.cat([out, out2], 1)[0, keep], alone[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat([out, out2], 1)[1], full[1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- sampling: the target's distribution

SAMPLE_VOCAB, SAMPLES_PER_PROMPT, DEPTH = 8, 10_000, 3


@pytest.fixture(scope="module")
def sampling_setup():
    target = _tiny_llama(SAMPLE_VOCAB, 32, seed=10)
    torch.manual_seed(11)
    drafter = Drafter.from_target(target)
    prompts = [torch.tensor([1, 5, 2]), torch.tensor([7, 3, 3, 0, 6, 4])]
    return target, drafter, prompts


@torch.no_grad()
def _exact_joint(target, prompt, params: SamplingParams) -> torch.Tensor:
    """P(first DEPTH=3 tokens) (V, V, V) under temperature/top-p, by enumerating every prefix."""
    V = SAMPLE_VOCAB

    def probs(logits):
        return processed_logits(logits.float(), params).softmax(-1)

    p1 = probs(target(prompt[None]).logits[:, -1])[0]  # (V,)
    t1, t2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    seqs = torch.cat([prompt.expand(V * V, -1), t1.reshape(-1, 1), t2.reshape(-1, 1)], dim=1)
    logits = target(seqs).logits
    p2 = probs(logits[::V, -2])  # rows t2 = 0: the position after t1, (V, V)
    p3 = probs(logits[:, -1]).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi_square_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test; cells expecting fewer than 5 are pooled. Wilson-Hilferty for the chi-square tail."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    small = expected < 5
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    if expected[-1] == 0:
        assert counts[-1] == 0, "a token sequence of probability 0 was sampled"
        counts, expected = counts[:-1], expected[:-1]
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _sampled_pvalues(setup, temperature, top_p, draft_len, draft_vocab=None, seed=0, top_k=0):
    target, drafter, prompts = setup
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    rows = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
    stats = SpecStats()
    out = speculative_generate(target, drafter, rows, DEPTH, temperature=temperature, top_p=top_p,
                               draft_len=draft_len, generator=torch.Generator().manual_seed(seed),
                               draft_vocab=draft_vocab, stats=stats, top_k=top_k)
    assert out.shape == (len(rows), DEPTH)
    pvalues = []
    for i, prompt in enumerate(prompts):
        sample = out[i * SAMPLES_PER_PROMPT:(i + 1) * SAMPLES_PER_PROMPT]
        cells = (sample[:, 0] * SAMPLE_VOCAB + sample[:, 1]) * SAMPLE_VOCAB + sample[:, 2]
        counts = torch.bincount(cells, minlength=SAMPLE_VOCAB ** DEPTH)
        pvalues.append(_chi_square_pvalue(counts, SAMPLES_PER_PROMPT * _exact_joint(target, prompt, params)))
    return pvalues, stats


CASES = {
    "t1": {"temperature": 1.0, "top_p": 1.0, "draft_len": 2},
    "t0.7-top_p0.8": {"temperature": 0.7, "top_p": 0.8, "draft_len": 3},
    "t0.8-top_k4-top_p0.9": {"temperature": 0.8, "top_p": 0.9, "top_k": 4, "draft_len": 2},
    "draft-vocab": {"temperature": 1.0, "top_p": 1.0, "draft_len": 2, "draft_vocab": torch.tensor([0, 2, 3, 5, 6])},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_tokens_follow_target_distribution(sampling_setup, case):
    pvalues, stats = _sampled_pvalues(sampling_setup, **CASES[case])
    # Both rules of the round were used: some drafts kept, some rejected.
    assert 0.2 < stats.acceptance < 0.9, stats
    assert min(pvalues) > 1e-3, pvalues


def _always_accept(p, q, drafts, generator):
    """WRONG: keep every draft (output follows the drafter), bonus token from p."""
    accepted = torch.full((p.shape[0],), drafts.shape[1], dtype=torch.long)
    return accepted, torch.multinomial(p[:, -1], 1, generator=generator)[:, 0]


def _resample_from_p(p, q, drafts, generator):
    """WRONG: the right acceptance test, but a rejection resamples from p instead of norm(max(0, p - q))."""
    rows = torch.arange(p.shape[0])
    index = drafts[..., None]
    p_draft, q_draft = p[:, :-1].gather(2, index)[..., 0], q.gather(2, index)[..., 0]
    u = torch.rand(p_draft.shape, generator=generator)
    accepted = (u * q_draft < p_draft).long().cumprod(1).sum(1)
    return accepted, torch.multinomial(p[rows, accepted], 1, generator=generator)[:, 0]


@pytest.mark.parametrize("wrong", [_always_accept, _resample_from_p], ids=["always-accept", "resample-from-p"])
def test_wrong_acceptance_rule_fails_the_same_test(sampling_setup, monkeypatch, wrong):
    monkeypatch.setattr(speculative, "_accept_sampled", wrong)
    pvalues, _ = _sampled_pvalues(sampling_setup, **CASES["t1"])
    assert min(pvalues) < 1e-6, pvalues


# ---------------------------------------------------------------- the bandit


def test_bandit_converges_to_best_arm_per_bucket():
    g = torch.Generator().manual_seed(0)
    # Synthetic tokens/s: batch 1 peaks at draft length 5, batch 8 at 2; noise is 20% of the mean.
    curves = {1: {2: 20.0, 3: 24.0, 4: 27.0, 5: 30.0, 6: 28.0, 8: 22.0},
              8: {2: 60.0, 3: 55.0, 4: 50.0, 5: 45.0, 6: 40.0, 8: 30.0}}
    bandit = DraftLengthBandit(seed=1)
    pulls = {b: {} for b in curves}
    for _ in range(1500):
        for batch_size, curve in curves.items():
            arm = bandit.choose(batch_size)
            pulls[batch_size][arm] = pulls[batch_size].get(arm, 0) + 1
            rate = curve[arm] * (1 + 0.2 * torch.randn((), generator=g).item())
            bandit.update(batch_size, arm, tokens=rate * 0.5, seconds=0.5)
    assert bandit.best(1) == 5 and bandit.best(8) == 2
    assert pulls[1][5] > 0.5 * 1500 and pulls[8][2] > 0.5 * 1500, pulls
    assert bandit.bucket(7) == bandit.bucket(5) == 8 and bandit.bucket(1) == 1


def test_bandit_is_deterministic_given_seed_and_rewards():
    def run(seed):
        bandit, chosen = DraftLengthBandit(arms=(1, 2, 4, 8), seed=seed), []
        for step in range(40):
            arm = bandit.choose(1)
            chosen.append(arm)
            bandit.update(1, arm, tokens=arm * (1 + step % 3), seconds=1.0 + arm / 4)
        return chosen

    assert run(4) == run(4)
    assert run(4)[:4] != run(5)[:4] or run(4)[:4] != run(6)[:4]  # the first pulls follow the seed
    for arms in ((-1, 2), (2, 2), ()):
        with pytest.raises(ValueError):
            DraftLengthBandit(arms=arms)
