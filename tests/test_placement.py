"""Placement: each stage computes on the device its pool slot names; a GPU pool without a
GPU is an error before any work; device locks are machine-wide."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import torch

from lsreplay.core import devices
from lsreplay.core.config import ConfigError, PoolConfig, load_config


def test_slots_name_devices():
    cpu, gpu = PoolConfig(accelerator="cpu", slots=4), PoolConfig(accelerator="cuda", slots=4)
    assert devices.torch_device(cpu, 3) == torch.device("cpu")
    assert devices.torch_device(gpu, 3) == torch.device("cuda", 3)
    assert devices.torch_device(gpu, None) == torch.device("cpu")  # a stage that holds no slot
    devices.pin([7], [torch.device("cuda", 0)])  # a Ray host sees its one GPU as cuda:0
    try:
        assert devices.torch_device(gpu, 7) == torch.device("cuda", 0)
    finally:
        devices._PINNED.clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_gpu_pool_without_a_gpu_is_an_error_before_any_work(tmp_path, capsys):
    from lsreplay import cli

    with pytest.raises(ConfigError, match="pool.accelerator=cuda, but this process sees no CUDA device"):
        devices.check_accelerator(PoolConfig(accelerator="cuda"))
    run_dir = tmp_path / "run"
    assert cli.main(["train", f"run_dir={run_dir}", "pool.accelerator=cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    assert not run_dir.exists()  # nothing was started


def test_device_locks_are_machine_wide(tmp_path):
    """A process started in another folder sees the devices this one holds."""
    pool = PoolConfig(name=f"test-{uuid.uuid4().hex[:8]}", slots=2)
    probe = ("import sys; from lsreplay.core.config import PoolConfig; from lsreplay.core.devices import any_held; "
             f"sys.exit(0 if any_held(PoolConfig(name={pool.name!r}, slots=2), 2) else 3)")
    with devices.hold_devices(pool, 1) as held:
        assert held == [0]
        assert subprocess.run([sys.executable, "-c", probe], cwd=tmp_path).returncode == 0
    assert subprocess.run([sys.executable, "-c", probe], cwd=tmp_path).returncode == 3


def test_stages_compute_on_the_held_device(tiny_model_dir, tmp_path):
    from lsreplay import stages
    from lsreplay.core.run import Run
    from lsreplay.state import checkpointing
    from lsreplay.state.resident import RESIDENT

    run = Run(load_config(None, [f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "steps=1", "data.size=8",
                                 "data.prompts_per_step=1", "rollout.branching=[2,2]", "rollout.segment_tokens=[3]",
                                 "rollout.max_new_tokens=6", "drafter.enabled=false", "pool.slots=2"]))
    run.save_or_check_config()
    stages.sample_prompts(run, 0)
    manifests = [stages.generate_tree_shard(run, 0, 0, devices=[1]), stages.collect_trees(run, 0),
                 stages.cache_prefixes(run, 0, devices=[1]), stages.train_policy(run, 0, devices=[1])]
    checkpointing.WRITER.wait()
    assert [m.get("device") for m in manifests] == ["cpu", None, "cpu", "cpu"]
    assert RESIDENT.held(run) == {"cpu": 1}  # one copy, updated in place, acting in step 1
    assert run.generator(0, "trees", device=run.device([1])).device == torch.device("cpu")
    RESIDENT.release(run)
    with pytest.raises(ConfigError, match="pool.accelerator"):
        load_config(None, ["pool.accelerator=tpu"])
