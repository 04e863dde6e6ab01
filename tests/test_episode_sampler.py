"""The episode sampler: turns branch as configured, the environment's tokens are flagged,
episodes that end early stand for the forks they missed, and the draws reproduce bit for bit."""

import math

import torch
from conftest import tiny_model

from lsreplay.algos.model_tokens import sampled_masks
from lsreplay.models.distribution import SamplingParams
from lsreplay.rollout.episodes import HFTurns, sample_episodes
from lsreplay.tree import RolloutTree

EOS, ANSWER = [0, 1], [6, 7]  # two end-of-turn tokens: 1 is "the right answer", 0 another
BRANCHING, MAX_TURNS = [3, 2], 3


def respond(tree: int, completion: list[int]) -> list[int] | None:
    """An environment that ends the episode when the reply ended with token 1 ("right"), else
    answers "wrong, try again" (tokens 6, 7)."""
    return None if completion[-1] == 1 else ANSWER


def hf_turns(model, generator_for) -> HFTurns:
    """Replies of up to 6 tokens at temperature 1, each episode's from generator_for(tree, path, turn)."""
    return HFTurns(model, 6, SamplingParams(temperature=1.0), EOS, generator_for)


def sample(seed: int = 0):
    model = tiny_model("llama", vocab=8, dtype=torch.float64, initializer_range=0.3)

    def generator_for(tree: int, path: tuple, turn: int) -> torch.Generator:
        return torch.Generator().manual_seed(hash((seed, tree, path, turn)) % 2**62)

    return sample_episodes(hf_turns(model, generator_for), [[2, 3], [4, 5, 3]], BRANCHING, MAX_TURNS, respond)


def test_episodes_branch_at_turns_and_flag_the_environment_tokens():
    rollouts = sample()
    for r in rollouts:
        assert sum(r.counts) == math.prod(BRANCHING)
        for tokens, flags, turns, finished, count in zip(r.completions, r.sampled, r.turns, r.finished, r.counts):
            assert len(flags) == len(tokens) and 1 <= turns <= MAX_TURNS
            assert sum(not f for f in flags) == len(ANSWER) * (turns - 1)  # an answer between every two replies
            assert count == math.prod(BRANCHING[min(turns, len(BRANCHING)):])
    turns = {t for r in rollouts for t in r.turns}
    assert len(turns) >= 2, turns  # episodes end at different turns
    trees = [RolloutTree.from_sequences(r.prompt_ids, r.completions) for r in rollouts]
    assert sum(t.unique_positions for t in trees) < sum(t.total_positions for t in trees)
    assert sampled_masks([r.sampled for r in rollouts]) is not None


def test_episodes_reproduce_bit_for_bit():
    a, b = sample(), sample()
    assert [(r.completions, r.logprobs, r.sampled) for r in a] == [(r.completions, r.logprobs, r.sampled) for r in b]
    assert [r.completions for r in sample(seed=1)] != [r.completions for r in a]


def reward(completion: list[int], turns: int) -> float:
    """Full credit for "right" at the first reply, half at a later one, none otherwise."""
    return 0.0 if completion[-1] != 1 else (1.0 if turns == 1 else 0.5)


def per_prompt_estimates(branching: list[int], prompts: int) -> torch.Tensor:
    """Each tree's count-weighted mean reward (the tree estimator of the expected reward)."""
    model = tiny_model("llama", vocab=8, dtype=torch.float64, initializer_range=0.3)
    rollouts = sample_episodes(hf_turns(model, lambda tree, path, turn: torch.Generator().manual_seed(
        hash((len(branching), tree, path, turn)) % 2**62)), [[2, 3]] * prompts, branching, MAX_TURNS, respond)
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
    model = tiny_model("llama", vocab=8, dtype=torch.float64, initializer_range=0.3)
    rollouts = sample_episodes(hf_turns(model, lambda tree, path, turn: torch.Generator().manual_seed(
        hash((tree, path, turn)) % 2**62)), [[2, 3], [4, 5, 3]] * 4, [2, 2], MAX_TURNS, respond, segment_tokens=[2])
    for r in rollouts:
        assert sum(r.counts) == 4 and all(len(p) <= 2 for p in r.paths)
        for tokens, flags, turns in zip(r.completions, r.sampled, r.turns):
            assert sum(not f for f in flags) == len(ANSWER) * (turns - 1)
    assert max(t for r in rollouts for t in r.turns) >= 2
