"""The policy update on data-parallel ranks (pool.devices_per_step > 1) equals the
single-process one: same checkpoint after a step, plain DP and FSDP."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from lsreplay import stages

from lsreplay.core.config import load_config
from lsreplay.core.run import Run
from lsreplay.state import checkpointing


def config(run_dir, model_dir, *more):
    return load_config(None, [f"run_dir={run_dir}", f"model.path={model_dir}", "model.dtype=float64", "steps=1",
                              "data.size=8", "data.prompts_per_step=3", "rollout.branching=[2,2]",
                              "rollout.segment_tokens=[3]", "rollout.max_new_tokens=6", "optim.lr=1e-3",
                              "drafter.enabled=false", *more])


@pytest.fixture(scope="module")
def step0_inputs(tiny_model_dir, tmp_path_factory):
    """A run with step 0's prompts, trees and prefix cache done (no policy yet)."""
    run_dir = tmp_path_factory.mktemp("dp") / "inputs"
    run = Run(config(run_dir, tiny_model_dir))
    run.save_or_check_config()
    stages.sample_prompts(run, 0)
    stages.generate_trees(run, 0)
    stages.cache_prefixes(run, 0)
    return run_dir


def policy_after_step0(step0_inputs, tiny_model_dir, dest, *more, devices=None):
    shutil.copytree(step0_inputs, dest)
    run = Run(config(dest, tiny_model_dir, *more))
    manifest = stages.train_policy(run, 0, devices=devices)
    checkpointing.WRITER.wait()  # written in the background
    ckpt = dest / manifest["checkpoint"]
    return manifest, load_file(str(ckpt / "model.safetensors")), load_file(str(ckpt / "optimizer.safetensors"))


def assert_close(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        scale = max(float(a[name].abs().max()), 1e-30)
        diff = float((a[name].double() - b[name].double()).abs().max())
        assert diff <= 1e-6 * scale, f"{name}: max|diff| {diff:.3g} vs max|value| {scale:.3g}"


@pytest.fixture(scope="module")
def single(step0_inputs, tiny_model_dir, tmp_path_factory):
    return policy_after_step0(step0_inputs, tiny_model_dir, tmp_path_factory.mktemp("dp") / "one")


@pytest.mark.parametrize("fsdp", [pytest.param(False, id="dp"), pytest.param(True, id="fsdp")])
def test_two_ranks_equal_one(step0_inputs, single, tiny_model_dir, tmp_path, fsdp):
    ref_manifest, ref_model, ref_opt = single
    manifest, model, opt = policy_after_step0(step0_inputs, tiny_model_dir, tmp_path / "two", "pool.slots=2",
                                              "pool.devices_per_step=2", f"replay.fsdp={fsdp}", devices=[0, 1])
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(base[k].double(), ref_model[k]) for k in ref_model)  # the step moved the weights
    assert_close(ref_model, model)
    assert_close(ref_opt, opt)
    assert manifest["positions"] == ref_manifest["positions"]
    assert manifest["grad_norm"] == pytest.approx(ref_manifest["grad_norm"], rel=1e-6)
    assert manifest["objective"] == pytest.approx(ref_manifest["objective"], rel=1e-6, abs=1e-12)
