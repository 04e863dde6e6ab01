"""Spot training of the drafter: it takes the pool slot a finished rollout shard frees while
another shard still runs, trains until the rollout stage ends, then checkpoints and lets
go; a trainer killed in the middle resumes from its last checkpoint."""

from __future__ import annotations

import json

from flowrun import lsreplay_chain, stall_until_drafter_checkpointed, tiny, unique_pool

from lsreplay.core.config import load_config
from lsreplay.core.run import Run, open_run_config

SPOT = ["rollout.shards=2", "pool.slots=2", "data.prompts_per_step=2", "drafter.steps=20",
        "drafter.checkpoint_every=2"]


def straggle(monkeypatch, run_dir) -> None:
    """A shard of step 1 that holds its slot until step 0's drafter has checkpointed beside it."""
    monkeypatch.setenv("LSREPLAY_FAULTS", "trees@1:stall")
    stall_until_drafter_checkpointed(monkeypatch, run_dir)


def manifest(run_dir, step: int, stage: str) -> dict:
    return json.loads((run_dir / f"step_{step:04d}" / f"{stage}.done.json").read_text())


def test_drafter_trains_on_freed_slots_until_the_rollouts_end(prefect_server, tiny_model_dir, tmp_path,
                                                              monkeypatch):
    from flows.train import train

    run_dir = tmp_path / "run"
    straggle(monkeypatch, run_dir)  # the other shard frees its slot long before the stage ends
    train(overrides=[*tiny(run_dir, tiny_model_dir), *SPOT, "steps=2"])

    shards = manifest(run_dir, 1, "trees")["shards"]
    first, last = sorted(shards, key=lambda s: s["ended"])
    spot = manifest(run_dir, 0, "drafter")
    # It started on the slot the first shard freed, while the other shard was still running...
    assert first["ended"] <= spot["started"] < last["ended"]
    assert spot["devices"] == first["devices"] != last["devices"]
    # ... and stopped, checkpointed, once the rollouts ended (long before its step budget).
    assert spot["stopped_by"] == "rollouts ended"
    assert 2 <= spot["steps_done"] < 20 and spot["ended"] >= last["ended"]
    state = json.loads((run_dir / "checkpoints/drafter/step_0000/spot.json").read_text())
    assert state["steps_done"] == spot["steps_done"]
    # The last step's drafter has no rollouts after it: it trains its whole budget.
    assert manifest(run_dir, 1, "drafter")["steps_done"] == 20
    # Step 0's metrics line was completed with its drafter's figures.
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1] and all("drafter_loss" in m for m in metrics)


def test_killed_drafter_resumes_from_its_checkpoint(prefect_server, tiny_model_dir, tmp_path):
    """Killed after its first checkpoint (2 of 6 steps), the last step's drafter resumes
    there and ends with the weights of an uninterrupted trainer."""
    overrides = ["drafter.steps=6", "drafter.checkpoint_every=2", "steps=1"]
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    jobs = [(["train", *tiny(killed, tiny_model_dir, steps=1), *overrides], "drafter@0:kill"),
            (["resume", str(killed), unique_pool()], ""),
            (["train", *tiny(clean, tiny_model_dir, steps=1), *overrides], "")]
    results = lsreplay_chain(jobs, tmp_path)
    assert results[0]["returncode"] == -9 and all(r["returncode"] == 0 for r in results[1:]), results[1]["log"][-3000:]
    resumed = manifest(killed, 0, "drafter")
    assert (resumed["resumed_at"], resumed["steps_done"]) == (2, 6)
    weights = "checkpoints/drafter/step_0000/model.safetensors"
    assert (killed / weights).read_bytes() == (clean / weights).read_bytes()
    run = Run(load_config(None, [f"run_dir={killed}"]))
    assert run.executions()[0, "drafter"] == 2


def test_rollouts_decode_the_tail_with_the_newest_finished_drafter(prefect_server, tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    """Step t's rollouts use step t-2's drafter (t-1's trains alongside them); every decode
    step's decision is stored, and the speculative rounds show in the metrics. A drafter
    session that finds its rollouts already over trains nothing, and no drafter is used."""
    import shutil

    from flows.train import train
    from lsreplay import stages
    from lsreplay.stages.common import policy_before
    from lsreplay.stages.drafter import newest_drafter
    from lsreplay.stages.trees import adaptive_engine

    run_dir = tmp_path / "run"
    # Step 1's rollouts straggle, so step 0's drafter (at idle priority) gets CPU time to train.
    straggle(monkeypatch, run_dir)
    train(overrides=[*tiny(run_dir, tiny_model_dir, steps=3), "rollout.spec_threshold=4",
                     "rollout.max_new_tokens=12", "pool.slots=2"])
    # At idle priority it trains only while the machine has a free core; the stall waits for its checkpoint.
    assert manifest(run_dir, 0, "drafter")["steps_done"] == 2
    used = [manifest(run_dir, step, "trees-shard0")["drafter_step"] for step in range(3)]
    assert used == [None, None, 0]
    decisions = json.loads((run_dir / "step_0002/trees/decisions_00.json").read_text())["decisions"]
    modes = [d["mode"] for d in decisions]
    assert "spec" in modes and modes == sorted(modes, key=lambda m: m == "spec")  # plain, then speculative
    assert all(d["draft_len"] <= 4 and d["live"] <= 4 for d in decisions if d["mode"] == "spec")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["spec_rounds"] > 0 for m in metrics] == [False, False, True]
    assert metrics[2]["rollout_accept_len"] >= 1

    # Step 0's drafter again, now that step 1's rollouts are long over: it trains no step.
    run = Run(open_run_config(str(run_dir), []))
    run.invalidate(0, "drafter")
    shutil.rmtree(run_dir / "checkpoints/drafter/step_0000")
    untrained = stages.distill_drafter(run, 0)
    assert (untrained["steps_done"], untrained["checkpoint"]) == (0, None)
    assert untrained["stopped_by"] == "rollouts ended before it started"
    assert newest_drafter(run, 0) is None and adaptive_engine(run, 2, 0, policy_before(run, 2)) == (None, None)
