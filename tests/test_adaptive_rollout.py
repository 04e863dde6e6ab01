"""The adaptive rollout engine: the tree sampler hands its long tail over to speculative decoding.

One tiny float64 Llama and a drafter distilled on its own sampled rollouts serve every
test. Greedy trees must equal plain trees token for token; the handoff re-encodes
nothing; every token's recorded logprob is the raw policy's; the trace logs the switch
and the bandit's draft lengths.
"""

import json
import logging
import math

import pytest
import torch
from conftest import tiny_model
from test_speculative import (
    DEPTH,
    SAMPLE_VOCAB,
    _chi_square_pvalue,
    _exact_joint,
    _tiny_llama,
)

from lsreplay.drafter.distill import distill
from lsreplay.drafter.model import Drafter
from lsreplay.rollout.bandit import DraftLengthBandit
from lsreplay.models.distribution import SamplingParams
from lsreplay.rollout.tree_sampler import Speculation, sample_tree, sample_trees

VOCAB, BRANCHING, SEGMENT, MAX_NEW = 64, [2, 2], [4], 20
PROMPT_LENGTHS = (5, 11, 17, 8, 3, 14, 9, 6)  # 8 trees of 4 leaves: 32 rows at the last level
# End tokens, picked for this model: greedy, 2 of the 8 trees end in the last level (32 -> 24
# rows); sampled at temperature 1, lengths spread from 2 to the cap.
GREEDY_EOS, SAMPLED_EOS = [21], [17, 49]
GREEDY_THRESHOLD, SAMPLED_THRESHOLD = 24, 20
GREEDY, SAMPLED = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def setup():
    target = tiny_model("llama", vocab=VOCAB, tie_word_embeddings=True, initializer_range=0.2)
    with torch.no_grad():
        # A larger-norm tied embedding makes the next token depend on the context, as in a
        # trained LM, so that a drafter has something to learn (see test_drafter).
        target.get_input_embeddings().weight.normal_(std=0.5)
    g = torch.Generator().manual_seed(2)
    train = [torch.randint(VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (128,), generator=g)]
    trees, _ = sample_trees(target, train, [2], [], 24, SAMPLED, VOCAB + 1,
                            [torch.Generator().manual_seed(i) for i in range(len(train))])
    paths = [torch.tensor(prompt + c) for prompt, tree in zip(train, trees) for c in tree.completions]
    with torch.no_grad():
        sequences = [(ids, target.base_model(ids[None]).last_hidden_state[0]) for ids in paths]
    torch.manual_seed(1)
    drafter = Drafter.from_target(target)
    distill(drafter, sequences, steps=200, lr=3e-3, batch_size=32, generator=torch.Generator().manual_seed(0),
            progress=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    return target, drafter.eval(), prompts


def _trees(setup, params, eos, speculation=None, seed=0, progress=None, share_prompt=None):
    target, _, prompts = setup
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    return sample_trees(target, prompts, BRANCHING, SEGMENT, MAX_NEW, params, eos, generators, progress, speculation,
                        share_prompt)


def _spec_start(trace) -> int:
    """Index of the first speculative step; the trace must be plain steps then spec steps."""
    start = trace.mode.index("spec")
    assert trace.mode == ["plain"] * start + ["spec"] * (len(trace.mode) - start)
    return start


def _teacher_forced_logprobs(target, prompt, completion, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Each token's logprob under softmax(logits / temperature) cut to its top-p nucleus (the
    tokens whose higher-ranked ones cover less than top_p), renormalised."""
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].double()
    logits = logits / temperature
    ranked, order = logits.softmax(-1).sort(-1, descending=True)
    outside = torch.zeros_like(ranked, dtype=torch.bool).scatter(-1, order, ranked.cumsum(-1) - ranked >= top_p)
    return torch.log_softmax(logits.masked_fill(outside, float("-inf")), -1).gather(
        -1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("draft_len,draft_vocab", [(1, None), (3, None), ((1, 2, 4), range(0, VOCAB, 2)),
                                                    ((0, 1, 3), None)],
                         ids=["k1", "k3", "bandit-half-vocab", "bandit-with-0"])
def test_greedy_adaptive_trees_equal_plain_trees(setup, draft_len, draft_vocab):
    drafter = setup[1]
    policy = DraftLengthBandit(arms=draft_len, seed=1) if isinstance(draft_len, tuple) else draft_len
    vocab = None if draft_vocab is None else list(draft_vocab)
    plain, _ = _trees(setup, GREEDY, GREEDY_EOS)
    adaptive, trace = _trees(setup, GREEDY, GREEDY_EOS, Speculation(drafter, GREEDY_THRESHOLD, policy, vocab))
    spec = _spec_start(trace)
    assert spec > SEGMENT[0] + 1, "some rows should finish in plain mode after the last fork"
    assert 0 < trace.spec.accepted < trace.spec.drafted, "drafts must be both accepted and rejected"
    for a, p in zip(adaptive, plain):
        assert a.completions == p.completions and a.finished == p.finished
        for lp_a, lp_p in zip(a.logprobs, p.logprobs):
            torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_p), atol=1e-6, rtol=0)
    assert {True, False} == {f for t in adaptive for f in t.finished}


@pytest.mark.parametrize("share_prompt", [True, False], ids=["shared-prompts", "repeated-prompts"])
def test_handoff_reencodes_nothing(setup, share_prompt):
    """Target forwards: the adaptive run's are the plain run's up to the switch, then verify blocks only."""
    target, drafter, prompts = setup
    calls = []
    hook = target.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        plain, _ = _trees(setup, GREEDY, GREEDY_EOS, share_prompt=share_prompt)
        plain_calls, calls[:] = list(calls), []
        adaptive, trace = _trees(setup, GREEDY, GREEDY_EOS, Speculation(drafter, GREEDY_THRESHOLD, 3),
                                 share_prompt=share_prompt)
    finally:
        hook.remove()
    spec = _spec_start(trace)
    # The prefill: each prompt on its own where they are shared, all in one batch otherwise.
    prefill = len(prompts) if share_prompt else 1
    assert calls[:prefill] == ([(1, len(p)) for p in prompts] if share_prompt else [(len(prompts), max(PROMPT_LENGTHS))])
    # Then one forward per plain step, except the switching step, which encodes nothing.
    switch = prefill + spec - 1
    assert calls[:switch] == plain_calls[:switch]
    assert calls[switch:] == [(trace.live[i], trace.draft_len[i] + 1) for i in range(spec, len(trace.mode))]
    # forward_positions counts each prompt's real tokens, not the prefill's left padding.
    for trees, forwards in ((adaptive, calls), (plain, plain_calls)):
        prompts = sum(len(t.prompt_ids) for t in trees)
        assert sum(t.forward_positions for t in trees) == prompts + sum(r * w for r, w in forwards[prefill:])


def test_spec_tokens_carry_teacher_forced_logprobs(setup):
    target, drafter, prompts = setup
    params = SamplingParams(temperature=0.7, top_p=0.9)
    trees, trace = _trees(setup, params, SAMPLED_EOS, Speculation(drafter, SAMPLED_THRESHOLD, 3), seed=10)
    assert trace.summary([1])["spec_tokens"] > 20
    assert 0 < trace.spec.accepted < trace.spec.drafted, "accepted drafts and resampled tokens both occur"
    for prompt, tree in zip(prompts, trees):
        for completion, recorded in zip(tree.completions, tree.logprobs):
            expected = _teacher_forced_logprobs(target, prompt, completion, params.temperature, params.top_p)
            # The distribution sampled from, recorded in float32; the reference in float64.
            torch.testing.assert_close(torch.tensor(recorded, dtype=torch.float64), expected, atol=2e-6, rtol=0)


def test_trace_logs_the_switch_and_the_bandit_choices(setup, caplog):
    drafter = setup[1]
    bandit = DraftLengthBandit(arms=(1, 2, 4), seed=0)
    progress = []
    with caplog.at_level(logging.INFO, logger="lsreplay.rollout.tree_sampler"):
        trees, trace = _trees(setup, SAMPLED, SAMPLED_EOS, Speculation(drafter, SAMPLED_THRESHOLD, bandit),
                              seed=1, progress=progress.append)
    spec = _spec_start(trace)
    lengths = [len(c) for t in trees for c in t.completions]
    # Plain until the live count after a step of the last level falls to the threshold.
    first_last_level = SEGMENT[0] + 1
    assert all(live > SAMPLED_THRESHOLD for live in trace.live[first_last_level:spec])
    assert trace.live[spec] <= SAMPLED_THRESHOLD and trace.draft_len[:spec] == [0] * spec
    assert trace.tokens[:spec] == trace.live[:spec]
    # One bandit decision per round; near the cap a round may draft fewer than the chosen arm.
    assert len(bandit.history) == len(trace.mode) - spec
    for k, (bucket, arm, _) in zip(trace.draft_len[spec:], bandit.history):
        assert 1 <= k <= arm and arm in bandit.arms
    assert [bucket for bucket, _, _ in bandit.history] == [bandit.bucket(n) for n in trace.live[spec:]]
    assert sum(trace.tokens) == sum(progress)
    # At the switch every row holds `spec` tokens; the rounds emitted the rest.
    assert sum(trace.tokens[spec:]) == sum(n - spec for n in lengths if n > spec)
    summary = trace.summary(lengths)
    assert summary["spec_rounds"] == len(trace.mode) - spec
    assert summary["spec_tokens"] == sum(trace.tokens[spec:])
    assert summary["accept_len"] == pytest.approx(sum(trace.tokens[spec:]) / sum(trace.live[spec:]))
    assert summary["accept_len"] > 1 and 0 < summary["spec_time_share"] < 1
    plain_keys = {"length_p50", "length_p90", "length_max", "decode_seconds", "tail_time_share", "decode_steps"}
    assert plain_keys <= set(summary)
    decisions = json.loads(json.dumps(trace.decisions()))
    assert [d["mode"] for d in decisions] == trace.mode and decisions[spec]["draft_len"] == trace.draft_len[spec]
    assert set(decisions[0]) == {"step", "mode", "draft_len", "live", "tokens", "seconds", "finished"}
    switch = [r.getMessage() for r in caplog.records if "speculative decoding on" in r.getMessage()]
    assert len(switch) == 1
    assert f"at {trace.live[spec]} live" in switch[0] and f"threshold {SAMPLED_THRESHOLD}" in switch[0]


def test_sampled_adaptive_rollouts_end_properly_and_repeat_with_fixed_draft_len(setup):
    drafter = setup[1]
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95)
    speculation = Speculation(drafter, 28, 2)
    trees, trace = _trees(setup, params, SAMPLED_EOS, speculation, seed=20)
    again, _ = _trees(setup, params, SAMPLED_EOS, speculation, seed=20)
    assert trace.summary([1])["spec_rounds"] > 0
    assert [t.completions for t in trees] == [t.completions for t in again]
    for tree in trees:
        assert 1 <= len(tree.completions) <= 4  # a branch that ends before the fork is a lone leaf
        for completion, logprobs, finished in zip(tree.completions, tree.logprobs, tree.finished):
            assert len(logprobs) == len(completion) <= MAX_NEW and all(math.isfinite(x) and x <= 0 for x in logprobs)
            assert finished == (completion[-1] in SAMPLED_EOS) and (finished or len(completion) == MAX_NEW)
            assert not set(completion[:-1]) & set(SAMPLED_EOS)


def test_single_level_tree_switches_at_once(setup):
    """No fork pending from the start: with a high threshold the first step hands over."""
    target, drafter, prompts = setup
    tree = sample_tree(target, prompts[2], [4], [], MAX_NEW, SAMPLED, SAMPLED_EOS, torch.Generator().manual_seed(3),
                       speculation=Speculation(drafter, 8, 4))
    for completion, recorded in zip(tree.completions, tree.logprobs):
        expected = _teacher_forced_logprobs(target, prompts[2], completion)
        torch.testing.assert_close(torch.tensor(recorded, dtype=torch.float64), expected, atol=2e-6, rtol=0)


def test_bad_speculation_arguments(setup):
    target, drafter, prompts = setup
    with pytest.raises(ValueError, match="threshold"):
        Speculation(drafter, 0)
    with pytest.raises(ValueError, match="draft_len"):
        Speculation(drafter, 4, 0)
    with pytest.raises(ValueError, match="same SamplingParams"):
        sample_trees(target, prompts[:2], [2], [], 8, [GREEDY, SAMPLED], SAMPLED_EOS,
                     [torch.Generator(), torch.Generator()], speculation=Speculation(drafter, 4))


@pytest.mark.parametrize("arms", [(2,), (0,)], ids=["k2", "k0"])
def test_sampled_adaptive_tokens_follow_the_policy(arms):
    """Tokens 2-3 of every leaf come from speculative rounds after the handoff (k = 0: rounds
    without drafts): their joint distribution is still the policy's (chi-square against
    enumeration, as in test_speculative)."""

    target = _tiny_llama(SAMPLE_VOCAB, 32, seed=10)
    torch.manual_seed(11)
    drafter = Drafter.from_target(target)
    prompt, rows = [7, 3, 3, 0, 6, 4], 10_000
    params = SamplingParams(temperature=0.8, top_p=0.9)
    # EOS outside the vocabulary: every leaf runs to DEPTH tokens.
    trees, trace = sample_trees(target, [prompt], [rows], [], DEPTH, params, SAMPLE_VOCAB,
                                [torch.Generator().manual_seed(0)],
                                speculation=Speculation(drafter, rows, DraftLengthBandit(arms=arms)))
    assert trace.mode[0] == "plain" and set(trace.mode[1:]) == {"spec"}
    assert 0 < trace.spec.accepted < trace.spec.drafted if arms[0] else trace.spec.drafted == 0
    sample = torch.tensor(trees[0].completions)
    cells = (sample[:, 0] * SAMPLE_VOCAB + sample[:, 1]) * SAMPLE_VOCAB + sample[:, 2]
    counts = torch.bincount(cells, minlength=SAMPLE_VOCAB ** DEPTH)
    assert _chi_square_pvalue(counts, rows * _exact_joint(target, torch.tensor(prompt), params)) > 1e-3
