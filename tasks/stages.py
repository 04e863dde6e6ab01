"""Prefect tasks: one per stage, each a thin wrapper that holds a pool slot while the
stage runs and returns the stage's manifest (never tensors)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from lsreplay import stages
from lsreplay.checkpoint import CheckpointError
from lsreplay.config import Config, ConfigError
from lsreplay.data import DatasetError
from lsreplay.models import ModelError
from lsreplay.run import Run
from lsreplay.stages.policy import NonFiniteLoss
from tasks.pool import pool_devices

# Errors that a retry cannot fix: the run stops at once with the message.
PERMANENT = (ConfigError, DatasetError, ModelError, CheckpointError, NonFiniteLoss)


def _transient(task, task_run, state) -> bool:
    return not isinstance(state.result(raise_on_failure=False), PERMANENT)


# Completed work is skipped by the stages themselves (their manifests in the run's
# store), so a new flow run of the same experiment resumes; Prefect's own cache,
# keyed by flow run, would not. Retries cover transient failures (storage, a flaky node).
RETRIES = dict(retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=_transient, cache_policy=NO_CACHE)


def _on_pool(stage, cfg: Config, step: int) -> dict:
    with pool_devices(cfg.pool):
        return stage(Run(cfg), step)


@task(name="sample-prompts", **RETRIES)
def sample_prompts(cfg: Config, step: int) -> dict:
    return stages.sample_prompts(Run(cfg), step)


@task(name="generate-trees", **RETRIES)
def generate_trees(cfg: Config, step: int) -> dict:
    return _on_pool(stages.generate_trees, cfg, step)


@task(name="cache-prefixes", **RETRIES)
def cache_prefixes(cfg: Config, step: int) -> dict:
    return _on_pool(stages.cache_prefixes, cfg, step)


@task(name="train-policy", **RETRIES)
def train_policy(cfg: Config, step: int) -> dict:
    return _on_pool(stages.train_policy, cfg, step)


@task(name="distill-drafter", **RETRIES)
def distill_drafter(cfg: Config, step: int) -> dict:
    return _on_pool(stages.distill_drafter, cfg, step)
