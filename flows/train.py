r"""The training flow: the RL step loop, one task per stage.

    [eval] -> prompts -> rollout shards -> trees -> prefix cache -> policy update
                            \-> (slots freed) drafter distillation of the previous step

With rollout.max_staleness = K > 0 the rollouts run ahead of the updates: those of step t
sample with the policy after update t - K (lsreplay.stages.versions), and are submitted as
soon as that update has ended, so that steps t + 1 .. t + K sample while step t's update
runs (flows.rollouts); pool.rollout_devices gives them devices of their own.

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
from contextlib import contextmanager
from functools import partial

from prefect import flow, get_run_logger
from prefect.futures import as_completed

from flows import artifacts
from flows.rollouts import RolloutsAhead, ended
from lsreplay.core import run_lock
from lsreplay.core.config import Config, ConfigError, load_config
from lsreplay.core.layout import STAGES
from lsreplay.core.run import InputCorrupt, StageFailed, open_run_config
from lsreplay.distributed.hosts import flush_writers, release_hosts
from lsreplay.metrics.records import eval_record, step_record
from lsreplay.metrics.trackers import Trackers
from lsreplay.stages import evaluated
from lsreplay.stages.prefixes import release_read
from lsreplay.stages.preflight import preflight
from lsreplay.state import checkpointing
from lsreplay.state.resident import RESIDENT, StateLost
from tasks.pool import ensure_pool, release_parked
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
    run = preflight(cfg, force)
    with run_lock.hold(run.store) as lock:  # one writer per run (the command may hold it already)
        return _run_locked(run, force, lock)


class _Recorded:
    """A task whose every submission's future is kept in `futures`."""

    def __init__(self, task, futures: list):
        self.task, self.futures = task, futures

    def submit(self, **kwargs):
        future = self.task.submit(**kwargs)
        self.futures.append(future)
        return future


@contextmanager
def _settled(futures: list):
    """On leaving the block, however: the submitted tasks that have not started cancelled, the
    others waited for. A failed stage ends the flow's body while other shards and the drafter
    may still write: the run's lock, and the hosts, stay until they end."""
    try:
        yield
    finally:
        for future in futures:
            if (wrapped := getattr(future, "wrapped_future", None)) is not None:
                wrapped.cancel()
        for future in futures:
            future.wait()


def _run_locked(run, force: bool, lock) -> list[dict]:
    logger = get_run_logger()
    run.save_or_check_config(force=force)
    run.store.sweep_interrupted_writes()  # left by a killed run; nothing of this one writes yet
    cfg = run.cfg  # its thread count pinned: every stage computes with it
    checkpointing.WRITER.forget(run)  # what an earlier flow of the run in this process failed to write
    ensure_pool(cfg.pool)
    logger.info("run %s: %d steps, storage %s, %d torch threads", cfg.run_dir, cfg.steps, run.store.uri,
                cfg.threads)
    checkpointing.rewind(run)  # this process holds nothing yet
    submitted: list = []
    tasks = {name: _Recorded(task, submitted) for name, task in configured(cfg).items()}
    trackers = Trackers(cfg)  # report_to: this process reports, the stages' never do
    ahead = RolloutsAhead(tasks, cfg)
    try:
        with ray_session(cfg), _settled(submitted):
            return _run_steps(run, tasks, cfg, trackers, lock, ahead)
    finally:
        ahead.wait()  # rollouts submitted ahead write into the run: not past its lock
        release_parked()  # the slots the last stage left for a next one: there is none
        checkpointing.WRITER.wait()
        RESIDENT.release(run)
        trackers.close()


def _run_steps(run, tasks: dict, cfg: Config, trackers: Trackers, lock, ahead: RolloutsAhead) -> list[dict]:
    logger = get_run_logger()
    progress = artifacts.Progress(f"RL steps finished of {cfg.steps}", every=0)
    progress(0.0)
    recomputes: Counter = Counter()
    table = artifacts.MetricsTable(run)
    step = 0
    while step <= cfg.steps:
        lock.check()  # an S3 lease another process took over: stop before writing beside it
        try:
            if evaluated(cfg, step):  # the policy after `step` updates, on the held-out prompts
                _evaluate(run, tasks, cfg, step, trackers)
                table()
            if step == cfg.steps:
                break
            manifests = _step(run, tasks, cfg, step, trackers, ahead)
        except InputCorrupt as e:
            _count(recomputes, (e.step, e.stage), e)
            logger.warning("%s", e)
            run.invalidate(e.step, e.stage)
            step = min(step, e.step)
            continue
        except StateLost as e:  # an update held in memory only is gone (or its checkpoint damaged)
            _count(recomputes, (e.step, "policy"), e)
            logger.warning("%s", e)
            step = min(step, checkpointing.rewind(run))
            continue
        record = step_record(step, manifests)
        _record(run, trackers, record)
        logger.info("step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in record.items()
                                                    if isinstance(v, float)))
        table()
        step += 1
        progress(step / cfg.steps)
    failures = flush_writers(cfg)  # the hosts' writers, not only this process's: the last write may be a host's
    if checkpointing.manifest(run, cfg.steps - 1) is None:  # the run's result must be in the store
        raise StageFailed("policy", cfg.steps - 1, "its checkpoint could not be written: "
                          + ("; ".join(failures[-3:]) or "no write of it finished"))
    checkpointing.prune(run)  # the last update is committed now: keep_last checkpoints stand, not one more
    run.store.sweep_interrupted_writes()  # a finished run holds nothing half-written, whoever wrote it
    artifacts.summary(run)
    return run.metrics()


def _count(recomputes: Counter, where: tuple[int, str], error: Exception) -> None:
    """Count a recompute of (step, stage); the run stops if the same one keeps failing."""
    recomputes[where] += 1
    if recomputes[where] > MAX_RECOMPUTES:
        step, stage = where
        get_run_logger().error("stage %s of step %d failed: its input is unusable again after %d recomputes",
                               stage, step, MAX_RECOMPUTES)
        raise StageFailed(stage, step, f"its input keeps coming out unusable: {error}") from error


def _record(run, trackers: Trackers, record: dict) -> None:
    """A metrics line into metrics.jsonl (merged with its step's) and to the trackers."""
    run.append_metrics(record)
    trackers.log(record)


def _evaluate(run, tasks: dict, cfg: Config, step: int, trackers: Trackers) -> None:
    manifest = _result(tasks["eval"].submit(cfg=cfg, step=step), "eval", step)
    record = eval_record(step, manifest)
    _record(run, trackers, record)
    sampled = (f", sampled {record['eval_sample_accuracy']:.3f} [{record['eval_sample_accuracy_lo']:.3f}, "
               f"{record['eval_sample_accuracy_hi']:.3f}]" if "eval_sample_accuracy" in record else "")
    get_run_logger().info("eval after %d updates: held-out accuracy greedy %.3f [%.3f, %.3f]%s (%d prompts)", step,
                          record["eval_accuracy"], record["eval_accuracy_lo"], record["eval_accuracy_hi"], sampled,
                          record["eval_prompts"])


@contextmanager
def ray_session(cfg: Config):
    """pool.task_runner=ray: connect this process to the Ray cluster at pool.ray_address
    (empty: a Ray instance already initialised here, else a new local one), where each
    pool device's host runs (lsreplay.distributed.hosts); end the run's hosts afterwards."""
    if cfg.pool.task_runner == "thread":  # validated by lsreplay.core.config: "thread" or "ray"
        yield
        return
    try:
        import ray
    except ImportError as e:
        raise ConfigError("pool.task_runner=ray needs ray: pip install 'lsreplay[ray]'") from e
    if not ray.is_initialized():
        ray.init(address=cfg.pool.ray_address or None, log_to_driver=False)
    try:
        yield
    finally:
        release_hosts(cfg)


def _result(future, stage: str, step: int) -> dict:
    """A stage's manifest; a failure becomes StageFailed naming the stage and step."""
    try:
        return future.result()
    except (InputCorrupt, StateLost, run_lock.RunLockLost):
        raise
    except Exception as e:
        get_run_logger().error("stage %s of step %d failed: %s: %s", stage, step, type(e).__name__, e)
        raise StageFailed(stage, step, e) from e


def _step(run, tasks: dict, cfg: Config, step: int, trackers: Trackers, ahead: RolloutsAhead) -> dict[str, dict]:
    """prompts -> rollout shards (with the previous step's drafter on freed slots) -> trees
    -> prefix cache -> policy; the last step then trains its own drafter to the end. The
    rollouts of the next rollout.max_staleness steps are submitted first: they run while
    this step's update does."""
    def stage(name: str) -> dict:
        return _result(tasks[name].submit(cfg=cfg, step=step), name, step)

    ahead.submit_through(step)
    manifests = _rollouts(run, tasks, cfg, step, trackers, ahead)
    manifests["prefixes"] = stage("prefixes")
    manifests["policy"] = stage("policy")
    release_read(run, step, "policy")
    if cfg.drafter.enabled and step == cfg.steps - 1:
        manifests["drafter"] = stage("drafter")
        release_read(run, step, "drafter")
    return manifests


def _rollouts(run, tasks: dict, cfg: Config, step: int, trackers: Trackers, ahead: RolloutsAhead) -> dict:
    """The step's prompts and rollout shards (submitted by `ahead`), then their collected
    trees. The previous step's drafter starts on a free slot (an idle one, or the first a
    finished shard frees while others still run; with pool.rollout_devices, the update's,
    idle until these trees are there) and trains until the last shard is collected
    (lsreplay.stages.drafter); then its metrics join the previous step's line. If a shard
    fails, the drafter trains its full budget before the flow stops."""
    prompts, shards = ahead.take(step)
    manifests = {"prompts": _result(prompts, "prompts", step)}
    spot = cfg.drafter.enabled and step > 0
    start_drafter = partial(tasks["drafter"].submit, cfg=cfg, step=step - 1)

    def idle() -> bool:  # a slot that no shard holds or waits for, of this step or one ahead
        running = sum(not ended(f) for f in shards)
        return running > 0 and (bool(cfg.pool.rollout_devices) or cfg.pool.slots > running + ahead.running())

    drafter = start_drafter() if spot and idle() else None
    for future in as_completed(shards):
        _result(future, "trees", step)
        if drafter is None and spot and idle():
            drafter = start_drafter()
    manifests["trees"] = _result(tasks["collect-trees"].submit(cfg=cfg, step=step), "trees", step)
    if drafter is None and spot:  # no rollouts were left to overlap: it finds them over, trains nothing
        drafter = start_drafter()
    if drafter is not None:
        previous = {name: run.done(step - 1, name) for name in STAGES if name != "drafter"}
        previous["drafter"] = _result(drafter, "drafter", step - 1)
        release_read(run, step - 1, "drafter")
        if None not in previous.values():
            _record(run, trackers, step_record(step - 1, previous))
    return manifests
