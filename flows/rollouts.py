"""The rollout tasks the training flow submits ahead of their step's update.

A step's rollouts are its prompts task, then its shard tasks (each waiting for the prompts).
With rollout.max_staleness = K they are submitted as soon as the policy version they sample
with exists (lsreplay.stages.versions): step t's once update t - K - 1 has ended, so that the
rollouts of steps t + 1 .. t + K run while update t does. With K = 0 that is each step's own
rollouts when its update may start: synchronous steps.

Shard k of a step also waits for shard k of the step submitted before it: each shard index is
a lane through the steps, so a later step's rollouts never take the device an earlier
step's, which an update waits for, still needs (give a step as many shards as the rollouts
have devices: pool.rollout_devices).
"""

from __future__ import annotations

from prefect.futures import PrefectFuture, wait

from lsreplay.core.config import Config


class RolloutsAhead:
    """Per step: its prompts task and its rollout shard tasks, submitted and not yet taken
    by the flow (`take`)."""

    def __init__(self, tasks: dict, cfg: Config):
        self.tasks, self.cfg = tasks, cfg
        self.pending: dict[int, tuple[PrefectFuture, list[PrefectFuture]]] = {}

    def submit_through(self, step: int) -> None:
        """Submit the rollouts of the steps from `step` to `step` + max_staleness (the last
        step at most) not submitted yet: the update of `step` may start, so the policy
        versions they sample with are there."""
        last = min(step + self.cfg.rollout.max_staleness, self.cfg.steps - 1)
        for ahead in range(step, last + 1):
            if ahead not in self.pending:
                before = self.pending.get(ahead - 1, (None, [None] * self.cfg.rollout.shards))[1]
                prompts = self.tasks["prompts"].submit(cfg=self.cfg, step=ahead)
                shards = [self.tasks["trees"].submit(cfg=self.cfg, step=ahead, shard=k,
                                                     wait_for=[prompts, *([lane] if lane else [])])
                          for k, lane in enumerate(before)]
                self.pending[ahead] = (prompts, shards)

    def take(self, step: int) -> tuple[PrefectFuture, list[PrefectFuture]]:
        """The prompts and shard tasks of `step`, no longer pending here (a step whose
        rollouts fail is submitted again by the next `submit_through`); submitted again now
        if they ended without running, the step before them having failed (its rollouts
        were then done again: the flow recomputes what it found damaged or lost)."""
        self.submit_through(step)
        prompts, shards = self.pending.pop(step)
        if not any(map(upstream_failed, shards)):
            return prompts, shards
        self.submit_through(step)
        return self.pending.pop(step)

    def running(self) -> int:
        """Shard tasks of later steps not ended: each holds a pool slot, or waits for one."""
        return sum(not ended(f) for _, shards in self.pending.values() for f in shards)

    def wait(self) -> None:
        """Until every submitted task has ended (the run's end: they write into the run)."""
        wait([f for prompts, shards in self.pending.values() for f in (prompts, *shards)])


def ended(future: PrefectFuture) -> bool:
    """Whether a task of the flow's thread runner has ended (well or not), without asking the server."""
    return future.wrapped_future.done()


def upstream_failed(future: PrefectFuture) -> bool:
    """Whether a task ended without running because a task it waited for failed (Prefect's NotReady)."""
    return ended(future) and future.state.name == "NotReady"
