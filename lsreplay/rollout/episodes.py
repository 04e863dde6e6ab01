"""Sample multi-turn episodes as trees: the model replies, the environment answers, again.

An episode alternates the model's replies (each up to `max_new_tokens`, ending at EOS) with
the environment's answers (token ids `respond` returns, or None: the episode ends). The
episodes of a prompt form one trie: at turn k every live episode is forked into
`branching[k]` replies (1 past the last level), which share its whole history, the
environment's answers included. Given `segment_tokens`, the episodes fork at token offsets
instead, within the first reply, as single-turn trees do (tree_sampler.sample_trees'
`branching` and `segment_tokens`), and every later turn continues each episode once. A reply
cut at `max_new_tokens` ends its episode, as does the last turn.

An episode that ended before a branch point stands for every continuation it would have
been forked into (its `count`, as in the single-turn sampler), so the counts of a tree sum
to prod(branching) and the tree estimator stays unbiased when episodes end at different
turns.

Each turn's replies come from a turn sampler (`SampleTurn`), one per engine:

- `HFTurns` (rollout.engine=hf), lsreplay's tree sampler: bit-reproducible. Each episode's
  reply draws from its own generator, `generator_for(tree, path, turn)`, whatever else shares
  the batch; `respond` must then be deterministic (a function of the prompt and the episode
  so far).
- `VLLMTurns` (rollout.engine=vllm), the device's vLLM engine: a turn's requests are each
  episode's prompt and history, whose K/V its prefix cache holds from the turn before (up to
  the last full cache block of what it computed: the environment's tokens are new). Exact in
  distribution, not reproducible: an interrupted stage samples its episodes again.

`respond` gets the tree's index and the episode's completion so far (ending with the model's
reply), so the environment needs no state of its own to fork.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lsreplay.models.distribution import SamplingParams
from lsreplay.rollout.tree_sampler import TreeRollout, sample_trees

# respond(tree index, completion so far) -> the environment's token ids, or None: the episode ends.
Respond = Callable[[int, list[int]], list[int] | None]
# An episode's place: (its tree, its path through the branch points so far, the turn).
EpisodeKey = tuple[int, tuple[int, ...], int]
# sample_turn(requests, fan_outs, segment_tokens, keys): one turn's replies, a TreeRollout per
# request (an episode's prompt and history, its place keys[i]), forked as sample_trees forks.
SampleTurn = Callable[[list[list[int]], list[int], list[int], list[EpisodeKey]], list[TreeRollout]]


class HFTurns:
    """Replies sampled by lsreplay's tree sampler (rollout.engine=hf), each episode's from its
    own generator, generator_for(tree, path, turn): bit-reproducible."""

    def __init__(self, model, max_new_tokens: int, params: SamplingParams, eos_token_id: int | list[int],
                 generator_for: Callable[[int, tuple[int, ...], int], torch.Generator],
                 progress: Callable[[int], None] | None = None):
        self.model, self.max_new_tokens, self.params, self.eos = model, max_new_tokens, params, eos_token_id
        self.generator_for, self.progress = generator_for, progress

    @torch.inference_mode()
    def __call__(self, requests: list[list[int]], fan_outs: list[int], segments: list[int],
                 keys: list[EpisodeKey]) -> list[TreeRollout]:
        trees, _ = sample_trees(self.model, requests, fan_outs, segments, self.max_new_tokens, self.params, self.eos,
                                [self.generator_for(*key) for key in keys], self.progress)
        return trees


class VLLMTurns:
    """Replies sampled by a vLLM engine (rollout.engine=vllm; VLLMEngine.sample_trees), served
    from its prefix cache up to where the history is new. `figures`: the engine's of each turn
    (positions it computed and was sent, cached positions, seconds, steps)."""

    def __init__(self, engine, max_new_tokens: int, temperature: float, top_p: float, top_k: int, eos: list[int],
                 progress: Callable[[int], None] | None = None):
        self.engine, self.max_new_tokens, self.eos, self.progress = engine, max_new_tokens, eos, progress
        self.sampling = (temperature, top_p, top_k)
        self.figures: list[dict] = []

    def __call__(self, requests: list[list[int]], fan_outs: list[int], segments: list[int],
                 keys: list[EpisodeKey]) -> list[TreeRollout]:
        # No use for the episodes' places: vLLM draws from one engine-wide generator.
        trees, figures = self.engine.sample_trees(requests, fan_outs, segments, self.max_new_tokens, *self.sampling,
                                                  self.eos, self.progress)
        self.figures.append(figures)
        return trees


@dataclass
class EpisodeRollout(TreeRollout):
    """A prompt's episodes as TreeRollout's leaves, plus per token whether the model sampled
    it (False: the environment's tokens, 0.0 in `logprobs`) and each episode's turns."""

    sampled: list[list[bool]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)


@dataclass
class _Episode:
    tree: int
    path: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    turns: int = 0
    finished: bool = False

    def replied(self, forks: tuple[int, ...], reply: list[int], logprobs: list[float], finished: bool) -> _Episode:
        """The episode continued by a reply, reached through the branch points `forks`."""
        return _Episode(self.tree, self.path + forks, self.tokens + reply, self.logprobs + logprobs,
                        self.sampled + [True] * len(reply), self.turns + 1, finished)

    def answered(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.sampled += [False] * len(tokens)


def sample_episodes(sample_turn: SampleTurn, prompts: list[list[int]], branching: list[int], max_turns: int,
                    respond: Respond, segment_tokens: list[int] | None = None) -> list[EpisodeRollout]:
    """The episode trees of `prompts`, each turn's replies from `sample_turn`, branching
    `branching[k]` ways at turn k, or at the token offsets `segment_tokens` of the first reply
    (see the module)."""
    if segment_tokens is None and not 1 <= len(branching) <= max_turns:
        raise ValueError(f"need 1 to max_turns={max_turns} fan-outs (one per turn), got {branching}")
    live, ended, positions = [_Episode(i) for i in range(len(prompts))], [], [0] * len(prompts)
    for turn in range(max_turns):
        if not live:
            break
        fan_outs, segments, forks = _turn_levels(branching, segment_tokens, turn)
        trees = sample_turn([prompts[e.tree] + e.tokens for e in live], fan_outs, segments,
                            [(e.tree, e.path, turn) for e in live])
        going = []
        for episode, tree in zip(live, trees):
            positions[episode.tree] += tree.forward_positions
            for reply, logprobs, finished, path in zip(tree.completions, tree.logprobs, tree.finished, tree.paths):
                child = episode.replied(tuple(path) if forks else (), reply, logprobs, finished)
                answer = respond(child.tree, child.tokens) if finished and turn + 1 < max_turns else None
                if answer is None:
                    ended.append(child)
                else:
                    child.answered(list(answer))
                    going.append(child)
        live = going
    return [_rollout(prompts[i], sorted((e for e in ended if e.tree == i), key=lambda e: e.path), positions[i],
                     branching) for i in range(len(prompts))]


def _turn_levels(branching: list[int], segment_tokens: list[int] | None, turn: int) -> tuple[list[int], list[int], bool]:
    """The fan-outs and segment lengths of turn `turn`'s replies, and whether they fork."""
    if segment_tokens is not None:
        return (list(branching), list(segment_tokens), True) if turn == 0 else ([1], [], False)
    return ([branching[turn]], [], True) if turn < len(branching) else ([1], [], False)


def _rollout(prompt: list[int], episodes: list[_Episode], positions: int, branching: list[int]) -> EpisodeRollout:
    return EpisodeRollout(
        prompt_ids=list(prompt), completions=[e.tokens for e in episodes], logprobs=[e.logprobs for e in episodes],
        finished=[e.finished for e in episodes], forward_positions=positions, paths=[list(e.path) for e in episodes],
        counts=[math.prod(branching[len(e.path):]) for e in episodes], sampled=[e.sampled for e in episodes],
        turns=[e.turns for e in episodes])
