"""The training flow with pool.task_runner=ray: each pool device's stages run on a
long-lived Ray actor of its own (lsreplay.distributed.hosts), which keeps the policy between stages
and steps; a host that lacks the policy takes it from the one that holds it."""

from __future__ import annotations

import json

import pytest

from tests.flowrun import tiny

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]' (the `ray` extra)")


@pytest.fixture
def local_ray(monkeypatch):
    # Ray's workers take the environment Ray started with: step 1's two rollout shards each
    # hold their device for a while, so that they run side by side on the two hosts; the
    # last checkpoint's write (in the background, on the update's host) takes a while too, so
    # that it is still going when the flow checks for it (which waits for the hosts' writers).
    monkeypatch.setenv("LSREPLAY_FAULTS", "trees@1:stall,checkpoint@1:stall")
    monkeypatch.setenv("LSREPLAY_STALL_SECONDS", "3")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_flow_on_ray_hosts(prefect_server, local_ray, tiny_model_dir, tmp_path):
    import os

    from flows.train import train
    from lsreplay.core.config import load_config
    from lsreplay.core.run import Run

    run_dir = tmp_path / "run"
    # Two devices, and step 1's two rollout shards side by side on them; the update of step 0
    # is not checkpointed (every=2): the shard on the other host than the update's must take
    # the policy from that host, or the run would rewind and recompute.
    train(overrides=[*tiny(run_dir, tiny_model_dir, steps=2), "pool.task_runner=ray", "pool.slots=2",
                     "data.prompts_per_step=2", "rollout.shards=2", "checkpoint.every=2"])
    assert (run_dir / "checkpoints/policy/step_0001/model.safetensors").is_file()
    run = Run(load_config(None, [f"run_dir={run_dir}"]))
    runs = run.executions()
    assert runs == {(step, stage): 2 if stage == "trees" else 1 for step, stage in runs}, runs  # nothing recomputed
    records = [json.loads(p.read_text()) for p in (run_dir / "executions").rglob("*.json")]
    hosts = {r["pid"] for r in records if r["stage"] != "prompts"}  # the pool's stages
    assert os.getpid() not in hosts and len(hosts) == 2  # two actors, not this process
    started = {(r["step"], r["stage"]): r["pid"] for r in records if r["stage"] in ("prefixes", "policy")}
    # One long-lived host ran both updates (and held the policy between them).
    assert started[0, "policy"] == started[1, "policy"] == started[0, "prefixes"] == started[1, "prefixes"]
    assert run.done(1, "policy")["devices"] == run.done(0, "policy")["devices"]
