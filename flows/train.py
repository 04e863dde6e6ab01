r"""The training flow: the RL step loop, one task per stage.

    [eval] -> prompts -> rollout shards -> trees -> prefix cache -> policy update
                            \-> (slots freed) drafter distillation of the previous step

With eval.every > 0, the policy is evaluated on the held-out prompts before steps 0,
eval.every, ... and after the last update (lsreplay.stages.evaluate).

The drafter of step t trains on step t's hidden states during step t+1's rollouts, on
the pool slots that finished shards free, until those rollouts end (TLT's spot training);
the last step's drafter trains after its policy update.

A stage that finished earlier (its done marker and files are in the store) returns its
manifest at once, so running the flow again on the same run resumes it. A stage whose
finished output turns out missing or damaged when a later stage reads it is recomputed.
A stage that fails for good stops the run with "stage X of step N failed: cause"; the
last committed checkpoint stays as it was.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from functools import partial

from prefect import flow, get_run_logger
from prefect.futures import as_completed

from flows import artifacts
from lsreplay.config import Config, ConfigError, load_config
from lsreplay.metrics import eval_record, step_record
from lsreplay.run import STAGES, InputCorrupt, StageFailed, open_run_config, preflight
from lsreplay.stages import evaluated
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
    while step <= cfg.steps:
        try:
            if evaluated(cfg, step):  # the policy after `step` updates, on the held-out prompts
                _evaluate(run, tasks, cfg, step, runner)
            if step == cfg.steps:
                break
            manifests = _step(run, tasks, cfg, step, runner)
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


def _evaluate(run, tasks: dict, cfg: Config, step: int, runner) -> None:
    manifest = _result(_submit(tasks["eval"], runner, cfg, "eval", step=step), "eval", step)
    record = eval_record(step, manifest)
    run.append_metrics(record)
    sampled = (f", sampled {record['eval_sample_accuracy']:.3f} [{record['eval_sample_accuracy_lo']:.3f}, "
               f"{record['eval_sample_accuracy_hi']:.3f}]" if "eval_sample_accuracy" in record else "")
    get_run_logger().info("eval after %d updates: held-out accuracy greedy %.3f [%.3f, %.3f]%s (%d prompts)", step,
                          record["eval_accuracy"], record["eval_accuracy_lo"], record["eval_accuracy_hi"], sampled,
                          record["eval_prompts"])
    artifacts.metrics_table(run)


# Stages that hold accelerator pool slots (tasks.stages._on_pool), and so Ray GPUs.
ACCELERATOR_STAGES = ("trees", "prefixes", "policy", "drafter", "eval")


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


def _submit(task, runner, cfg: Config, stage: str, **parameters):
    """Start a stage's task: on the flow's thread pool, or as a Ray task; returns its future."""
    parameters = {"cfg": cfg, **parameters}
    if runner is None:
        return task.submit(**parameters)
    from prefect_ray.context import remote_options

    with remote_options(**_ray_options(cfg, stage)):
        return runner.submit(task, parameters=parameters)


def _result(future, stage: str, step: int) -> dict:
    """A stage's manifest; a failure becomes StageFailed naming the stage and step."""
    try:
        return future.result()
    except InputCorrupt:
        raise
    except Exception as e:
        get_run_logger().error("stage %s of step %d failed: %s: %s", stage, step, type(e).__name__, e)
        raise StageFailed(stage, step, e) from e


def _step(run, tasks: dict, cfg: Config, step: int, runner=None) -> dict[str, dict]:
    """prompts -> rollout shards (with the previous step's drafter on freed slots) -> trees
    -> prefix cache -> policy; the last step then trains its own drafter to the end."""
    def stage(name: str) -> dict:
        return _result(_submit(tasks[name], runner, cfg, name, step=step), name, step)

    manifests = {"prompts": stage("prompts"), "trees": _rollouts(run, tasks, cfg, step, runner)}
    manifests["prefixes"] = stage("prefixes")
    manifests["policy"] = stage("policy")
    if cfg.drafter.enabled and step == cfg.steps - 1:
        manifests["drafter"] = stage("drafter")
    return manifests


def _rollouts(run, tasks: dict, cfg: Config, step: int, runner) -> dict:
    """The step's rollout shards, then their collected trees. The previous step's drafter
    starts on a free slot (an idle one, or the first a finished shard frees) and trains
    until the last shard is collected (lsreplay.stages.drafter); then its metrics join the
    previous step's line. If a shard fails, the drafter trains its full budget before the
    flow stops."""
    shards = [_submit(tasks["trees"], runner, cfg, "trees", step=step, shard=k) for k in range(cfg.rollout.shards)]
    spot = cfg.drafter.enabled and step > 0
    start_drafter = partial(_submit, tasks["drafter"], runner, cfg, "drafter", step=step - 1)
    # Slots no shard needs are idle from the start. Otherwise the drafter waits for a shard
    # to finish, so that it never holds a slot a shard is still waiting for.
    drafter = start_drafter() if spot and cfg.pool.slots > cfg.rollout.shards else None
    for future in as_completed(shards):
        _result(future, "trees", step)
        if drafter is None and spot:
            drafter = start_drafter()
    trees = _result(_submit(tasks["collect-trees"], runner, cfg, "collect-trees", step=step), "trees", step)
    if drafter is not None:
        previous = {name: run.done(step - 1, name) for name in STAGES if name != "drafter"}
        previous["drafter"] = _result(drafter, "drafter", step - 1)
        if None not in previous.values():
            run.append_metrics(step_record(step - 1, previous))
    return trees
