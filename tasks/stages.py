"""Prefect tasks: one per stage, each a thin wrapper that holds a pool slot while the
stage runs and returns the stage's manifest (never tensors)."""

from __future__ import annotations

import os

from prefect import task
from prefect.cache_policies import NO_CACHE

from lsreplay import stages
from lsreplay.core.config import Config, ConfigError
from lsreplay.core.deadline import stage_deadline
from lsreplay.core.faults import InjectedError
from lsreplay.core.layout import CheckpointError
from lsreplay.core.run import InputCorrupt, Run
from lsreplay.core.run_lock import RunLockLost
from lsreplay.core.storage import CorruptEntry, MalformedEntry, MissingEntry
from lsreplay.data.sources import DatasetError
from lsreplay.distributed.hosts import run_on_host
from lsreplay.models.loading import ModelError
from lsreplay.rollout.vllm_engine import EngineStartError
from lsreplay.stages.policy import NonFiniteLoss
from lsreplay.state.resident import StateLost
from tasks.pool import pool_devices

# Errors that a retry cannot fix: the run stops at once with the message. (InputCorrupt and
# StateLost are not retried either: the flow recomputes what was damaged or lost.)
PERMANENT = (ConfigError, DatasetError, ModelError, CheckpointError, NonFiniteLoss, InjectedError,
             InputCorrupt, StateLost, MissingEntry, CorruptEntry, MalformedEntry, EngineStartError, RunLockLost)

# Transient failures (storage errors the store's own retries did not absorb, a flaky node,
# an injected fault) are retried this many times, after exponentially growing delays with
# jitter. LSREPLAY_RETRY_DELAY sets the first delay in seconds (tests make it small).
RETRIES = 2
RETRY_DELAY_ENV = "LSREPLAY_RETRY_DELAY"


def _transient(task, task_run, state) -> bool:
    return not isinstance(state.result(raise_on_failure=False), PERMANENT)


def retry_delays() -> list[float]:
    base = float(os.environ.get(RETRY_DELAY_ENV, "2"))
    return [base * 4**i for i in range(RETRIES)]


# Completed work is skipped by the stages themselves (their manifests in the run's
# store), so a new flow run of the same experiment resumes; Prefect's own cache,
# keyed by flow run, would not.
OPTIONS = dict(retries=RETRIES, retry_delay_seconds=retry_delays(), retry_jitter_factor=0.2,
               retry_condition_fn=_transient, cache_policy=NO_CACHE)


def _on_pool(stage: str, cfg: Config, step: int, count: int = 1, done_as: str | None = None,
             on: list[int] | None = None, **kwargs) -> dict:
    """Run `stage` holding `count` pool slots (those of devices `on`, if given), on the host
    of their devices (this process, or their Ray actor: lsreplay.distributed.hosts), passing it their
    indices as `devices=`. `done_as`: the name of its done marker, if not the stage's."""
    if done := Run(cfg).done(step, done_as or stage):  # finished earlier: no need to wait for a device
        return done
    with pool_devices(cfg.pool, count, on) as devices:
        return run_on_host(stage, cfg, step, devices, **kwargs)


# Each task run is named with its step: with asynchronous rollouts (rollout.max_staleness > 0)
# the UI's timeline shows those of several steps at once.
@task(name="sample-prompts", task_run_name="sample-prompts step {step}", **OPTIONS)
def sample_prompts(cfg: Config, step: int) -> dict:
    with stage_deadline(cfg, "prompts", step):
        return stages.sample_prompts(Run(cfg), step)


@task(name="generate-tree-shard", task_run_name="generate-tree-shard-{shard} step {step}", **OPTIONS)
def generate_tree_shard(cfg: Config, step: int, shard: int) -> dict:
    from flows.artifacts import Progress  # the UI side; lsreplay itself never imports Prefect

    # A Ray host cannot report to Prefect: the shard's live progress bar is this process's.
    progress = Progress(f"step {step}: rollout tokens sampled (shard {shard})") \
        if cfg.pool.task_runner == "thread" else None
    # A tensor-parallel vLLM engine spans rollout.vllm.tensor_parallel_size devices.
    count = cfg.rollout.vllm.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1
    return _on_pool("trees", cfg, step, count=count, done_as=stages.shard_name(shard),
                    on=cfg.pool.rollout_devices or None, shard=shard, progress=progress)


@task(name="collect-trees", task_run_name="collect-trees step {step}", **OPTIONS)
def collect_trees(cfg: Config, step: int) -> dict:
    with stage_deadline(cfg, "collect-trees", step):
        return stages.collect_trees(Run(cfg), step)


@task(name="cache-prefixes", task_run_name="cache-prefixes step {step}", **OPTIONS)
def cache_prefixes(cfg: Config, step: int) -> dict:
    return _on_pool("prefixes", cfg, step, on=update_devices(cfg, step - 1))


@task(name="train-policy", task_run_name="train-policy step {step}", **OPTIONS)
def train_policy(cfg: Config, step: int) -> dict:
    # One slot (device) per data-parallel rank of the backward.
    return _on_pool("policy", cfg, step, count=cfg.pool.devices_per_step, on=update_devices(cfg, step - 1))


def update_devices(cfg: Config, step: int) -> list[int] | None:
    """Under Ray, the pool devices of `step`'s policy update, if as many as an update takes:
    their host holds the next step's policy and its optimizer state, which any other host
    would fetch, load from a checkpoint or recompute (a drafter that took the lowest free
    device sent the next caching pass and update elsewhere). Otherwise those the update
    may take: all but pool.rollout_devices (None: any; the thread runner's one process
    moves the state to any device)."""
    if cfg.pool.task_runner != "ray" or step < 0 or not (done := Run(cfg).done(step, "policy")):
        return training_devices(cfg)
    devices = done.get("devices")
    return devices if devices and len(devices) == cfg.pool.devices_per_step else training_devices(cfg)


def training_devices(cfg: Config) -> list[int] | None:
    """The pool devices of every stage but the rollouts: those not in pool.rollout_devices;
    None (any device) when the rollouts have none of their own."""
    rollout = cfg.pool.rollout_devices
    return [d for d in range(cfg.pool.slots) if d not in rollout] if rollout else None


@task(name="distill-drafter", task_run_name="distill-drafter step {step}", **OPTIONS)
def distill_drafter(cfg: Config, step: int) -> dict:
    # Submitted while the next step's rollout shards run: it waits for the slot one frees.
    return _on_pool("drafter", cfg, step, on=training_devices(cfg))


@task(name="evaluate", task_run_name="evaluate step {step}", **OPTIONS)
def evaluate_policy(cfg: Config, step: int) -> dict:
    return _on_pool("eval", cfg, step, on=training_devices(cfg))


# The tasks by stage name (lsreplay.core.layout.STAGES, and "eval"); "trees" is its shards, then their collection.
STAGE_TASKS = {"prompts": sample_prompts, "trees": generate_tree_shard, "collect-trees": collect_trees,
               "prefixes": cache_prefixes, "policy": train_policy, "drafter": distill_drafter,
               "eval": evaluate_policy}


def configured(cfg: Config) -> dict:
    """STAGE_TASKS with the retry delays the environment asks for now. A try's time limit,
    pool.stage_timeout_seconds, is not Prefect's: Prefect bounds a task in a worker thread by
    interrupting it between bytecodes, which never stops a stage blocked in C or on a socket.
    A try that computes in this process ends the process past it (lsreplay.core.deadline); one
    on a Ray host is bounded where the flow waits for it (lsreplay.distributed.hosts.run_on_host)."""
    delays = retry_delays()
    return {name: t.with_options(retry_delay_seconds=delays) for name, t in STAGE_TASKS.items()}
