"""Serve the training flow as a Prefect deployment with a schedule (`lsreplay serve`).

For deployments run by a work pool's workers instead, see prefect.yaml at the repository
root (`prefect deploy`).
"""

from __future__ import annotations

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment

from flows.train import train

# Every scheduled run of a deployment resumes the same run: one at a time. A run due while
# the one before still runs waits for it (Prefect shows it AwaitingConcurrencySlot), then
# continues the run from where that one left it. (Two deployments of one run directory:
# the run's own lock refuses the second, lsreplay.core.run_lock.)
ONE_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)


def deployment(config_path: str | None, overrides: list[str], cron: str | None = None,
               interval: float | None = None, name: str = "lsreplay-train") -> RunnerDeployment:
    """A deployment of the training flow with these parameters and schedule, one flow run at
    a time. Secrets must not be in `overrides` (the CLI moves them to the environment of the
    serving process, which the flow runs it starts inherit)."""
    if (cron is None) == (interval is None):
        raise ValueError("give exactly one of cron and interval")
    return train.to_deployment(name=name, cron=cron, interval=interval, tags=["lsreplay"],
                               parameters={"config_path": config_path, "overrides": list(overrides)},
                               concurrency_limit=ONE_AT_A_TIME,
                               description="RL post-training with branch replay (lsreplay)")


def serve(config_path: str | None, overrides: list[str], cron: str | None = None,
          interval: float | None = None, name: str = "lsreplay-train") -> None:
    """Register the deployment and run its scheduled flow runs until interrupted."""
    from prefect import serve as prefect_serve

    prefect_serve(deployment(config_path, overrides, cron, interval, name))
