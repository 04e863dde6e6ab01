"""Pick the draft length for speculative decoding with a UCB1-Tuned bandit (TLT's adaptive drafting).

The best draft length depends on how well the drafter currently predicts the target and
on what a verify forward of k+1 positions costs at the current batch size (CPU matmuls
handle some block sizes badly; accelerators stop being memory-bound as the batch grows).
So the bandit keeps one UCB1 learner per batch-size bucket (powers of two: 1, 2, 3-4,
5-8, ...), and its reward is what matters end to end: tokens emitted per second of a
round, measured. An arm 0 (draft nothing: the round verifies one token per sequence, a
plain decoding step) lets a bucket turn speculation off where it does not pay, as on a
CPU whose verify forward grows with every row while the drafter's acceptance is low.

The rule is UCB1-Tuned (Auer, Cesa-Bianchi & Fischer 2002): the arm maximising
mean + c * sqrt(ln n / n_a * min(1/4, V_a)), V_a = the arm's reward variance plus
sqrt(2 ln n / n_a). It assumes rewards in [0, 1]; tokens per second are not, so rewards
are measured in units of the best arm mean seen in the bucket. Its variance-aware bonus
settles much sooner than plain UCB1's when arms differ by a few percent, as draft
lengths near the optimum do.
Untried arms are pulled first, in an order fixed by `seed`; after that the choice is a
deterministic function of the rewards seen, so a run replays exactly given its rewards.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_ARMS = (2, 3, 4, 5, 6, 8)


@dataclass
class ArmStats:
    pulls: int = 0
    total: float = 0.0  # sum of rewards (tokens/s)
    squares: float = 0.0  # sum of squared rewards

    @property
    def mean(self) -> float:
        return self.total / self.pulls if self.pulls else float("nan")

    @property
    def variance(self) -> float:
        return max(self.squares / self.pulls - self.mean**2, 0.0) if self.pulls else float("nan")


class DraftLengthBandit:
    """UCB1-Tuned over candidate draft lengths, one learner per batch-size bucket.

    `choose(batch_size)` returns a draft length; `update(batch_size, draft_len, tokens,
    seconds)` rewards it with tokens / seconds. `history` records every (bucket, arm, reward).
    """

    def __init__(self, arms=DEFAULT_ARMS, exploration: float = 1.0, seed: int = 0):
        arms = tuple(int(a) for a in arms)
        if not arms or min(arms) < 0 or len(set(arms)) != len(arms):
            raise ValueError(f"arms must be distinct draft lengths >= 0, got {arms}")
        if exploration < 0:
            raise ValueError(f"exploration must be >= 0, got {exploration}")
        self.arms, self.exploration, self.seed = arms, exploration, seed
        self._buckets: dict[int, dict[int, ArmStats]] = {}
        self._orders: dict[int, list[int]] = {}
        self.history: list[tuple[int, int, float]] = []

    @staticmethod
    def bucket(batch_size: int) -> int:
        """Smallest power of two >= batch_size: buckets 1, 2, 4 (3-4), 8 (5-8), ..."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return 1 << (batch_size - 1).bit_length()

    def _stats(self, bucket: int) -> dict[int, ArmStats]:
        if bucket not in self._buckets:
            self._buckets[bucket] = {arm: ArmStats() for arm in self.arms}
            order = list(self.arms)
            random.Random(f"{self.seed}/{bucket}").shuffle(order)  # str seeds hash deterministically
            self._orders[bucket] = order
        return self._buckets[bucket]

    def choose(self, batch_size: int) -> int:
        bucket = self.bucket(batch_size)
        stats = self._stats(bucket)
        untried = [arm for arm in self._orders[bucket] if stats[arm].pulls == 0]
        if untried:
            log.debug("bucket %d: trying draft_len %d", bucket, untried[0])
            return untried[0]
        n = sum(s.pulls for s in stats.values())
        scale = max(max(s.mean for s in stats.values()), 1e-12)
        scores = {}
        for arm, s in stats.items():
            spread = s.variance / scale**2 + math.sqrt(2 * math.log(n) / s.pulls)
            bonus = math.sqrt(math.log(n) / s.pulls * min(0.25, spread))
            scores[arm] = s.mean / scale + self.exploration * bonus
        arm = max(self._orders[bucket], key=lambda a: scores[a])  # ties: the first in seed order
        log.debug("bucket %d: draft_len %d (means %s)", bucket, arm,
                  {a: round(s.mean, 2) for a, s in stats.items()})
        return arm

    def update(self, batch_size: int, draft_len: int, tokens: float, seconds: float) -> None:
        bucket = self.bucket(batch_size)
        stats = self._stats(bucket)
        if draft_len not in stats:
            raise ValueError(f"draft_len {draft_len} is not one of the arms {self.arms}")
        reward = tokens / max(seconds, 1e-9)
        stats[draft_len].pulls += 1
        stats[draft_len].total += reward
        stats[draft_len].squares += reward * reward
        self.history.append((bucket, draft_len, reward))

    def best(self, batch_size: int) -> int | None:
        """The arm with the highest mean reward in this batch size's bucket (None before any reward)."""
        stats = self._buckets.get(self.bucket(batch_size))
        if not stats or not any(s.pulls for s in stats.values()):
            return None
        return max((a for a in self.arms if stats[a].pulls), key=lambda a: stats[a].mean)

    def summary(self) -> dict[int, dict[int, tuple[int, float]]]:
        """{bucket: {draft_len: (pulls, mean tokens/s)}}."""
        return {b: {a: (s.pulls, s.mean) for a, s in stats.items()} for b, stats in sorted(self._buckets.items())}
