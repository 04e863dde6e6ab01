"""Checkpoints on a schedule, written in the background, the last few kept; each step's
prefix K/V and hidden states deleted once read; a run killed with updates held in memory
only, or in the middle of a checkpoint's write, resumes from the newest complete
checkpoint and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json

from flowrun import digests, lsreplay_chain, reference_run, step0_copy, tiny, unique_pool

from lsreplay.core.config import load_config
from lsreplay.core.run import Run

# Checkpoints after steps 1 and 3 (the last); only the newest complete one kept. Computed
# with one thread here and in every process of the chains, so all runs compare bit for bit.
SCHEDULE = ["checkpoint.every=2", "checkpoint.keep_last=1", "threads=1"]


def checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints/policy").iterdir())


def ran(run_dir) -> dict:
    return Run(load_config(None, [f"run_dir={run_dir}"])).executions()


def test_schedule_bounded_storage_and_resume_from_the_newest_checkpoint(prefect_server, tiny_model_dir, tmp_path):
    from flows.train import train

    ref = tmp_path / "ref"
    metrics = train(overrides=[*tiny(ref, tiny_model_dir, steps=4), *SCHEDULE])
    assert checkpoints(ref) == ["step_0003"]
    assert (ref / "checkpoints/policy/step_0003/checkpoint.json").is_file()
    assert not list(ref.glob("step_*/prefix_kv")) and not list(ref.glob("step_*/activations"))
    assert [m["policy_state_seconds"] >= 0 for m in metrics] == [True] * 4
    policy = [json.loads((ref / f"step_{s:04d}/policy.done.json").read_text())["checkpoint"] for s in range(4)]
    assert policy == [None, "checkpoints/policy/step_0001", None, "checkpoints/policy/step_0003"]

    # Killed in step 3's rollouts: step 2's update was held in memory only. The resume
    # restarts from step 1's checkpoint: step 2's caching pass and update run again. That
    # resume is killed in the middle of the last checkpoint's background write: it is
    # incomplete, the one before it is kept, and the next resume recomputes the last update.
    # (One run killed twice: a run of its own for each kill cost a minute more.)
    killed = tmp_path / "killed"
    first, cut = lsreplay_chain([(["train", *tiny(killed, tiny_model_dir, steps=4), *SCHEDULE], "trees@3:kill"),
                                 (["resume", str(killed), unique_pool()], "checkpoint@3:kill")], tmp_path)
    assert first["returncode"] == -9 and cut["returncode"] == -9, cut["log"][-3000:]
    assert "recomputing them from the checkpoint of step 1" in cut["log"]
    runs = ran(killed)
    assert (runs[2, "prefixes"], runs[2, "policy"], runs[3, "trees"]) == (2, 2, 2) and runs[1, "policy"] == 1
    assert runs[3, "policy"] == 1
    assert checkpoints(killed) == ["step_0001", "step_0003"]
    assert not (killed / "checkpoints/policy/step_0003/checkpoint.json").exists()
    resumed, = lsreplay_chain([(["resume", str(killed), unique_pool()], "")], tmp_path)
    assert resumed["returncode"] == 0, resumed["log"][-3000:]
    assert ran(killed)[3, "policy"] == 2
    assert checkpoints(killed) == ["step_0003"]
    assert digests(killed, "checkpoints") == digests(ref, "checkpoints")


def test_killed_between_a_checkpoint_and_its_done_marker_resumes_from_the_one_before(
        prefect_server, tiny_model_dir, tmp_path_factory, tmp_path):
    """checkpoint.keep_last=1, the checkpoint written in the stage (not in the background),
    and the process killed right after it: step 1's checkpoint is complete, its update's done
    marker is not there. Prune keeps step 0's checkpoint, the newest committed one, and rewind
    resumes from it: only step 1's update runs again. (Before, prune counted step 1's as the
    one to keep and deleted step 0's; rewind, which counts only committed ones, then found
    none and restarted from the base model.)"""
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    run_dir = step0_copy(ref, tmp_path / "run")  # computed with one thread, recorded; resumes use it
    window = ["checkpoint.keep_last=1", "checkpoint.background=false"]
    killed, = lsreplay_chain([(["resume", str(run_dir), "--steps", "2", *window, unique_pool()], "policy@1:kill")],
                             tmp_path)
    assert killed["returncode"] == -9, killed["log"][-3000:]
    assert checkpoints(run_dir) == ["step_0000", "step_0001"]
    assert (run_dir / "checkpoints/policy/step_0001/checkpoint.json").is_file()
    assert not (run_dir / "step_0001/policy.done.json").exists()
    resumed, = lsreplay_chain([(["resume", str(run_dir), unique_pool()], "")], tmp_path)
    assert resumed["returncode"] == 0, resumed["log"][-3000:]
    runs = ran(run_dir)
    assert runs[1, "policy"] == 2 and (0, "policy") not in runs, runs
    assert checkpoints(run_dir) == ["step_0001"]
    step1 = ["checkpoints/policy/step_0001", "checkpoints/drafter/step_0001"]
    assert digests(run_dir, *step1) == digests(ref.run_dir, *step1)


def test_a_failed_background_checkpoint_stops_the_run_at_the_next_save(prefect_server, tiny_model_dir,
                                                                       tmp_path_factory, tmp_path):
    """Every write of step 0's checkpoint fails as on a full disk (checkpoint@0:full). The
    write runs in the background while step 1 runs; step 1's save waits for it, finds it
    failed and stops the run (exit 1) naming the step and the cause, before step 1 is
    committed: no update goes on without durable state. Resumed with room on the disk, the
    run recomputes from the base model and ends as the reference did, bit for bit."""
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    run_dir = tmp_path / "run"
    full, = lsreplay_chain([(["train", *tiny(run_dir, tiny_model_dir), "threads=1"], "checkpoint@0:full")], tmp_path)
    assert full["returncode"] == 1, full["log"][-3000:]
    assert "stage policy of step 1 failed: CheckpointWriteFailed: the background write of the policy checkpoint " \
           "of step 0: StorageError" in full["log"] and "No space left on device" in full["log"], full["log"][-3000:]
    assert "Free space in the store" in full["log"] and full["log"].count("retrying in") == 0  # a full disk: no retries
    assert not (run_dir / "checkpoints/policy/step_0000/checkpoint.json").exists()
    assert (run_dir / "step_0001/prefixes.done.json").is_file() and not (run_dir / "step_0001/policy.done.json").exists()
    resumed, = lsreplay_chain([(["resume", str(run_dir), unique_pool()], "")], tmp_path)
    assert resumed["returncode"] == 0, resumed["log"][-3000:]
    assert ran(run_dir)[0, "policy"] == 2
    assert digests(run_dir, "checkpoints") == digests(ref.run_dir, "checkpoints")


def test_pruning_keeps_the_drafters_a_resume_can_load(tmp_path):
    """Drafters trained at steps 0, 2 and 4 (none at 1 and 3), policy checkpoints after
    steps 2, 3 and 4, keep_last=2: the oldest kept is step 3's, and a resume from it loads
    drafter 2 at the oldest (the newest trained before it), so only drafter 0 is deleted.
    Its stage stays finished, naming the checkpoint released."""
    import torch
    from conftest import tiny_model

    from lsreplay.models.train_state import TrainState
    from lsreplay.state import checkpointing

    run = Run(load_config(None, [f"run_dir={tmp_path}", "checkpoint.keep_last=2"]))
    train = TrainState(tiny_model(dtype=torch.float32), run.cfg.optim)
    for step in range(5):
        prefix = run.checkpoint("drafter", step) if step % 2 == 0 else None
        files = [run.store.write_tensors(f"{prefix}/model.safetensors", {"w": torch.zeros(2)})] if prefix else []
        run.finish(step, "drafter", {"files": files, "checkpoint": prefix})
        if step >= 2:
            checkpointing.write(run, checkpointing.snapshot(run, step, train))
            run.finish(step, "policy", {"checkpoint": run.checkpoint("policy", step)})  # committed
            checkpointing.prune(run)
    assert checkpoints(tmp_path) == ["step_0003", "step_0004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints/drafter").iterdir()) == ["step_0002", "step_0004"]
    assert run.done(0, "drafter")["released"] == ["checkpoint"] and run.done(2, "drafter")["files"]


def test_checkpoints_are_written_where_the_kernel_refuses_idle_priority(tmp_path, monkeypatch, caplog):
    """Some sandboxes (gVisor) answer sched_setscheduler(SCHED_IDLE) with EINVAL. The writer
    runs at normal priority (under SCHED_IDLE a write fell a step behind on a busy CPU), so
    the refusal cannot stop it and `submit` never blocks: before, its thread died with a
    snapshot queued and the next step's submit waited forever. The CPU drafter's idle thread
    goes on at normal priority too, and says so once."""
    import errno
    import os
    import threading

    import torch
    from conftest import tiny_model

    from lsreplay.state import checkpointing

    from lsreplay.core import devices
    from lsreplay.models.train_state import TrainState

    def refuse(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    monkeypatch.setattr(devices, "_IDLE_REFUSED", set())
    run = Run(load_config(None, [f"run_dir={tmp_path}", "checkpoint.keep_last=0"]))
    train = TrainState(tiny_model(dtype=torch.float32), run.cfg.optim)
    writer = checkpointing.Writer()
    caplog.set_level("WARNING", logger="lsreplay.core.devices")

    def submit_three() -> None:
        for step in range(3):
            writer.submit(run, checkpointing.snapshot(run, step, train))
        writer.wait()

    submitter = threading.Thread(target=submit_three, daemon=True)
    submitter.start()
    submitter.join(timeout=30)
    assert not submitter.is_alive(), "submit or wait blocked: the writer thread died"
    assert not writer.failed(run) and checkpointing.complete_steps(run) == [0, 1, 2]
    assert devices.on_idle_cpu(lambda: "ran") == "ran" and devices.on_idle_cpu(lambda: "again") == "again"
    refusals = [r for r in caplog.records if "refuses the idle scheduling policy" in r.getMessage()]
    assert len(refusals) == 1 and "normal priority" in refusals[0].getMessage()
