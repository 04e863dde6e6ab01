"""The episode sampler: turns branch as configured, the environment's tokens are flagged,
episodes that end early stand for the forks they missed, each episode's KV is kept between
turns (its logprobs are the model's over the whole episode, and nothing is read twice),
episodes advance without waiting for each other, and under the barrier the draws reproduce
bit for bit."""

import math
import threading
import time

import pytest
import torch
from conftest import tiny_model
from transformers import MistralConfig, MistralForCausalLM

from lsreplay.algos.model_tokens import sampled_masks
from lsreplay.models.distribution import SamplingParams, token_logprobs
from lsreplay.rollout.episodes import sample_episodes
from lsreplay.rollout.hf_turns import HFTurns
from lsreplay.tree import RolloutTree

EOS, ANSWER = [0, 1], [6, 7]  # two end-of-turn tokens: 1 is "the right answer", 0 another
BRANCHING, MAX_TURNS = [3, 2], 3
PROMPTS = [[2, 3], [4, 5, 3]]


class Answering:
    """An environment whose state is nothing: it ends the episode when the reply ended with
    token 1 ("right"), else answers "wrong, try again" (tokens 6, 7), after `delay(tree)`
    seconds. It counts its answers and the states it was asked to close."""

    def __init__(self, delay=lambda tree: 0.0):
        self.delay, self.calls, self.closed = delay, 0, 0
        self.lock = threading.Lock()

    def root(self, tree: int):
        return tree

    def branch(self, parent, last: bool):
        return parent

    def respond(self, tree, reply, completion, ending):
        time.sleep(self.delay(tree))
        with self.lock:
            self.calls += 1
        return None if ending or reply[-1] == 1 else ANSWER

    def close(self, state) -> None:
        self.closed += 1


def model(window: int | None = None):
    """A tiny Llama, or with `window` the same weights in a Mistral whose layers see only that
    many positions."""
    llama = tiny_model("llama", vocab=8, dtype=torch.float64, initializer_range=0.3)
    if window is None:
        return llama
    mistral = MistralForCausalLM(MistralConfig(**llama.config.to_dict(), sliding_window=window))
    mistral.load_state_dict(llama.state_dict())
    return mistral.double().eval()


def turns(m, seed: int = 0, max_new_tokens: int = 6) -> HFTurns:
    """Replies of up to 6 tokens at temperature 1, each request's from its own generator."""
    return HFTurns(m, max_new_tokens, SamplingParams(temperature=1.0), EOS,
                   lambda tree, path, turn: torch.Generator().manual_seed(hash((seed, tree, path, turn)) % 2**62))


def sample(seed: int = 0, barrier: bool = True, environment=None, prompts=PROMPTS, branching=BRANCHING,
           max_new_tokens: int = 6, window: int | None = None, **kw):
    m = model(window)
    with turns(m, seed, max_new_tokens) as engine:
        trees, figures = sample_episodes(engine, prompts, branching, MAX_TURNS, environment or Answering(),
                                         barrier=barrier, **kw)
    return trees, figures, m


def test_episodes_branch_at_turns_and_flag_the_environment_tokens():
    rollouts, _, _ = sample()
    for r in rollouts:
        assert sum(r.counts) == math.prod(BRANCHING)
        for tokens, flags, turns_taken, count in zip(r.completions, r.sampled, r.turns, r.counts):
            assert len(flags) == len(tokens) and 1 <= turns_taken <= MAX_TURNS
            assert sum(not f for f in flags) == len(ANSWER) * (turns_taken - 1)  # an answer between every two replies
            assert count == math.prod(BRANCHING[min(turns_taken, len(BRANCHING)):])
    assert len({t for r in rollouts for t in r.turns}) >= 2  # episodes end at different turns
    trees = [RolloutTree.from_sequences(r.prompt_ids, r.completions) for r in rollouts]
    assert sum(t.unique_positions for t in trees) < sum(t.total_positions for t in trees)
    assert sampled_masks([r.sampled for r in rollouts]) is not None


@pytest.mark.parametrize("window, seed", [(None, 0), (4, 1)], ids=["llama", "mistral-window4"])
def test_kept_kv_gives_the_models_logprobs_and_reads_nothing_twice(window, seed):
    """Every sampled token's logprob equals the model's over the whole episode, teacher-forced
    (also where its layers see only a window of 4 positions, of episodes up to 16: the kept K/V holds every
    position, the window is the model's mask); the engine prefilled each prompt once and then
    only the tokens each turn added (the reply's last token and the answer), far fewer than
    re-reading every turn's history."""
    rollouts, figures, m = sample(seed, window=window)
    for r in rollouts:
        for tokens, logprobs, flags in zip(r.completions, r.logprobs, r.sampled):
            with torch.no_grad():
                logits = m(torch.tensor([r.prompt_ids + tokens])).logits[0, len(r.prompt_ids) - 1:-1]
            expected = token_logprobs(logits, torch.tensor(tokens), SamplingParams(temperature=1.0))
            mask = torch.tensor(flags)
            assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64)[mask], expected[mask], atol=1e-9)
    continued = sum(n - 1 for r in rollouts for n in r.turns)  # every reply after an answer
    requests = sum(len(set(tuple(p[:min(t - 1, len(BRANCHING))]) for p, t in zip(r.paths, r.turns) if t > 1))
                   for r in rollouts)
    assert figures["prefill_positions"] < figures["history_positions"]
    assert figures["prefill_positions"] >= sum(map(len, PROMPTS)) + requests * (1 + len(ANSWER))
    assert continued > 0


def test_episodes_reproduce_bit_for_bit_under_the_barrier():
    a, _, _ = sample()
    b, _, _ = sample()
    assert [(r.completions, r.logprobs, r.sampled) for r in a] == [(r.completions, r.logprobs, r.sampled) for r in b]
    assert [r.completions for r in sample(seed=1)[0]] != [r.completions for r in a]


def test_a_slow_answer_holds_up_only_its_own_episodes():
    """Tree 0's environment answers after 1 s, the others' at once: without the barrier the
    other trees' episodes are answered at their second turn before tree 0's first answer;
    with it, no episode's second turn starts before every first answer is in."""
    answered = []

    class Timed(Answering):
        def root(self, tree):
            return tree, 0

        def branch(self, parent, last):
            return parent[0], parent[1] + 1

        def respond(self, state, reply, completion, ending):
            time.sleep(self.delay(state[0]))
            answered.append((state, time.monotonic()))
            return None if ending else ANSWER

    for barrier in (False, True):
        answered.clear()
        sample(environment=Timed(lambda tree: 1.0 if tree == 0 else 0.0), barrier=barrier, prompts=[[2, 3]] * 4,
               branching=[2, 2], max_new_tokens=20)
        slow_first = min(t for (tree, _), t in answered if tree == 0)
        early = [(tree, turn) for (tree, turn), t in answered if tree != 0 and turn >= 2 and t < slow_first]
        assert bool(early) != barrier, (barrier, early)


def test_at_most_max_concurrent_episodes_are_in_flight():
    in_flight, peak, lock = [0], [0], threading.Lock()

    class Counting(Answering):
        def respond(self, tree, reply, completion, ending):
            with lock:
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
            try:
                return super().respond(tree, reply, completion, ending)
            finally:
                with lock:
                    in_flight[0] -= 1

    env = Counting(lambda tree: 0.02)
    trees, _, _ = sample(environment=env, barrier=False, prompts=[[2, 3]] * 6, branching=[2], max_concurrent=4)
    assert 1 <= peak[0] <= 4
    assert all(sum(t.counts) == 2 for t in trees)


def test_a_failure_closes_the_states_held():
    class Failing(Answering):
        def respond(self, tree, reply, completion, ending):
            if tree == 1:
                raise RuntimeError("the environment broke")
            return super().respond(tree, reply, completion, ending)

    env = Failing()
    try:
        sample(environment=env, barrier=False)
    except RuntimeError as e:
        assert "broke" in str(e)
    else:
        raise AssertionError("the failure was not raised")
    assert env.closed >= 1


def reward(completion: list[int], turns_taken: int) -> float:
    """Full credit for "right" at the first reply, half at a later one, none otherwise."""
    return 0.0 if completion[-1] != 1 else (1.0 if turns_taken == 1 else 0.5)


def per_prompt_estimates(branching: list[int], prompts: int) -> torch.Tensor:
    """Each tree's count-weighted mean reward (the tree estimator of the expected reward)."""
    rollouts, _, _ = sample(seed=len(branching), prompts=[[2, 3]] * prompts, branching=branching)
    return torch.tensor([sum(n * reward(c, t) for c, t, n in zip(r.completions, r.turns, r.counts)) / sum(r.counts)
                         for r in rollouts], dtype=torch.float64)


def test_the_tree_estimator_is_unbiased_when_episodes_end_at_different_turns():
    """Trees branching [3, 2] at turns against 6 independent episodes per prompt: the same
    expected reward, within 4.5 standard errors of the difference."""
    trees, flat = per_prompt_estimates(BRANCHING, 300), per_prompt_estimates([6], 300)
    se = (trees.var() / trees.numel() + flat.var() / flat.numel()).sqrt()
    assert 0.05 < float(flat.mean()) < 0.95
    assert abs(float(trees.mean() - flat.mean())) <= 4.5 * float(se), (trees.mean(), flat.mean(), se)


def test_episodes_fork_at_token_offsets_of_the_first_reply():
    """branch_at=tokens: [2, 2] forks the first reply after 2 tokens; later turns continue
    each episode once, so the paths have the first reply's branch points only."""
    rollouts, _, _ = sample(prompts=[[2, 3], [4, 5, 3]] * 4, branching=[2, 2], segment_tokens=[2])
    for r in rollouts:
        assert sum(r.counts) == 4 and all(len(p) <= 2 for p in r.paths)
        for tokens, flags, turns_taken in zip(r.completions, r.sampled, r.turns):
            assert sum(not f for f in flags) == len(ANSWER) * (turns_taken - 1)
    assert max(t for r in rollouts for t in r.turns) >= 2
