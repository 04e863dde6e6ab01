"""The real vLLM engine (rollout.engine=vllm; vLLM's CPU build in .venv-vllm, started by
these tests): it serves a run's hf/ folder as transformers computes it, samples rollout
trees with the HF engine's semantics, follows the policy's updates in memory, and
speculates with an exported drafter losslessly, accepting what lsreplay measures for the
same drafter."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lsreplay.core.storage import Store
from lsreplay.drafter import Drafter
from lsreplay.drafter.export import load_hf, save_hf
from lsreplay.models.distribution import RAW, SamplingParams, token_logprobs
from lsreplay.rollout.speculative import SpecStats, speculative_generate
from lsreplay.rollout.vllm_engine import SHARED_MEMORY, EngineSpec, VLLMEngine
from vllm_models import VLLM_PYTHON, held_out_prompts, needs_vllm, vllm_installed, vllm_model_dir  # noqa: F401
from vllm_models import vllm_trained_drafter  # noqa: F401

pytestmark = needs_vllm


def spec(model_dir, **kw) -> EngineSpec:
    return EngineSpec(python=VLLM_PYTHON, model=str(model_dir), dtype="float32", seed=0, max_model_len=256,
                      kv_cache_gb=0.25, gpu_memory_utilization=0.3, enforce_eager=True, threads=1, device="cpu", **kw)


@pytest.fixture(scope="module")
def trained_hf(vllm_trained_drafter):
    """The hf/ folder of a run's policy checkpoint (a tiny run's, after one update)."""
    return vllm_trained_drafter[0]


@pytest.fixture(scope="module")
def engine(trained_hf):
    engine = VLLMEngine(spec(trained_hf))
    yield engine
    engine.close()


def hf_greedy(model, prompts, tokens: int, eos: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)[0, len(p):].tolist()
        out.append(ids)
    return out


def teacher_forced(model, prompt, completion, sampling: SamplingParams = RAW) -> torch.Tensor:
    """Each completion token's logprob under the distribution `sampling` draws from."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    return token_logprobs(logits, torch.tensor(completion), sampling)


def test_vllm_serves_the_checkpoint_folder_as_transformers_computes_it(engine, trained_hf, vllm_model_dir):
    served = AutoModelForCausalLM.from_pretrained(trained_hf, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir, local_files_only=True)
    prompts, eos = held_out_prompts(vllm_model_dir, 4), served.generation_config.eos_token_id
    tokens, logprobs = engine.generate(prompts, 24, [eos])
    assert tokens == hf_greedy(served, prompts, 24, eos)
    for p, t, lp in zip(prompts, tokens, logprobs):
        assert torch.allclose(torch.tensor(lp), teacher_forced(served, p, t), atol=1e-4)
        # the trained policy's logprobs, not the base model's
        assert (torch.tensor(lp) - teacher_forced(base, p, t)).abs().max() > 1e-3


def test_trees_follow_the_hf_engines_semantics(engine, trained_hf, vllm_model_dir):
    served = AutoModelForCausalLM.from_pretrained(trained_hf, local_files_only=True)
    prompts = held_out_prompts(vllm_model_dir, 3)
    eos = served.generation_config.eos_token_id
    sampled = []
    trees, figures = engine.sample_trees(prompts, [3, 2], [4], 12, temperature=1.0, top_p=1.0, top_k=0, eos=[eos],
                                         progress=sampled.append)
    assert sum(sampled) == figures["generated_positions"] > 0
    # Every branch continues its parent's tokens from the prefix cache: the prompt is computed once.
    assert figures["cached_positions"] >= (len(trees) * 5 * 32) * 0.5
    for prompt, tree in zip(prompts, trees):
        assert sum(tree.counts) == 6 and tree.paths == sorted(tree.paths)
        for path, count, completion, logprobs, finished in zip(tree.paths, tree.counts, tree.completions,
                                                             tree.logprobs, tree.finished):
            assert count == math.prod([3, 2][len(path):])
            assert finished == (completion[-1] == eos) and (finished or len(completion) == 12)
            assert len(path) == 2 or len(completion) <= 4  # a leaf above the last level ended early
            assert torch.allclose(torch.tensor(logprobs), teacher_forced(served, prompt, completion), atol=1e-4)
        siblings = [c[:4] for path, c in zip(tree.paths, tree.completions) if path[0] == tree.paths[-1][0]]
        assert all(s == siblings[0] for s in siblings)  # children share their parent's segment


def test_tree_logprobs_are_those_of_the_tempered_truncated_distribution(engine, trained_hf, vllm_model_dir):
    """vLLM reports each sampled token's processed logprob (temperature, top-k, top-p), the
    one lsreplay's trainer scores: equal to it, and not to the raw one."""
    served = AutoModelForCausalLM.from_pretrained(trained_hf, local_files_only=True)
    prompts = held_out_prompts(vllm_model_dir, 3)
    eos = served.generation_config.eos_token_id
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=20)
    trees, _ = engine.sample_trees(prompts, [2, 2], [4], 12, temperature=0.7, top_p=0.9, top_k=20, eos=[eos])
    raw_gaps = []
    for prompt, tree in zip(prompts, trees):
        for completion, logprobs in zip(tree.completions, tree.logprobs):
            engine_lp = torch.tensor(logprobs)
            assert torch.allclose(engine_lp, teacher_forced(served, prompt, completion, sampling), atol=1e-4)
            raw_gaps.append((engine_lp - teacher_forced(served, prompt, completion)).abs().max())
    assert max(raw_gaps) > 1e-2


def test_engine_takes_an_update_in_memory(engine, trained_hf, vllm_model_dir):
    prompts = held_out_prompts(vllm_model_dir, 2)
    eos = AutoModelForCausalLM.from_pretrained(trained_hf).generation_config.eos_token_id
    before_tokens, before = engine.generate(prompts, 12, [eos])
    updated = AutoModelForCausalLM.from_pretrained(trained_hf, local_files_only=True)
    with torch.no_grad():
        for p in updated.parameters():  # the embedding too: it is also the (tied) LM head
            p.mul_(1.05)
    engine.load_policy(updated)
    tokens, after = engine.generate(prompts, 12, [eos])
    for p, t, lp, old in zip(prompts, tokens, after, before):
        assert torch.allclose(torch.tensor(lp), teacher_forced(updated, p, t), atol=1e-4)
    assert (tokens, after) != (before_tokens, before)
    engine.load_policy(AutoModelForCausalLM.from_pretrained(trained_hf))  # back, for the other tests
    assert engine.generate(prompts, 12, [eos]) == (before_tokens, before)


def _acceptance(counters_before: dict, counters_after: dict) -> float:
    drafted = counters_after["draft_tokens"] - counters_before["draft_tokens"]
    return (counters_after["accepted_tokens"] - counters_before["accepted_tokens"]) / drafted


def test_speculation_with_a_run_trained_drafter_is_lossless_and_accepts_what_lsreplay_measures(
        engine, vllm_trained_drafter, vllm_model_dir, tmp_path):
    """The drafter a run trained, exported, in vLLM: greedy output as without it; vLLM's
    acceptance on held-out prompts as lsreplay's own speculative decoding measures it for
    the same drafter, and far above an untrained drafter's (loaded in place)."""
    target_dir, drafter_dir = vllm_trained_drafter
    target = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True).eval()
    eos = target.generation_config.eos_token_id
    prompts, k = held_out_prompts(vllm_model_dir, 8, offset=100), 3
    speculating = VLLMEngine(spec(target_dir, drafter=str(drafter_dir), draft_tokens=k, spec_threshold=64))
    plain = VLLMEngine(spec(target_dir)) if target_dir != engine.spec.model else engine
    try:
        before = speculating.spec_counters()
        tokens, _ = speculating.generate(prompts, 32, [eos])
        vllm_trained = _acceptance(before, speculating.spec_counters())
        assert tokens == plain.generate(prompts, 32, [eos])[0]

        drafter = load_hf(Store(str(drafter_dir.parent)), drafter_dir.name, target)
        stats = SpecStats()
        for p in prompts:
            out = speculative_generate(target, drafter, [p], 32, temperature=0.0, draft_len=k, eos_token_id=eos,
                                       stats=stats)[0].tolist()
            assert out[:len(tokens[prompts.index(p)])] == tokens[prompts.index(p)]
        assert abs(vllm_trained - stats.acceptance) <= 0.05, (vllm_trained, stats.acceptance)

        untrained = tmp_path / "untrained"
        save_hf(Store(str(tmp_path)), "untrained", Drafter.from_target(target))
        speculating.load_drafter(str(untrained))
        before = speculating.spec_counters()
        assert speculating.generate(prompts, 32, [eos])[0] == tokens
        vllm_untrained = _acceptance(before, speculating.spec_counters())
        assert vllm_trained > vllm_untrained + 0.3, (vllm_trained, vllm_untrained)
        print(f"acceptance: vLLM {vllm_trained:.3f}, lsreplay {stats.acceptance:.3f}, untrained {vllm_untrained:.3f}")
        # A close with no call in flight: the engine process exits at once with status 0, and
        # Intel OpenMP's registration (where it is preloaded) goes with it.
        registration = Path(SHARED_MEMORY, f"__KMP_REGISTERED_LIB_{speculating.pid}_0")
        registered = registration.exists()
        started = time.monotonic()
        speculating.close()
        assert speculating._process.returncode == 0 and time.monotonic() - started < 2, speculating._process.returncode
        assert not registration.exists(), registered
    finally:
        speculating.close()
        if plain is not engine:
            plain.close()
