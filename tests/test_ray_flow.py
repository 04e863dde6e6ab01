"""The training flow with pool.task_runner=ray: each pool device's stages run on a
long-lived Ray actor of its own (lsreplay.hosts), which keeps the policy between stages
and steps; a host that lacks the policy takes it from the one that holds it."""

from __future__ import annotations

import json

import pytest

from tests.flowrun import tiny

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]' (the `ray` extra)")


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_flow_on_ray_hosts(prefect_server, local_ray, tiny_model_dir, tmp_path):
    import os

    from flows.train import train
    from lsreplay.config import load_config
    from lsreplay.run import Run

    run_dir = tmp_path / "run"
    # Two devices, so that step 1's rollouts and step 0's spot drafter run on two hosts; the
    # update of step 0 is not checkpointed (every=2): whichever of them runs on the other
    # host than the update's must take the policy from that host, or the run would rewind.
    train(overrides=[*tiny(run_dir, tiny_model_dir, steps=2), "pool.task_runner=ray", "pool.slots=2",
                     "checkpoint.every=2"])
    assert (run_dir / "checkpoints/policy/step_0001/model.safetensors").is_file()
    runs = Run(load_config(None, [f"run_dir={run_dir}"])).executions()
    assert set(runs.values()) == {1}, runs  # nothing recomputed
    started = {(json.loads(p.read_text())["step"], json.loads(p.read_text())["stage"]): json.loads(p.read_text())["pid"]
               for p in (run_dir / "executions").rglob("*.json")}
    hosts = {pid for (_, stage), pid in started.items() if stage != "prompts"}  # the pool's stages
    assert os.getpid() not in hosts and len(hosts) == 2  # two actors, not this process
    # One long-lived host ran both updates (and held the policy between them).
    assert started[0, "policy"] == started[1, "policy"] == started[0, "prefixes"] == started[1, "prefixes"]
