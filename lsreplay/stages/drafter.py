"""Stage 5: distil the EAGLE-style drafter on the hidden states the caching pass stored
(no extra target forward), starting from the previous step's drafter.

Spot training. The drafter of step t is scheduled while step t+1's rollouts run, on pool
slots their finished shards free (flows/train.py), and trains until those rollouts end:
after every `drafter.checkpoint_every` steps it checkpoints (its float32 master weights,
optimizer, sampler state) and looks whether step t+1's trees are finished. A preempted or killed trainer
resumes from its last checkpoint. The last step's drafter, with no rollouts after it,
trains all `drafter.steps`. Rollouts of step t+2 are the first to use it (with
asynchronous rollouts, the first sampled by policy version t+2: the drafter follows the
version it shares its embedding and head with, lsreplay.stages.versions). Without an
accelerator the freed slot is CPU time the rollouts share, so the trainer runs at idle
priority (devices.on_idle_cpu) and never slows them; unless the rollouts have devices of
their own (pool.rollout_devices), when its slot is the update's, idle until the rollouts
it overlaps end, and no rollout's: there it runs at normal priority, as the update would;
so does the last step's, which overlaps no rollouts.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from tqdm.auto import tqdm

from lsreplay.core import faults
from lsreplay.core.devices import on_idle_cpu
from lsreplay.core.layout import CheckpointError
from lsreplay.core.run import Run
from lsreplay.core.storage import CorruptEntry, MissingEntry, Store
from lsreplay.drafter.distill import distill, drafter_train_state, evaluate
from lsreplay.drafter.export import save_hf
from lsreplay.drafter.model import Drafter
from lsreplay.models.loading import seeded
from lsreplay.models.train_state import TrainState
from lsreplay.stages.common import StateClock, load_trees, policy_before
from lsreplay.stages.prefixes import load_activations
from lsreplay.state.checkpoint import (check_fits, load_module, load_optimizer, load_rng, load_weights,
                                 save_optimizer, save_rng, save_weights)

log = logging.getLogger(__name__)

SPOT_STATE = "spot.json"  # written after each spot checkpoint: steps done + the files' manifests


@dataclasses.dataclass
class _Trainer:
    drafter: Drafter
    train: TrainState  # AdamW over float32 masters of a bf16 drafter (the drafter itself in float32)
    batches: torch.Generator  # draws the training batches
    steps_done: int = 0


def distill_drafter(run: Run, step: int, devices: list[int] | None = None) -> dict:
    """`devices`: the pool slot held (at idle priority where it shares a CPU with rollouts).

    The drafter drafts for, and shares the embedding and LM head of, the policy after
    `step`: the one the rollouts it overlaps (step + 1's) use, held by this process."""
    if done := run.done(step, "drafter"):
        return done
    device = run.device(devices)
    if not at_idle_priority(run, step, device):
        return _distill_drafter(run, step, devices, device)
    return on_idle_cpu(lambda: _distill_drafter(run, step, devices, device))


def at_idle_priority(run: Run, step: int, device: torch.device) -> bool:
    """Whether the drafter of `step` trains at idle priority: on a CPU slot the time is shared
    with the rollouts it overlaps. Not on the update's slot (pool.rollout_devices), and not
    at the last step, which overlaps no rollouts and which the run waits for: under
    SCHED_IDLE any other busy process on the machine held the run's end back (2 drafter
    steps took 9.7 s instead of 0.9 s on a loaded 2-core machine)."""
    return device.type == "cpu" and not run.cfg.pool.rollout_devices and step + 1 < run.cfg.steps


def _distill_drafter(run: Run, step: int, devices: list[int] | None, device: torch.device) -> dict:
    run.begin(step, "drafter")
    rollouts_ended = _rollouts_ended(run, step)
    if rollouts_ended() and not run.store.exists(f"{run.checkpoint('drafter', step)}/{SPOT_STATE}"):
        return _untrained(run, step, devices, "rollouts ended before it started", 0.0)
    start, clock = time.perf_counter(), StateClock()
    prefixes = run.manifest(step, "prefixes")
    _, trees = load_trees(run, step)
    sequences = [seq for i, tree in enumerate(trees)
                 for seq in load_activations(run, step, i, prefixes).path_sequences(tree)]
    trainer = _start_or_resume(run, step, clock(policy_before, run, step + 1, device))
    resumed_at = trainer.steps_done
    stats, files, stopped_by = _train(run, step, trainer, sequences, rollouts_ended)
    if trainer.steps_done == 0:
        return _untrained(run, step, devices, stopped_by, time.perf_counter() - start)
    if stats is None:  # resumed from a checkpoint, and no step ran since
        stats = evaluate(trainer.drafter, sequences, max_len=run.cfg.drafter.max_len,
                         temperature=run.cfg.rollout.temperature)
        files = _save(run, step, trainer)
    exported = save_hf(run.store, f"{run.checkpoint('drafter', step)}/hf", trainer.drafter)
    log.info("drafter of step %d: %d steps (resumed at %d), stopped by %s", step, trainer.steps_done, resumed_at,
             stopped_by)
    return run.finish(step, "drafter", {
        "files": [*files, *exported.values()], "checkpoint": run.checkpoint("drafter", step),
        "sequences": len(sequences), "steps_done": trainer.steps_done, "resumed_at": resumed_at,
        "stopped_by": stopped_by, "devices": devices, "device": str(device),
        **{f"drafter_{k}": v for k, v in dataclasses.asdict(stats).items() if k != "steps"},
        "seconds": time.perf_counter() - start, "state_seconds": clock.seconds})


def _train(run: Run, step: int, trainer: _Trainer, sequences, rollouts_ended) -> tuple:
    """Distil in chunks of drafter.checkpoint_every steps, checkpointing after each, until
    drafter.steps or the end of the rollouts (asked before every step: one step on long
    sequences can take a while on a CPU). Returns (stats of the last chunk that ran, its
    checkpoint files, why it stopped)."""
    d = run.cfg.drafter
    stats, files = None, []
    with tqdm(total=d.steps, initial=trainer.steps_done, desc=f"step {step} drafter", unit="step",
              leave=False) as bar:
        while trainer.steps_done < d.steps:
            chunk = min(d.checkpoint_every, d.steps - trainer.steps_done)
            ran = distill(trainer.drafter, sequences, steps=chunk, lr=d.lr, batch_size=d.batch_size,
                          max_len=d.max_len, generator=trainer.batches, train=trainer.train, progress=False,
                          stop=rollouts_ended, temperature=run.cfg.rollout.temperature)
            if ran.steps:
                stats = ran
                trainer.steps_done += ran.steps
                bar.set_postfix(loss=f"{ran.loss:.4f}", top1=f"{ran.top1_accept:.3f}", refresh=False)
                bar.update(ran.steps)
                files = _save(run, step, trainer)
                faults.hook("drafter", step, "mid")  # a kill here leaves a checkpoint to resume from
            if ran.steps < chunk or rollouts_ended():
                return stats, files, "rollouts ended"
    return stats, files, "steps"


def _untrained(run: Run, step: int, devices, stopped_by: str, seconds: float) -> dict:
    """A session that trained no step: the step's drafter is the previous one (newest_drafter)."""
    log.info("drafter of step %d: no step trained (%s); the previous drafter stands", step, stopped_by)
    return run.finish(step, "drafter", {"files": [], "checkpoint": None, "steps_done": 0, "resumed_at": 0,
                                        "stopped_by": stopped_by, "devices": devices, "seconds": seconds})


def _rollouts_ended(run: Run, step: int):
    """Whether the rollouts this drafter overlaps (step + 1's) are finished; never, for the last step."""
    if step + 1 >= run.cfg.steps:
        return lambda: False
    return lambda: run.done(step + 1, "trees") is not None


def _start_or_resume(run: Run, step: int, target) -> _Trainer:
    """The trainer as this step's last spot checkpoint left it, else a fresh one."""
    trainer = _fresh(run, step, target)
    prefix = run.checkpoint("drafter", step)
    try:
        state = run.store.read_json(f"{prefix}/{SPOT_STATE}")
        _load_masters(run.store, prefix, trainer.train, state["manifest"])
        load_optimizer(run.store, prefix, trainer.train.optimizer, state["manifest"])
        trainer.batches.set_state(load_rng(run.store, prefix, state["manifest"])["batches"])
    except MissingEntry:
        return trainer
    except (CorruptEntry, CheckpointError, KeyError) as e:
        log.warning("drafter of step %d: its spot checkpoint is unusable (%s); starting the step over", step, e)
        return _fresh(run, step, target)
    trainer.steps_done = state["steps_done"]
    log.info("drafter of step %d resumes from its checkpoint after %d steps", step, trainer.steps_done)
    return trainer


def _fresh(run: Run, step: int, target) -> _Trainer:
    """The newest trained drafter's masters (none yet: a new drafter, seeded per step so that
    a resumed process starts from the same weights), a new optimizer, a seeded batch sampler."""
    with seeded(run.seed(step, "drafter-init")):
        drafter = Drafter.from_target(target)
    train = drafter_train_state(drafter, run.cfg.drafter.lr)
    if (previous := newest_drafter(run, step - 1)) is not None:
        with run.reading(previous, "drafter"):
            _load_masters(run.store, run.checkpoint("drafter", previous), train,
                          run.checkpoint_manifest("drafter", previous))
    return _Trainer(drafter, train, run.generator(step, "drafter"))


def _load_masters(store: Store, prefix: str, train: TrainState, manifest: dict) -> None:
    """A drafter checkpoint's weights (float32 masters) into `train`; the compute weights follow."""
    tensors = load_weights(store, prefix, manifest)
    check_fits(store, prefix, train.model, tensors)
    train.load_masters(tensors)


def newest_drafter(run: Run, step: int) -> int | None:
    """The newest step <= `step` whose drafter session trained (and so saved) weights; None
    if none did yet. A session that trained no step leaves the previous drafter standing."""
    for earlier in range(step, -1, -1):
        if run.manifest(earlier, "drafter")["checkpoint"]:
            return earlier
    return None


def load_drafter(run: Run, step: int, drafter: Drafter) -> Drafter:
    """Load the finished drafter of `step` into `drafter` (its masters, rounded to its dtype),
    verified against its manifest."""
    with run.reading(step, "drafter"):
        load_module(run.store, run.checkpoint("drafter", step), drafter, run.checkpoint_manifest("drafter", step))
    return drafter


def _save(run: Run, step: int, trainer: _Trainer) -> list[dict]:
    """Checkpoint the trainer; its state file, written last, makes the checkpoint resumable."""
    prefix = run.checkpoint("drafter", step)
    meta = {"step": step, "drafter": trainer.drafter.config_dict(), "steps_done": trainer.steps_done}
    parts = [save_weights(run.store, prefix, trainer.train.master_tensors(), meta),
             save_optimizer(run.store, prefix, trainer.train.optimizer),
             save_rng(run.store, prefix, {"batches": trainer.batches})]
    entries = {name: e for p in parts for name, e in p["files"].items()}
    # Keys and digests only (no absolute URIs): a copied or moved run still resumes.
    manifest = {"prefix": prefix, "files": {name: {k: e[k] for k in ("key", "bytes", "sha256")}
                                            for name, e in entries.items()}}
    state = run.store.write_json(f"{prefix}/{SPOT_STATE}", {"steps_done": trainer.steps_done, "manifest": manifest})
    return [*entries.values(), state]
