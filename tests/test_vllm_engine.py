"""The vLLM engine where it could be wrong (a tied-embedding model, a stop that is not the
caller's EOS, a branch whose cached prefix holds its parent's generated tokens, tempered
logprobs, the context's end) and where it fails: a request that raises in the worker, a
hung worker past its deadline, a close while a call is in flight. Each failure closes the
engine; a fresh one gives correct trees."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lsreplay.models.distribution import SamplingParams, token_logprobs
from lsreplay.rollout.episodes import sample_episodes
from lsreplay.rollout.vllm_turns import VLLMTurns
from lsreplay.rollout.vllm_engine import EngineError, EngineSpec, VLLMEngine
from lsreplay.rollout.vllm_process import UNKNOWN_EXIT
from vllm_models import STOP, VLLM_PYTHON, needs_vllm, short_prompts, vllm_installed  # noqa: F401
from vllm_models import vllm_tied_model_dir  # noqa: F401

pytestmark = needs_vllm

BLOCK = 32  # vLLM's cache block on CPU (the worker sets it)
MAX_MODEL_LEN = 256


def spec(model_dir, **kw) -> EngineSpec:
    return EngineSpec(python=VLLM_PYTHON, model=str(model_dir), dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN,
                      kv_cache_gb=0.25, gpu_memory_utilization=0.3, enforce_eager=True, threads=1, device="cpu", **kw)


@pytest.fixture(scope="module")
def model(vllm_tied_model_dir):
    return AutoModelForCausalLM.from_pretrained(vllm_tied_model_dir, local_files_only=True).eval()


@pytest.fixture(scope="module")
def engine(vllm_tied_model_dir):
    engine = VLLMEngine(spec(vllm_tied_model_dir))
    yield engine
    engine.close()


def teacher_forced(model, prompt, completion, sampling: SamplingParams = SamplingParams()) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    return token_logprobs(logits, torch.tensor(completion), sampling)


def assert_logprobs_are_the_models(model, prompts, trees, sampling: SamplingParams = SamplingParams()) -> None:
    for prompt, tree in zip(prompts, trees):
        for completion, logprobs in zip(tree.completions, tree.logprobs):
            assert torch.allclose(torch.tensor(logprobs), teacher_forced(model, prompt, completion, sampling),
                                  atol=1e-4)


def test_the_tied_head_follows_an_update_of_the_embedding(engine, model, vllm_tied_model_dir):
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    prompts, eos = short_prompts(vllm_tied_model_dir, 3), model.generation_config.eos_token_id
    before = engine.generate(prompts, 12, eos)
    updated = AutoModelForCausalLM.from_pretrained(vllm_tied_model_dir, local_files_only=True).eval()
    with torch.no_grad():  # the embedding only: the head follows it, or vLLM's packed copy of it goes stale
        updated.get_input_embeddings().weight.mul_(1.1)
    engine.load_policy(updated)
    tokens, logprobs = engine.generate(prompts, 12, eos)
    for p, t, lp in zip(prompts, tokens, logprobs):
        assert torch.allclose(torch.tensor(lp), teacher_forced(updated, p, t), atol=1e-4)
    assert (tokens, logprobs) != before
    engine.load_policy(model)  # back, for the other tests
    assert engine.generate(prompts, 12, eos) == before


def test_a_stop_that_is_not_the_callers_eos_ends_a_leaf_before_its_branch_point(engine, model, vllm_tied_model_dir):
    """The model's generation config stops at STOP too; the caller names only EOS. A
    sequence that stops at STOP before its branch point is a finished leaf, never expanded."""
    eos = model.generation_config.eos_token_id[0]
    prompts = short_prompts(vllm_tied_model_dir, 8)
    trees, _ = engine.sample_trees(prompts, [2, 2], [4], 12, temperature=1.0, top_p=1.0, top_k=0, eos=[eos])
    stops, early = (eos, STOP), 0
    for tree in trees:
        assert sum(tree.counts) == 4
        for path, completion, finished in zip(tree.paths, tree.completions, tree.finished):
            assert not set(completion[:-1]) & set(stops), completion  # nothing continues past a stop
            assert finished == (completion[-1] in stops)
            early += len(path) == 1 and completion[-1] == STOP
    assert early > 0  # the case in point happened
    assert_logprobs_are_the_models(model, prompts, trees)


def test_branches_past_the_first_cache_block_reuse_their_parents_generated_tokens_at_a_low_temperature(
        engine, model, vllm_tied_model_dir):
    """Prompts shorter than a cache block, a branch point 24 tokens on: every second-level
    request is served one full block (prompt and parent's generated tokens) from the prefix
    cache; and each token's logprob is the tempered distribution's, not the raw one's."""
    prompts, eos = short_prompts(vllm_tied_model_dir, 4), model.generation_config.eos_token_id
    sampling = SamplingParams(temperature=0.6)
    trees, figures = engine.sample_trees(prompts, [2, 3], [24], 30, temperature=0.6, top_p=1.0, top_k=0, eos=eos)
    forks = sum(len({tuple(p[:1]) for p in tree.paths if len(p) == 2}) for tree in trees)
    assert forks > 0
    assert all(len(p) + 24 < 2 * BLOCK and len(p) < BLOCK for p in prompts)
    assert figures["cached_positions"] == forks * 3 * BLOCK
    assert_logprobs_are_the_models(model, prompts, trees, sampling)
    raw = max((torch.tensor(lp) - teacher_forced(model, p, c)).abs().max()
              for p, tree in zip(prompts, trees) for c, lp in zip(tree.completions, tree.logprobs))
    assert raw > 1e-2


def test_a_sequence_that_reaches_the_context_end_before_its_branch_point_is_a_leaf(engine, model):
    prompt, stops = list(range(1000, 1000 + MAX_MODEL_LEN - 3)), model.generation_config.eos_token_id
    [tree], _ = engine.sample_trees([prompt], [2, 2], [8], 12, temperature=1.0, top_p=1.0, top_k=0, eos=stops)
    assert tree.paths == [[0], [1]] and tree.counts == [2, 2]
    for completion, finished in zip(tree.completions, tree.finished):
        assert finished == (completion[-1] in stops) and (finished or len(completion) == 3)


# What the environment says after every reply: 28 tokens of a question (after which the tied
# model often stops at once, so that episodes reach their third turn).
ANSWER_TEXT = "Wrong, try again. Question 9: what is 9 times 21? And what is 4 times 2?"


def reply_starts(flags: list[bool]) -> list[int]:
    """Where an episode's replies after its first start: after each run of the environment's tokens."""
    return [i for i in range(1, len(flags)) if flags[i] and not flags[i - 1]]


def cache_floor(prompts, trees, branching: list[int], answer: int, turn: int) -> tuple[int, int]:
    """The positions vLLM's prefix cache serves the requests of `turn` (from 1) at least, and
    how many requests there were: per request, the full cache blocks of its history less the
    environment's last answer (`answer` tokens), all of which the turn before computed (all
    but its reply's last token)."""
    floor, count = 0, 0
    for prompt, tree in zip(prompts, trees):
        requests = {tuple(c[:reply_starts(f)[turn - 1]]) for c, f, t in zip(tree.completions, tree.sampled, tree.turns)
                    if t > turn}
        fan_out = branching[turn] if turn < len(branching) else 1
        floor += fan_out * sum(BLOCK * ((len(prompt) + len(r) - answer - 1) // BLOCK) for r in requests)
        count += fan_out * len(requests)
    return floor, count


class Answering:
    """An environment that answers every reply with `answer` (the sampler's EpisodeEnvironment)."""

    def __init__(self, answer: list[int]):
        self.answer = answer

    def root(self, tree):
        return tree

    def branch(self, parent, last):
        return parent

    def respond(self, state, reply, completion, ending):
        return None if ending else self.answer

    def close(self, state):
        pass


def test_episodes_branch_at_turns_sample_the_tempered_policy_and_reread_their_history_from_the_prefix_cache(
        engine, model, vllm_tied_model_dir):
    """Episodes on the engine (VLLMTurns: one session, each turn's request sent as soon as its
    answer is in), 3 turns branching [2, 2] at turns, the environment answering every reply:
    the HF sampler's structure (counts, paths, the environment's tokens flagged with logprob 0,
    turns); each sampled token's logprob is the tempered policy's, teacher-forced through the
    whole episode; and the later turns' requests are served from the prefix cache at least the
    full blocks of their history the turn before computed. Prompts of 38-40 tokens: every
    second-turn request gets at least the prompt's block, and every third-turn request (no
    siblings at that turn to share with) at least two, the second holding the first reply and
    the environment's answer."""
    short, eos = short_prompts(vllm_tied_model_dir, 18), model.generation_config.eos_token_id
    prompts, branching = [a + b + c for a, b, c in zip(short[:6], short[6:12], short[12:])], [2, 2]
    answer = AutoTokenizer.from_pretrained(vllm_tied_model_dir, local_files_only=True)(ANSWER_TEXT)["input_ids"]
    with VLLMTurns(engine, 16, 0.8, 1.0, 0, eos) as turns:
        trees, figures = sample_episodes(turns, prompts, branching, 3, Answering(answer))
    sampling = SamplingParams(temperature=0.8)
    for prompt, tree in zip(prompts, trees):
        assert sum(tree.counts) == 4 and tree.paths == sorted(tree.paths)
        for tokens, logprobs, flags, turn, path, count in zip(tree.completions, tree.logprobs, tree.sampled, tree.turns,
                                                               tree.paths, tree.counts):
            assert 1 <= turn <= 3 and len(path) == min(turn, 2) and count == math.prod(branching[len(path):])
            starts = reply_starts(flags)
            assert len(starts) == turn - 1 and all(tokens[s - len(answer):s] == answer for s in starts)
            assert sum(not f for f in flags) == len(answer) * (turn - 1)
            mask = torch.tensor(flags)
            assert (torch.tensor(logprobs)[~mask] == 0).all()
            assert torch.allclose(torch.tensor(logprobs)[mask], teacher_forced(model, prompt, tokens, sampling)[mask],
                                  atol=1e-4)
    assert max(t for tree in trees for t in tree.turns) == 3
    second, second_requests = cache_floor(prompts, trees, branching, len(answer), 1)
    third, third_requests = cache_floor(prompts, trees, branching, len(answer), 2)
    assert second >= second_requests * BLOCK > 0 and third >= third_requests * 2 * BLOCK > 0
    assert figures["cached_positions"] >= second + third
    assert figures["prompt_positions"] >= figures["cached_positions"] and figures["decode_steps"] > 0


def start_stalled_call(engine: VLLMEngine, prompts: list[list[int]]) -> tuple[threading.Thread, list]:
    """A trees call on another thread whose worker is stopped (SIGSTOP) at its first progress
    message: a call in flight that will not be answered. Returns the thread and what it raised."""
    raised, stopped = [], threading.Event()

    def stop(_tokens: int) -> None:
        if not stopped.is_set():
            os.kill(engine.pid, signal.SIGSTOP)
            stopped.set()

    def call() -> None:
        try:
            engine.sample_trees(prompts, [4, 2], [8], 24, 1.0, 1.0, 0, [], progress=stop)
        except EngineError as e:
            raised.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    while not stopped.wait(1) and thread.is_alive():
        pass
    assert stopped.is_set(), f"the call ended before its first progress message: {raised}"
    return thread, raised


def test_every_engine_failure_closes_the_engine_and_a_fresh_one_samples_right(engine, model, vllm_tied_model_dir):
    prompts, eos = short_prompts(vllm_tied_model_dir, 2), model.generation_config.eos_token_id

    # 1. A request that raises in the worker (a prompt longer than the context), after the
    # first tree's requests are in flight: they are aborted, the engine is closed.
    with pytest.raises(EngineError, match=r"maximum context length is 256.*2 requests in flight aborted"):
        engine.sample_trees([prompts[0], [1000] * (MAX_MODEL_LEN + 10)], [2], [], 8, 1.0, 1.0, 0, eos)
    assert not engine.alive()
    with pytest.raises(EngineError, match="closed"):
        engine.generate(prompts, 4, eos)

    # 2. A hung worker: the call fails at its deadline and the engine is killed. (A deadline
    # of 4 s once ran out before the first progress message on a loaded machine.)
    hung = VLLMEngine(spec(vllm_tied_model_dir, timeout_s=10.0))
    fork_server = parent(hung.pid)
    started = time.monotonic()
    thread, raised = start_stalled_call(hung, prompts)
    thread.join(60)
    assert 9.5 < time.monotonic() - started < 40 and "did not answer 'trees' within 10 s" in str(raised[0])
    assert not hung.alive() and hung._process.returncode == -signal.SIGKILL
    assert not Path(f"/dev/shm/__KMP_REGISTERED_LIB_{hung.pid}_0").exists()  # nothing left in shared memory
    hung.close()

    # 3. A fresh engine samples right, forked from the fork server the others came from, and
    # goes on when that server is gone (killed here: the next engine starts another, which
    # forks engines that sample right). Closed while a call is in flight (its worker hung, the
    # call's deadline 30 minutes away), the close does not wait and the call fails at once.
    descriptors = len(os.listdir("/proc/self/fd"))
    fresh = VLLMEngine(spec(vllm_tied_model_dir))
    assert parent(fresh.pid) == fork_server and fork_server != os.getpid()
    os.kill(fork_server, signal.SIGKILL)
    trees, _ = fresh.sample_trees(prompts, [2, 2], [4], 12, 1.0, 1.0, 0, eos)
    assert [sum(t.counts) for t in trees] == [4, 4]
    assert_logprobs_are_the_models(model, prompts, trees)
    after = VLLMEngine(spec(vllm_tied_model_dir))
    assert parent(after.pid) not in (fork_server, os.getpid())
    thread, raised = start_stalled_call(after, prompts)
    started = time.monotonic()
    after.close()
    thread.join(30)
    assert time.monotonic() - started < 10 and not thread.is_alive() and "ended during 'trees'" in str(raised[0])
    assert not after.alive() and after._process.returncode == -signal.SIGKILL
    fresh.close()  # its fork server was gone: its exit code too
    assert not fresh.alive() and fresh._process.returncode == UNKNOWN_EXIT
    assert len(os.listdir("/proc/self/fd")) == descriptors  # the new fork server's connection for the old one's


def parent(pid: int) -> int:
    """The parent process of `pid` (/proc's)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
