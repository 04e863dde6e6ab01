"""A rollout tree as the config shapes it: the prompt, each level's fan-out and segment."""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from lsreplay.core.config import RolloutConfig, completion_tokens, multi_turn
from lsreplay.tree import RolloutTree


@dataclass(frozen=True)
class TreeShape:
    """A rollout tree as the config shapes it: a prompt of P tokens, then per level a
    fan-out and the tokens every branch of that level adds (the last level: up to the end
    of the completion)."""

    prompt: int
    levels: tuple[tuple[int, int], ...]  # (branching, segment tokens), root first

    @classmethod
    def from_rollout(cls, prompt: int, branching, segment_tokens, max_new_tokens: int) -> TreeShape:
        segs = list(segment_tokens) + [max_new_tokens - sum(segment_tokens)]
        return cls(prompt, tuple(zip(branching, segs)))

    @classmethod
    def of_rollouts(cls, prompt: int, r: RolloutConfig) -> TreeShape:
        """The trees rollout config `r` samples for prompts of `prompt` tokens, at their longest
        (completion_tokens). Episodes branching at turns fork turn k's replies after the turns
        before, each a reply and the environment's answer to it; at tokens, within the first reply."""
        if multi_turn(r) and r.branch_at == "turns":
            segments = [r.max_new_tokens + r.max_environment_tokens] * (len(r.branching) - 1)
        else:
            segments = list(r.segment_tokens)
        return cls.from_rollout(prompt, r.branching, segments, completion_tokens(r))

    def radix(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """As the trie stores it: a level of fan-out 1 does not branch, so its tokens join
        the node above (the prompt, for the first). Returns (root length, levels)."""
        root, levels = self.prompt, []
        for b, s in self.levels:
            if b == 1:
                if levels:
                    levels[-1] = (levels[-1][0], levels[-1][1] + s)
                else:
                    root += s
            else:
                levels.append((b, s))
        return root, tuple(levels)

    def random_tree(self, vocab: int, seed: int = 0) -> RolloutTree:
        """A tree of exactly this shape (benchmarks, tests): random tokens, siblings starting
        with distinct tokens, so that the trie branches where the shape does."""
        rng = random.Random(seed)

        def grow(level: int) -> list[list[int]]:
            if level == len(self.levels):
                return [[]]
            branching, length = self.levels[level]
            out = []
            for first in rng.sample(range(vocab), branching):
                segment = [first] + [rng.randrange(vocab) for _ in range(length - 1)]
                out += [segment + rest for rest in grow(level + 1)]
            return out

        return RolloutTree.from_sequences([rng.randrange(vocab) for _ in range(self.prompt)], grow(0))

    @property
    def rollouts(self) -> int:
        return math.prod(b for b, _ in self.levels)

    @property
    def completion(self) -> int:
        return sum(s for _, s in self.levels)

    @property
    def total_positions(self) -> int:
        """Per-rollout positions: G x (P + completion)."""
        return self.rollouts * (self.prompt + self.completion)

    @property
    def unique_positions(self) -> int:
        """Replay positions: P + sum over levels of (nodes at that level) x segment."""
        out, nodes = self.prompt, 1
        for b, s in self.levels:
            nodes *= b
            out += nodes * s
        return out


@functools.lru_cache(maxsize=4)
def shape_tree(shape: TreeShape, vocab: int) -> RolloutTree:
    """The plan's tree of `shape` (TreeShape.random_tree), made once: a plan reads it several
    times, and a million-token prompt takes seconds to draw. Read, never changed."""
    return shape.random_tree(vocab)
