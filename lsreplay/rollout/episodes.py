"""Sample multi-turn episodes as trees: the model replies, the environment answers, again.

An episode alternates the model's replies (each up to `max_new_tokens`, ending at EOS) with
the environment's answers (token ids, or None: the episode ends). The episodes of a prompt
form one trie: at turn k every live episode is forked into `branching[k]` replies (1 past
the last level), which share its whole history, the environment's answers included. Given
`segment_tokens`, the episodes fork at token offsets instead, within the first reply, as
single-turn trees do (tree_sampler.sample_trees' `branching` and `segment_tokens`), and every
later turn continues each episode once. A reply cut at `max_new_tokens` ends its episode, as
does the last turn.

An episode that ended before a branch point stands for every continuation it would have
been forked into (its `count`, as in the single-turn sampler), so the counts of a tree sum
to prod(branching) and the tree estimator stays unbiased when episodes end at different
turns.

**Concurrency.** Episodes do not advance turn by turn as a group: each reply goes to the
environment (on the `executor`'s threads) as soon as it ends, and the episode's next turn
goes back to the engine as soon as its answer returns, while the others decode. At most
`max_concurrent` episodes are in flight (0: all). With `barrier`, every turn's requests wait
until no reply is decoding and no answer is pending, then go together in a fixed order: the
engine's batches, hence the HF engine's episodes, are then bit-reproducible.

**The environment** (`EpisodeEnvironment`, lsreplay.data.environments.Episodes) holds one
state per episode: the tree's first (`root`), a branch's (`branch`: its last reply keeps the
parent's own, the others a fork, made on this thread), its answer to a reply (`respond`, on
the executor), and `close` for those this sampler still holds when it fails (the caller
closes the ended ones', `EpisodeRollout.episodes`).

**The engine** (`TurnEngine`) decodes the requests it is given and returns the replies as
they end: `HFTurns` (rollout.engine=hf, lsreplay.rollout.hf_turns: each episode's KV kept
between its turns) or `VLLMTurns` (rollout.engine=vllm: a continuation request is the
episode's whole history, which vLLM's prefix cache holds from the turn before).
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass, field
from typing import Protocol

from lsreplay.rollout.tree_sampler import TreeRollout

# An episode's place: (its tree, its path through the branch points so far, the turn).
EpisodeKey = tuple[int, tuple[int, ...], int]


@dataclass
class TurnRequest:
    """One episode's next turn for the engine: its place, its whole sequence so far (prompt
    and completion, the environment's answer last), the engine's state it continues from
    (None: the first turn), its fan-outs and the token offsets between them (the first turn
    with branch_at=tokens; else one fan-out), and whether it is the episode's last turn (no
    state to keep after it)."""

    id: int
    key: EpisodeKey
    tokens: list[int]
    state: object | None
    fan_outs: list[int]
    segments: list[int]
    final: bool


@dataclass
class TurnReply:
    """One reply the engine finished: its request, its path through the request's fan-outs,
    tokens and logprobs, whether it ended at EOS (else at max_new_tokens), whether no other
    reply of its request is still decoding, the engine's state to continue from (HF: the
    episode's KV), and with a request's last reply the positions the engine computed for it."""

    request: int
    path: tuple[int, ...]
    tokens: list[int]
    logprobs: list[float]
    finished: bool
    last: bool
    state: object | None = None
    positions: int = 0


class TurnEngine(Protocol):
    """Decodes turn requests; `figures`: the engine's counters."""

    figures: dict

    def submit(self, requests: list[TurnRequest]) -> None: ...

    def poll(self, wait: float) -> list[TurnReply]:
        """Replies that ended: after one decode step (HF), or within `wait` seconds (vLLM)."""


class EpisodeEnvironment(Protocol):
    def root(self, tree: int): ...

    def branch(self, parent, last: bool): ...

    def respond(self, state, reply: list[int], completion: list[int], ending: bool) -> list[int] | None: ...

    def close(self, state) -> None: ...


@dataclass
class EpisodeRollout(TreeRollout):
    """A prompt's episodes as TreeRollout's leaves, plus per token whether the model sampled
    it (False: the environment's tokens, 0.0 in `logprobs`), each episode's turns, and its
    environment state at its end (`EpisodeEnvironment`'s)."""

    sampled: list[list[bool]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    episodes: list[object] = field(default_factory=list)


@dataclass
class _Episode:
    tree: int
    path: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    turns: int = 0
    finished: bool = False
    environment: object = None
    state: object = None  # the engine's, to continue from

    def replied(self, forks: tuple[int, ...], reply: TurnReply) -> _Episode:
        """The episode continued by a reply, reached through the branch points `forks`."""
        return _Episode(self.tree, self.path + forks, self.tokens + reply.tokens, self.logprobs + reply.logprobs,
                        self.sampled + [True] * len(reply.tokens), self.turns + 1, reply.finished, None, reply.state)

    def answered(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.sampled += [False] * len(tokens)


class _Scheduler:
    """The episodes of one batch of prompts in flight: requests waiting for the engine, replies
    at the environment, and the ended episodes."""

    def __init__(self, engine: TurnEngine, prompts: list[list[int]], branching: list[int], max_turns: int,
                 environment: EpisodeEnvironment, segment_tokens: list[int] | None, executor,
                 max_concurrent: int, barrier: bool):
        self.engine, self.prompts, self.branching, self.max_turns = engine, prompts, branching, max_turns
        self.environment, self.segment_tokens, self.executor = environment, segment_tokens, executor
        self.max_concurrent, self.barrier = max_concurrent, barrier
        self.queue: list[_Episode] = []  # episodes whose next turn waits for the engine
        self.requests: dict[int, tuple[_Episode, int]] = {}  # in the engine: the episode and its unused slots
        self.answering: dict[concurrent.futures.Future, _Episode] = {}
        self.ended: list[_Episode] = []
        self.positions, self.history_positions, self.ids = [0] * len(prompts), 0, 0

    def run(self) -> None:
        self.queue = [_Episode(i, environment=self.environment.root(i)) for i in range(len(self.prompts))]
        while self.queue or self.requests or self.answering:
            self._admit()
            ready = [f for f in self.answering if f.done()]
            for reply in self.engine.poll(0.0 if ready else 0.01) if self.requests else []:
                self._replied(reply)
            for future in [f for f in self.answering if f.done()]:
                self._answered(future)
            if self.answering and not self.requests and not self._admissible():
                concurrent.futures.wait(self.answering, return_when=concurrent.futures.FIRST_COMPLETED)

    def _in_flight(self) -> int:
        return sum(slots for _, slots in self.requests.values()) + len(self.answering)

    def _admissible(self) -> bool:
        if not self.queue or (self.barrier and (self.requests or self.answering)):
            return False
        return not self.max_concurrent or self._in_flight() < self.max_concurrent or not self._in_flight()

    def _admit(self) -> None:
        if not self._admissible():
            return
        self.queue.sort(key=lambda e: (e.tree, e.path, e.turns))
        admitted = []
        while self.queue:
            episode = self.queue[0]
            fan_outs, segments, _ = self._levels(episode.turns)
            slots = math.prod(fan_outs)
            # Within the bound; a request larger than the bound goes alone, when nothing else is in flight.
            if self.max_concurrent and self._in_flight() and self._in_flight() + slots > self.max_concurrent:
                break
            self.queue.pop(0)
            self.ids += 1
            self.requests[self.ids] = (episode, slots)
            tokens = self.prompts[episode.tree] + episode.tokens
            self.history_positions += len(tokens)  # what an engine that re-reads each turn's history prefills
            admitted.append(TurnRequest(self.ids, (episode.tree, episode.path, episode.turns), tokens, episode.state,
                                        fan_outs, segments, episode.turns + 1 == self.max_turns))
            episode.state = None
        if admitted:
            self.engine.submit(admitted)

    def _levels(self, turn: int) -> tuple[list[int], list[int], bool]:
        """The fan-outs and segment lengths of turn `turn`'s replies, and whether they fork."""
        if self.segment_tokens is not None:
            return (list(self.branching), list(self.segment_tokens), True) if turn == 0 else ([1], [], False)
        return ([self.branching[turn]], [], True) if turn < len(self.branching) else ([1], [], False)

    def _replied(self, reply: TurnReply) -> None:
        parent, slots = self.requests[reply.request]
        _, _, forks = self._levels(parent.turns)
        child = parent.replied(reply.path if forks else (), reply)
        child.environment = self.environment.branch(parent.environment, reply.last)
        if reply.last:
            del self.requests[reply.request]
            self.positions[parent.tree] += reply.positions
        else:
            self.requests[reply.request] = (parent, slots - 1)
        ending = not reply.finished or child.turns == self.max_turns
        future = self.executor.submit(self.environment.respond, child.environment, reply.tokens, list(child.tokens),
                                      ending)
        self.answering[future] = child

    def _answered(self, future: concurrent.futures.Future) -> None:
        episode = self.answering.pop(future)
        answer = future.result()
        if answer is None:
            episode.state = None
            self.ended.append(episode)
        else:
            episode.answered(list(answer))
            self.queue.append(episode)

    def close(self) -> None:
        """A failure: the states this sampler holds closed (a call still running is waited
        for a few seconds, then its state closed too)."""
        for future in self.answering:
            future.cancel()
        concurrent.futures.wait(self.answering, timeout=5)
        held = [e.environment for e in self.queue + list(self.answering.values()) + self.ended]
        held += [parent.environment for parent, _ in self.requests.values()]
        for state in held:
            if state is not None:
                self.environment.close(state)

    def rollouts(self) -> list[EpisodeRollout]:
        out = []
        for i, prompt in enumerate(self.prompts):
            episodes = sorted((e for e in self.ended if e.tree == i), key=lambda e: e.path)
            out.append(EpisodeRollout(
                prompt_ids=list(prompt), completions=[e.tokens for e in episodes],
                logprobs=[e.logprobs for e in episodes], finished=[e.finished for e in episodes],
                forward_positions=self.positions[i], paths=[list(e.path) for e in episodes],
                counts=[math.prod(self.branching[len(e.path):]) for e in episodes],
                sampled=[e.sampled for e in episodes], turns=[e.turns for e in episodes],
                episodes=[e.environment for e in episodes]))
        return out


def sample_episodes(engine: TurnEngine, prompts: list[list[int]], branching: list[int], max_turns: int,
                    environment: EpisodeEnvironment, segment_tokens: list[int] | None = None,
                    executor: concurrent.futures.Executor | None = None, max_concurrent: int = 0,
                    barrier: bool = False) -> tuple[list[EpisodeRollout], dict]:
    """The episode trees of `prompts`, each turn's replies from `engine`, branching
    `branching[k]` ways at turn k, or at the token offsets `segment_tokens` of the first reply,
    the environment's answers computed on `executor` (see the module). Returns the trees and
    the engine's figures, plus `history_positions`: the positions an engine that read each
    turn's whole history again would have prefilled."""
    if segment_tokens is None and not 1 <= len(branching) <= max_turns:
        raise ValueError(f"need 1 to max_turns={max_turns} fan-outs (one per turn), got {branching}")
    own = executor is None
    executor = executor or concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="lsreplay-episode")
    scheduler = _Scheduler(engine, prompts, branching, max_turns, environment, segment_tokens, executor,
                           max_concurrent, barrier)
    try:
        scheduler.run()
    except BaseException:
        scheduler.close()
        raise
    finally:
        if own:
            executor.shutdown(wait=False, cancel_futures=True)
    return scheduler.rollouts(), {**engine.figures, "history_positions": scheduler.history_positions}
