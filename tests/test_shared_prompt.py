"""Rollouts that attend to one copy of each prompt's K/V (rollout.shared_prompt) sample what the
repeated layout samples: the same tokens and, up to floating-point rounding, the same logprobs.

The shared layout merges a prompt part and an own part by their log-sum-exp where the
repeated layout runs one softmax over [prompt; completion]: the same sums in another order,
so bitwise-equal logprobs are not to be had. In float64 (RMSNorm too, `exact_rmsnorm`) they
agree to 1e-12, and every token drawn is the same, greedy and sampled, plain and speculative.
"""

import logging

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

from lsreplay.drafter.model import Drafter
from lsreplay.models.distribution import SamplingParams
from lsreplay.models.hf_compat import with_cache
from lsreplay.rollout import shared_prompt, tree_sampler
from lsreplay.rollout.shared_prompt import SharedPrompts, attending, attention_inputs, encode_prompt, shares_prompt
from lsreplay.rollout.tree_sampler import Speculation, sample_trees
from lsreplay.replay.memory import ModelDims, kv_bytes_per_position

VOCAB = 64
PROMPT_LENGTHS = (9, 23, 4, 16)
BRANCHING, SEGMENT, MAX_NEW = [2, 3], [5], 14
EOS = [3, 11]  # ends some rows early at temperature 1, so rows leave the batch between forks
GREEDY, SAMPLED, NUCLEUS = SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)
LOGPROB_TOLERANCE = 1e-12


def _prompts(lengths=PROMPT_LENGTHS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (n,), generator=g).tolist() for n in lengths]


def _trees(model, prompts, params, share_prompt, speculation=None, seed=0):
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    return sample_trees(model, prompts, BRANCHING, SEGMENT, MAX_NEW, params, EOS, generators,
                        speculation=speculation, share_prompt=share_prompt)


def _assert_same_trees(shared, repeated) -> None:
    for s, r in zip(shared, repeated):
        assert s.completions == r.completions and s.finished == r.finished and s.paths == r.paths
        assert s.forward_positions == r.forward_positions
        for lp_s, lp_r in zip(s.logprobs, r.logprobs):
            torch.testing.assert_close(torch.tensor(lp_s, dtype=torch.float64), torch.tensor(lp_r, dtype=torch.float64),
                                       atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED, NUCLEUS], ids=["greedy", "sampled", "nucleus"])
def test_trees_equal_those_of_the_repeated_layout(exact_rmsnorm, arch, params):
    model = tiny_model(arch, vocab=VOCAB, initializer_range=0.2)
    prompts = _prompts()
    assert shares_prompt(model)
    shared, shared_trace = _trees(model, prompts, params, share_prompt=None)  # shared wherever the model allows it
    repeated, repeated_trace = _trees(model, prompts, params, share_prompt=False)
    _assert_same_trees(shared, repeated)
    if params is not GREEDY:
        assert {True, False} == {f for t in shared for f in t.finished}, "rows must end early and run to the cap"
    assert shared_trace.kv_bytes_peak < repeated_trace.kv_bytes_peak


@pytest.mark.parametrize("params", [GREEDY, NUCLEUS], ids=["greedy", "nucleus"])
def test_speculative_tail_equals_that_of_the_repeated_layout(exact_rmsnorm, params):
    """The handoff takes the shared prompts along: the drafter encodes each prompt once and the
    verify blocks (holes where drafts were rejected) attend to the one copy. (At this init an
    untrained drafter's proposals are often the target's greedy tokens.)"""
    model = tiny_model("llama", vocab=VOCAB, initializer_range=0.1)
    torch.manual_seed(1)
    drafter = Drafter.from_target(model)
    # A one-token prompt gives the drafter no prompt pair of its own.
    prompts = _prompts((9, 1, 23, 16))
    speculation = Speculation(drafter, threshold=16, draft_len=3)
    shared, trace = _trees(model, prompts, params, share_prompt=True, speculation=speculation, seed=4)
    repeated, repeated_trace = _trees(model, prompts, params, share_prompt=False, speculation=speculation, seed=4)
    assert "spec" in trace.mode and trace.spec.accepted == repeated_trace.spec.accepted
    assert trace.spec.drafted > trace.spec.accepted > 0, "drafts accepted and rejected: the verify caches have holes"
    _assert_same_trees(shared, repeated)


def test_attention_with_holes_and_blocks_matches_each_row_alone(exact_rmsnorm):
    """Rows of two trees: a block of own tokens (causal within it), then a verify block with a
    hidden column in one row, equal each row run alone over its whole sequence."""
    model = tiny_model("qwen2", vocab=VOCAB, initializer_range=0.2)
    prompts = _prompts((7, 12))
    trees = [0, 0, 1, 1, 1]
    own = torch.randint(VOCAB, (5, 3), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        shared = SharedPrompts([encode_prompt(model, p, keep_features=False)[0] for p in prompts], trees)
        cache = DynamicCache(config=model.config)

        def forward(ids, positions, mask):
            with attending(model.config, shared):
                return model.base_model(input_ids=ids, position_ids=positions, use_cache=True,
                                        **attention_inputs(shared, mask), **with_cache(cache)).last_hidden_state

        first = forward(own, shared.lengths[:, None] + torch.arange(3), None)
        mask = torch.ones(5, 5, dtype=torch.bool)
        mask[1, 2] = False  # row 1's third own token was a rejected draft
        block = forward(own[:, :2], shared.lengths[:, None] + 3 + torch.arange(2), mask)
        for row, tree in enumerate(trees):
            prompt, tokens = prompts[tree], own[row].tolist()
            kept = [0, 1] if row == 1 else [0, 1, 2]
            ids = prompt + [tokens[k] for k in kept] + tokens[:2]
            positions = list(range(len(prompt))) + [len(prompt) + k for k in kept] + [len(prompt) + 3, len(prompt) + 4]
            alone = model.base_model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]))
            alone = alone.last_hidden_state[0]
            torch.testing.assert_close(block[row], alone[-2:], atol=1e-12, rtol=0)
            if row != 1:
                torch.testing.assert_close(first[row], alone[len(prompt):len(prompt) + 3], atol=1e-12, rtol=0)


def test_kv_held_is_one_copy_per_prompt():
    """The peak K/V bytes: each prompt once plus every row's completion, where the repeated
    layout holds every row's left-padded prompt too."""
    model = tiny_model("llama", vocab=VOCAB, dtype=torch.float32)
    prompts = _prompts()
    no_eos = VOCAB + 1
    widest = len(prompts) * BRANCHING[0] * BRANCHING[1]  # every leaf live at the cap
    per_position = kv_bytes_per_position(ModelDims.from_hf(model.config), 4)
    for share, expected in ((True, sum(PROMPT_LENGTHS) + widest * (MAX_NEW - 1)),
                            (False, widest * (max(PROMPT_LENGTHS) + MAX_NEW - 1))):
        generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
        _, trace = sample_trees(model, prompts, BRANCHING, SEGMENT, MAX_NEW, SAMPLED, no_eos, generators,
                                share_prompt=share)
        assert trace.kv_bytes_peak == expected * per_position
        assert trace.summary([MAX_NEW])["kv_bytes_peak"] == trace.kv_bytes_peak


def test_a_long_prompt_is_encoded_in_chunks_with_progress(exact_rmsnorm, monkeypatch, caplog):
    """Each layout's prefill in chunks of 8 positions samples the trees one forward samples."""
    model = tiny_model("llama", vocab=VOCAB, initializer_range=0.2)
    prompts = _prompts((37, 10))
    whole, _ = _trees(model, prompts, SAMPLED, share_prompt=False)
    monkeypatch.setattr(shared_prompt, "PREFILL_CHUNK", 8)
    monkeypatch.setattr(tree_sampler, "PREFILL_CHUNK", 8)
    with caplog.at_level(logging.INFO, logger="lsreplay.rollout.shared_prompt"):
        shared, _ = _trees(model, prompts, SAMPLED, share_prompt=True)
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefill of prompt")]
    assert len(progress) == 5 + 2 and progress[-1].startswith("prefill of prompt 2/2: 10/10 positions")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lsreplay.rollout.shared_prompt"):
        chunked, _ = _trees(model, prompts, SAMPLED, share_prompt=False)
    # One batch of the prompts left-padded to 37 columns, 8 a forward.
    assert caplog.text.count("prefill of prompt 1/1: ") == 5 and "prefill of prompt 1/1: 37/37 positions" in caplog.text
    _assert_same_trees(shared, whole)
    _assert_same_trees(chunked, whole)


def test_models_without_a_kernel_keep_the_repeated_layout():
    model = tiny_model("llama", vocab=VOCAB, dtype=torch.float16)  # no cascade kernel for float16 on a CPU
    assert not shares_prompt(model)
    with pytest.raises(ValueError, match="cannot attend to a shared prompt"):
        _trees(model, _prompts(), GREEDY, share_prompt=True)
    trees, trace = _trees(model, _prompts(), GREEDY, share_prompt=None)
    assert all(len(c) >= 1 for t in trees for c in t.completions) and trace.kv_bytes_peak > 0
