"""The training flow with pool.task_runner=ray: every stage runs as a Ray task (prefect-ray's
RayTaskRunner) on a local Ray instance, and the run ends as the in-process one does."""

from __future__ import annotations

import json
import os

import pytest

from tests.flowrun import tiny

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]' (the `ray` extra)")
pytest.importorskip("prefect_ray", reason="prefect-ray is not installed: pip install -e '.[ray]' (the `ray` extra)")


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, namespace="prefect", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_flow_on_ray(prefect_server, local_ray, tiny_model_dir, tmp_path):
    from flows.train import train

    run_dir = tmp_path / "run"
    metrics = train(overrides=[*tiny(run_dir, tiny_model_dir, steps=1), "pool.task_runner=ray"])
    assert [m["step"] for m in metrics] == [0]
    for stage in ("prompts", "trees", "prefixes", "policy", "drafter"):
        assert (run_dir / "step_0000" / f"{stage}.done.json").is_file()
    assert (run_dir / "checkpoints/policy/step_0000/model.safetensors").is_file()
    # Each stage ran in a Ray worker, not in this process.
    pids = {json.loads(p.read_text())["pid"] for p in (run_dir / "executions/step_0000").rglob("*.json")}
    assert pids and os.getpid() not in pids
