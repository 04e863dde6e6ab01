"""Settings that used to turn training off without a word. optim.grad_clip=0 means no
clipping (clip_grad_norm_(params, 0) scaled every gradient to 0, so such a run trained for
hours and never changed the model); the others are config errors (tests/test_config.py)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from lsreplay import stages

from lsreplay.core.config import load_config
from lsreplay.stages.preflight import preflight
from lsreplay.state import checkpointing


def test_a_step_without_clipping_moves_the_weights(tiny_model_dir, tmp_path):
    # A reward that differs between a random model's rollouts, so every advantage is not 0.
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", "data.size=8",
                             "data.prompts_per_step=2", "rollout.branching=[4]", "rollout.segment_tokens=[]",
                             "rollout.max_new_tokens=6", "drafter.enabled=false", "optim.lr=1e-3",
                             "optim.grad_clip=0", "reward.function=varied_rewards:code_parity"])
    run = preflight(cfg)
    for stage in (stages.sample_prompts, stages.generate_trees, stages.cache_prefixes):
        stage(run, 0)
    policy = stages.train_policy(run, 0)
    checkpointing.WRITER.wait()  # written in the background
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "run/checkpoints/policy/step_0000/model.safetensors"))
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    # AdamW's first step moves a weight with a gradient by about lr; a zeroed gradient, not at all.
    assert moved == pytest.approx(1e-3, rel=0.05)
    assert policy["grad_norm"] > 0  # the norm before clipping, as always
