"""Checkpoints on a schedule, written in the background, the last few kept; each step's
prefix K/V and hidden states deleted once read; a run killed with updates held in memory
only, or in the middle of a checkpoint's write, resumes from the newest complete
checkpoint and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json

from flowrun import digests, lsreplay_chain, tiny, unique_pool

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
    # restarts from step 1's checkpoint: step 2's caching pass and update run again.
    killed = tmp_path / "killed"
    first, resumed = lsreplay_chain([(["train", *tiny(killed, tiny_model_dir, steps=4), *SCHEDULE], "trees@3:kill"),
                                     (["resume", str(killed), unique_pool()], "")], tmp_path)
    assert first["returncode"] == -9 and resumed["returncode"] == 0, resumed["log"][-3000:]
    assert "recomputing them from the checkpoint of step 1" in resumed["log"]
    runs = ran(killed)
    assert (runs[2, "prefixes"], runs[2, "policy"], runs[3, "trees"]) == (2, 2, 2) and runs[1, "policy"] == 1
    assert digests(killed, "checkpoints") == digests(ref, "checkpoints")

    # Killed in the middle of the last checkpoint's background write: it is incomplete, the
    # one before it is kept, and the resume recomputes the last update.
    cut = tmp_path / "cut"
    first, = lsreplay_chain([(["train", *tiny(cut, tiny_model_dir, steps=4), *SCHEDULE], "checkpoint@3:kill")],
                            tmp_path)
    assert first["returncode"] == -9
    assert checkpoints(cut) == ["step_0001", "step_0003"]
    assert not (cut / "checkpoints/policy/step_0003/checkpoint.json").exists()
    resumed, = lsreplay_chain([(["resume", str(cut), unique_pool()], "")], tmp_path)
    assert resumed["returncode"] == 0, resumed["log"][-3000:]
    assert ran(cut)[3, "policy"] == 2
    assert checkpoints(cut) == ["step_0003"]
    assert digests(cut, "checkpoints") == digests(ref, "checkpoints")


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
    assert not writer.failures and checkpointing.complete_steps(run) == [0, 1, 2]
    assert devices.on_idle_cpu(lambda: "ran") == "ran" and devices.on_idle_cpu(lambda: "again") == "again"
    refusals = [r for r in caplog.records if "refuses the idle scheduling policy" in r.getMessage()]
    assert len(refusals) == 1 and "normal priority" in refusals[0].getMessage()
