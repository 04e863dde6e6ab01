r"""The training flow: the RL step loop, one task per stage.

    prompts -> trees -> prefix cache -> policy update
                                     \-> drafter distillation

A stage that finished earlier (its done marker and files are in the store) returns its
manifest at once, so running the flow again on the same run resumes it. A stage whose
finished output turns out missing or damaged when a later stage reads it is recomputed.
A stage that fails for good stops the run with "stage X of step N failed: cause"; the
last committed checkpoint stays as it was.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext

from prefect import flow, get_run_logger

from flows import artifacts
from lsreplay.config import Config, ConfigError, load_config
from lsreplay.metrics import step_record
from lsreplay.run import STAGES, InputCorrupt, StageFailed, open_run_config, preflight
from tasks.pool import ensure_pool
from tasks.stages import configured

# How often the same stage output may be found damaged and recomputed before the run stops.
MAX_RECOMPUTES = 2


@flow(name="lsreplay-train")
def train(config_path: str | None = None, overrides: list[str] | None = None, force: bool = False,
          resume: str | None = None) -> list[dict]:
    """Run (or resume) the configured number of RL steps; returns the per-step metrics.

    `resume`: a run directory or storage URI whose saved config to continue (overrides on
    top, e.g. steps=5). Credentials never go into these parameters: they come from the
    config file or the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)."""
    overrides = list(overrides or [])
    cfg = open_run_config(resume, overrides) if resume else load_config(config_path, overrides)
    return run_steps(cfg, force)


def run_steps(cfg: Config, force: bool = False) -> list[dict]:
    logger = get_run_logger()
    run = preflight(cfg, force)
    run.save_or_check_config(force=force)
    ensure_pool(cfg.pool)
    logger.info("run %s: %d steps, storage %s", cfg.run_dir, cfg.steps, run.store.uri)
    tasks = configured()
    with task_runner(cfg) as runner:
        return _run_steps(run, tasks, runner, cfg)


def _run_steps(run, tasks: dict, runner, cfg: Config) -> list[dict]:
    logger = get_run_logger()
    progress = artifacts.Progress(f"RL steps finished of {cfg.steps}", every=0)
    progress(0.0)
    recomputes: Counter = Counter()
    step = 0
    while step < cfg.steps:
        try:
            manifests = _step(tasks, cfg, step, runner)
        except InputCorrupt as e:
            recomputes[e.step, e.stage] += 1
            if recomputes[e.step, e.stage] > MAX_RECOMPUTES:
                logger.error("stage %s of step %d failed: its output is damaged again after %d recomputes",
                             e.stage, e.step, MAX_RECOMPUTES)
                raise StageFailed(e.stage, e.step, f"its output keeps coming out unusable: {e}") from e
            logger.warning("%s", e)
            run.invalidate(e.step, e.stage)
            step = min(step, e.step)
            continue
        record = step_record(step, manifests)
        run.append_metrics(record)
        logger.info("step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in record.items()
                                                    if isinstance(v, float)))
        artifacts.metrics_table(run)
        step += 1
        progress(step / cfg.steps)
    artifacts.summary(run)
    return run.metrics()


# Stages that hold accelerator pool slots (tasks.stages._on_pool), and so Ray GPUs.
ACCELERATOR_STAGES = ("trees", "prefixes", "policy", "drafter")


def task_runner(cfg: Config):
    """pool.task_runner: "thread" (default) runs each stage's task in the flow's own
    process; "ray" submits each to prefect-ray's RayTaskRunner on the Ray cluster at
    pool.ray_address (empty: a Ray instance already initialised in this process, else a
    new local one). Yields the runner, or None for "thread"."""
    if cfg.pool.task_runner == "thread":  # validated by lsreplay.config: "thread" or "ray"
        return nullcontext(None)
    try:
        from prefect_ray import RayTaskRunner
    except ImportError as e:
        raise ConfigError("pool.task_runner=ray needs prefect-ray and ray: pip install 'lsreplay[ray]'") from e
    return RayTaskRunner(address=cfg.pool.ray_address or None)


def _ray_options(cfg: Config, stage: str) -> dict:
    """What a stage's Ray task asks the cluster for: pool.ray_gpus GPUs per pool slot it holds."""
    if stage not in ACCELERATOR_STAGES or cfg.pool.ray_gpus <= 0:
        return {}
    return {"num_gpus": cfg.pool.ray_gpus * (cfg.pool.devices_per_step if stage == "policy" else 1)}


def _run_stage(task, runner, cfg: Config, stage: str, step: int) -> dict:
    if runner is None:
        return task(cfg, step)  # in this thread
    from prefect_ray.context import remote_options

    # Submitted and awaited one at a time: each stage lands on a Ray worker, in order.
    with remote_options(**_ray_options(cfg, stage)):
        future = runner.submit(task, parameters={"cfg": cfg, "step": step})
    return future.result()


def _step(tasks: dict, cfg: Config, step: int, runner=None) -> dict[str, dict]:
    manifests = {}
    for stage in STAGES:
        if stage == "drafter" and not cfg.drafter.enabled:
            continue
        try:
            manifests[stage] = _run_stage(tasks[stage], runner, cfg, stage, step)
        except InputCorrupt:
            raise
        except Exception as e:
            get_run_logger().error("stage %s of step %d failed: %s: %s", stage, step, type(e).__name__, e)
            raise StageFailed(stage, step, e) from e
    return manifests
