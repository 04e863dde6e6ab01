"""Policy checkpoints on a schedule: every `checkpoint.every` steps (and the last), written in
the background while the next step runs, the newest `checkpoint.keep_last` committed ones kept.

The policy stage takes a snapshot of the trainable state into host memory (the only part
the step waits for) and hands it to this process's writer thread. A checkpoint is complete
once its `checkpoint.json` (every file with its size and sha256), written last, is there
and the files have those sizes: a process killed at any moment of a write leaves no such
file, and a resume starts from the newest committed checkpoint: complete, and its step's
policy stage finished (`rewind`, below).

Layout: checkpoints/policy/step_NNNN/{model.safetensors (float32 master weights),
critic.safetensors (the value head's, with algo.critic), optimizer.safetensors,
optimizer.json, rng.safetensors, meta.json, hf/ (the policy as an HF
model folder in the compute dtype: lsreplay.models.hf_folder; its weights a hard link to the
masters where they are the same bytes), checkpoint.json}. With model.lora the model file holds
the adapters' masters alone, and adapter/ (a PEFT adapter folder: lsreplay.models.lora) stands
where hf/ would: megabytes, not the base again; `lsreplay export` merges them.
Drafter checkpoints older than the one a resume from the oldest kept policy checkpoint
would load go with it.
"""

from __future__ import annotations

import contextvars
import logging
import os
import queue
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from lsreplay.algos.critic import split_critic
from lsreplay.core import faults
from lsreplay.core.config import ConfigError
from lsreplay.core.layout import CheckpointError
from lsreplay.core.run import Run
from lsreplay.core.storage import CorruptEntry, MalformedEntry, MissingEntry, Store, is_file_record
from lsreplay.models.hf_folder import write_hf_folder
from lsreplay.models.lora import merged_weights, write_adapter_folder
from lsreplay.models.train_state import TrainState
from lsreplay.state.checkpoint import (CRITIC_FILE, MODEL_FILE, load_weights, save_optimizer, save_rng,
                                 save_weights)

log = logging.getLogger(__name__)

COMPLETE = "checkpoint.json"
HF = "hf"  # the policy as an HF model folder (lsreplay.models.hf_folder)
ADAPTER = "adapter"  # with model.lora: the adapters as a PEFT folder (lsreplay.models.lora)
POLICY = "checkpoints/policy"
DRAFTER = "checkpoints/drafter"


def due(run: Run, step: int) -> bool:
    """Whether the policy after `step` is checkpointed: every checkpoint.every steps, and the last."""
    return (step + 1) % run.cfg.checkpoint.every == 0 or step == run.cfg.steps - 1


@dataclass
class Snapshot:
    """The trainable state after a step, copied to host memory: what a checkpoint holds."""

    step: int
    weights: dict[str, torch.Tensor]  # float32 masters by parameter name
    optimizer: dict  # the optimizer's state_dict(), tensors copied
    rng: dict[str, torch.Generator]
    seconds: float  # how long taking it held the step up


def snapshot(run: Run, step: int, train: TrainState) -> Snapshot:
    start = time.perf_counter()
    weights = {name: _host_copy(t) for name, t in train.master_tensors().items()}
    state = train.optimizer.state_dict()
    optimizer = {"state": {i: {k: _host_copy(v) if torch.is_tensor(v) else v for k, v in s.items()}
                           for i, s in state["state"].items()},
                 "param_groups": state["param_groups"]}
    return Snapshot(step, weights, optimizer, {"rollout": run.generator(step + 1, "trees")},
                    time.perf_counter() - start)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that later in-place updates of `t` do not reach."""
    return t.detach().to("cpu", copy=True)


def write(run: Run, snap: Snapshot) -> dict:
    """Write the snapshot's files and its HF model folder, then checkpoint.json; returns what
    checkpoint.json holds."""
    start = time.perf_counter()
    prefix = run.checkpoint("policy", snap.step)
    weights, critic = split_critic(snap.weights)
    masters = save_weights(run.store, prefix, weights, {"step": snap.step})
    faults.hook("checkpoint", snap.step, "mid")  # weights written, no checkpoint.json yet
    parts = [masters, save_optimizer(run.store, prefix, snap.optimizer), save_rng(run.store, prefix, snap.rng)]
    files = {name: entry for part in parts for name, entry in part["files"].items()}
    if critic:
        files[CRITIC_FILE] = run.store.write_tensors(f"{prefix}/{CRITIC_FILE}", critic)
    if run.cfg.model.lora.enabled:
        adapter = write_adapter_folder(run.store, f"{prefix}/{ADAPTER}", weights, run.cfg.model)
        files.update({f"{ADAPTER}/{name}": entry for name, entry in adapter.items()})
    else:
        hf = write_hf_folder(run.store, f"{prefix}/{HF}", weights, run.cfg.model,
                             int(run.cfg.checkpoint.hf_shard_gb * 2**30), same_bytes_as=masters["files"][MODEL_FILE])
        files.update({f"{HF}/{name}": entry for name, entry in hf.items()})
    record = {"step": snap.step, "config_hash": run.config_hash, "snapshot_seconds": snap.seconds,
              "write_seconds": time.perf_counter() - start,
              "files": {name: {k: e[k] for k in ("key", "bytes", "sha256")} for name, e in files.items()}}
    run.store.write_json(f"{prefix}/{COMPLETE}", record, commit=True)
    return record


def manifest(run: Run, step: int) -> dict | None:
    """The checkpoint manifest ({"prefix", "files"}) of the complete policy checkpoint of
    `step`, for verified loading; None if it is not complete."""
    prefix = run.checkpoint("policy", step)
    try:
        record = run.store.read_json(f"{prefix}/{COMPLETE}")
    except (MissingEntry, CorruptEntry):
        return None
    if not (isinstance(record, dict) and isinstance(record.get("files"), dict)
            and all(map(is_file_record, record["files"].values()))):
        raise MalformedEntry(f"{run.store.url(f'{prefix}/{COMPLETE}')} is valid JSON but not a checkpoint record (a "
                             "'files' mapping of each file's key, bytes and sha256): another program wrote it or it "
                             f"was edited; delete the folder {run.store.url(prefix)} (the run then resumes from an "
                             "older checkpoint) or restore the record")
    sizes = run.store.sizes(prefix)
    if any(sizes.get(e["key"]) != e["bytes"] for e in record["files"].values()):
        return None
    return {"prefix": prefix, "files": record["files"]}


def complete_steps(run: Run, steps: set[int] | None = None) -> list[int]:
    """Steps with a complete policy checkpoint, oldest first (of `steps`, the steps that
    have policy checkpoint files, if already listed)."""
    return [s for s in sorted(_steps(run, POLICY) if steps is None else steps) if manifest(run, s) is not None]


def committed_steps(run: Run, steps: set[int] | None = None) -> list[int]:
    """Steps whose policy checkpoint is complete and whose update finished (its policy
    stage's done marker is there), oldest first: what a resume starts from (`rewind`). A
    process killed between a checkpoint's write and its stage's done marker leaves a complete
    checkpoint that is not committed: the update runs again from the committed one before it,
    so that one must stay (`prune`)."""
    return [s for s in complete_steps(run, steps) if run.done(s, "policy") is not None]


def prune(run: Run) -> list[int]:
    """Delete policy checkpoints beyond the newest checkpoint.keep_last committed ones (and
    uncommitted ones older than those), and the drafters nothing after them can load; returns
    the policy steps deleted. Never the newest committed one, nor any newer one: a checkpoint
    written in the background is complete before its step's done marker, so until that marker
    is there keep_last + 1 checkpoints stand. With rollout.max_staleness = K, at least K + 1
    stand: a resume from the newest samples the rollouts still to do with versions up to K
    older (lsreplay.stages.versions), loaded from their checkpoints."""
    keep, present = run.cfg.checkpoint.keep_last, _steps(run, POLICY)
    keep = keep and max(keep, run.cfg.rollout.max_staleness + 1)
    committed = committed_steps(run, present)
    if keep == 0 or len(committed) <= keep:
        return []
    oldest_kept = committed[-keep]
    deleted = sorted(s for s in present if s < oldest_kept)
    for step in deleted:
        run.store.delete_prefix(run.checkpoint("policy", step))
    _prune_drafters(run, oldest_kept)
    return deleted


def _prune_drafters(run: Run, oldest_kept: int) -> None:
    """A policy checkpoint of step s means every drafter up to step s - 1 finished, so a
    resume from `oldest_kept` or later loads (for rollouts, or to warm-start the next
    drafter) the newest trained drafter before it or a newer one: delete the older ones."""
    steps = _steps(run, DRAFTER)
    trained = [s for s in steps if s < oldest_kept and (done := run.done(s, "drafter")) and done.get("checkpoint")]
    for step in (s for s in steps if trained and s < max(trained)):
        run.release(step, "drafter", run.checkpoint("drafter", step), "checkpoint")


def _step_folders(run: Run) -> set[int]:
    """The steps that have entries of their own (step_NNNN/...), from one listing of the store."""
    return {int(m[1]) for key in run.store.list() if (m := re.match(r"step_(\d+)/", key))}


def _steps(run: Run, folder: str) -> set[int]:
    """The steps that have files under `folder` (checkpoints/<kind>)."""
    return {int(k[len(folder) + 1:].split("/")[0].removeprefix("step_")) for k in run.store.list(folder)}


class Writer:
    """One background thread per process writing snapshots in order, then pruning. At most
    one snapshot waits besides the one being written, so host memory holds at most two."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Per run (its store's URI): the writes that failed, as "step N: Error: message". A
        # process may serve several runs, one after another (tests) or side by side.
        self._failures: dict[str, list[str]] = {}

    def submit(self, run: Run, snap: Snapshot) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="checkpoint-writer", daemon=True)
                self._thread.start()
        # Written in the submitter's context: its log lines go where the submitter's go (the
        # policy task's, in the Prefect UI).
        self._queue.put((run, snap, contextvars.copy_context()))

    def wait(self) -> None:
        """Block until every submitted checkpoint is written (or failed: see `failed`)."""
        self._queue.join()

    def failed(self, run: Run) -> list[str]:
        """The writes of `run`'s checkpoints that failed, oldest first."""
        with self._lock:
            return list(self._failures.get(run.store.uri, []))

    def forget(self, run: Run) -> None:
        """Forget `run`'s failed writes (a new flow of the run starts from what is in the store)."""
        with self._lock:
            self._failures.pop(run.store.uri, None)

    def _loop(self) -> None:
        # At normal priority. The write is mostly copying and hashing in C with the GIL
        # released, about 2 s of CPU for SmolLM2's 1.5 GB (a few percent of the step it
        # overlaps). Under SCHED_IDLE, as before, it ran only where the step left a core idle:
        # one write took 35-135 s, so the next step's `submit` waited for it, and whenever the
        # starved thread held the GIL the step's own thread waited on it too.
        while True:
            run, snap, context = self._queue.get()
            try:
                context.run(self._write, run, snap)
            finally:
                self._queue.task_done()

    def _write(self, run: Run, snap: Snapshot) -> None:
        try:
            record = write(run, snap)
            deleted = prune(run)
            log.info("policy checkpoint of step %d written in %.1f s in the background%s", snap.step,
                     record["write_seconds"], f"; deleted those of steps {deleted}" if deleted else "")
        except Exception as e:  # raised by the run's next save (`save`), in the stage that calls it
            with self._lock:
                self._failures.setdefault(run.store.uri, []).append(f"step {snap.step}: {type(e).__name__}: {e}")
            log.error("policy checkpoint of step %d failed: %s: %s", snap.step, type(e).__name__, e)


WRITER = Writer()


class CheckpointWriteFailed(CheckpointError):
    """A background checkpoint write failed; the next save raises it (`save`)."""


def save(run: Run, step: int, train: TrainState) -> dict:
    """Checkpoint the state after `step` if due: snapshot now, write in the background (or
    now, with checkpoint.background=false). Returns {"checkpoint": prefix or None, "state_seconds"}.

    A background write of this run that failed fails this call, due or not, as torchtitan's
    next save raises what its async checkpoint's future raised: the run stops at the next step,
    not hundreds of steps later with nothing durable since. A due save first waits for the
    write before it (it had a whole step to finish), so that its failure cannot slip past."""
    start = time.perf_counter()
    if due(run, step) and run.cfg.checkpoint.background:
        WRITER.wait()
    if failed := WRITER.failed(run):
        raise CheckpointWriteFailed(
            f"the background write of the policy checkpoint of {failed[-1]}; the run stops rather than train on "
            "with nothing durable after the newest complete checkpoint. Free space in the store or fix its "
            "permissions, then `lsreplay resume`: it continues from the newest complete checkpoint")
    if not due(run, step):
        return {"checkpoint": None, "state_seconds": 0.0}
    snap = snapshot(run, step, train)
    if run.cfg.checkpoint.background:
        WRITER.submit(run, snap)
    else:
        write(run, snap)
        prune(run)
    return {"checkpoint": run.checkpoint("policy", step), "state_seconds": time.perf_counter() - start}


def rewind(run: Run) -> int:
    """Forget the policy updates after the newest committed checkpoint (`committed_steps`):
    they run again from it, with their caching passes where those released their outputs
    (other outputs stand: recomputed, they would come out the same). Returns the first
    step whose update is not held anywhere: where a process that holds nothing resumes."""
    committed = committed_steps(run)
    restart = committed[-1] + 1 if committed else 0
    # Only the steps the store holds: `steps` may be far beyond them (a run extended to more steps).
    present = sorted(s for s in _step_folders(run) if restart <= s < run.cfg.steps)
    forgotten = [s for s in present if run.done(s, "policy") is not None]
    for step in present:
        run.invalidate(step, "policy")
        if (prefixes := run.done(step, "prefixes")) is not None and prefixes.get("released"):
            run.invalidate(step, "prefixes")
    if forgotten:
        log.warning("policy updates of steps %s were held in memory only; recomputing them from %s", forgotten,
                    f"the checkpoint of step {restart - 1}" if restart else "the base model")
    return restart


def restart_after(run: Run, step: int) -> None:
    """Make the complete policy checkpoint of `step` the run's newest: the policy checkpoints
    and drafters of later steps are deleted, and every stage of a later step is forgotten
    (it runs again), but the held-out evaluation of that checkpoint's policy (step + 1's)."""
    complete = complete_steps(run)
    if step not in complete:
        raise CheckpointError(f"step {step} of the run at {run.store.uri} has no complete policy checkpoint; "
                              f"the complete ones are of steps {complete or 'none'}")
    for kind, folder in (("policy", POLICY), ("drafter", DRAFTER)):
        for later in sorted(s for s in _steps(run, folder) if s > step):
            run.store.delete_prefix(run.checkpoint(kind, later))
    for key in run.store.list():
        parts = key.split("/")
        if len(parts) == 2 and parts[0].startswith("step_") and parts[1].endswith(".done.json"):
            later = int(parts[0].removeprefix("step_"))
            if later > step and not (later == step + 1 and parts[1] == "eval.done.json"):
                run.store.delete(key)
    run.keep_metrics_until(step)
    log.warning("the run continues from the policy checkpoint of step %d; what came after it is forgotten", step)


def export_policy(run: Run, out: str, step: int | None = None, adapters: bool = False) -> tuple[int, dict]:
    """Write the policy of the complete checkpoint of `step` (default: the newest) as an HF
    model folder at the new local path `out` (with model.lora: the adapters merged into the
    base; `adapters`: the PEFT adapter folder instead); returns (step, {file: entry})."""
    if adapters and not run.cfg.model.lora.enabled:
        raise ConfigError("--adapters exports LoRA adapters, and this run trains the full weights "
                          "(model.lora.enabled=false): export without --adapters")
    complete = complete_steps(run)
    step = complete[-1] if step is None and complete else step
    if step not in complete:
        raise CheckpointError(f"the run at {run.store.uri} has no complete policy checkpoint of step {step}; "
                              f"the complete ones are of steps {complete or 'none (the run has not saved one yet)'}")
    target = Path(out).resolve()
    if target.exists():
        raise ConfigError(f"{out} already exists; export into a new folder (nothing is overwritten)")
    found = manifest(run, step)
    weights, _ = split_critic(load_weights(run.store, found["prefix"], found))
    partial = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    store = Store(str(partial.parent))
    try:
        if adapters:
            files = write_adapter_folder(store, partial.name, weights, run.cfg.model)
        else:
            if run.cfg.model.lora.enabled:  # merged in the masters' dtype, written in the compute dtype
                weights = merged_weights(run.cfg.model, weights)
            files = write_hf_folder(store, partial.name, weights, run.cfg.model,
                                    int(run.cfg.checkpoint.hf_shard_gb * 2**30))
        os.replace(partial, target)  # a folder appears complete or not at all
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return step, files
