"""The per-rollout baseline (A) and branch replay trained on A's own rollouts (C) end two
RL steps with the same weights: replay changes the work, not the training.

The norms compute in float64 (`exact_rmsnorm`): HF's RMSNorm rounds to float32 even in a
float64 model, and AdamW moves a weight whose gradient is below its eps (1e-8) by about
lr * g / eps, which magnifies that rounding up to lr / eps = 1e5 times. Measured after two
steps: 6.5e-6 of max|weight| with float32 norms and the independent baseline, 7.8e-7 with
the group baseline, 1e-13 with float64 norms."""

from __future__ import annotations

import shutil

from safetensors.torch import load_file

from lsreplay import stages

from lsreplay.core.config import load_config
from lsreplay.core.run import Run
from lsreplay.state import checkpointing


def run_at(run_dir, model_dir, mode):
    run = Run(load_config(None, [
        f"run_dir={run_dir}", f"model.path={model_dir}", "model.dtype=float64", "steps=2", "data.size=8",
        "data.prompts_per_step=2", "rollout.branching=[2,2]", "rollout.segment_tokens=[3]",
        "rollout.max_new_tokens=6", "optim.lr=1e-3", "drafter.enabled=false", f"replay.mode={mode}",
        "reward.function=varied_rewards:code_parity"]))
    run.save_or_check_config()
    return run


def test_replay_on_the_baselines_rollouts_ends_with_the_baselines_weights(exact_rmsnorm, tiny_model_dir, tmp_path):
    a = run_at(tmp_path / "a", tiny_model_dir, "naive")
    c = run_at(tmp_path / "c", tiny_model_dir, "replay")
    for step in range(2):
        stages.sample_prompts(a, step)
        stages.generate_trees(a, step)
        for name in ("prompts.json", "prompts.done.json", "trees", "trees.done.json"):  # A's rollouts, tree for tree
            (tmp_path / "c" / a.key(step)).mkdir(parents=True, exist_ok=True)
            copy = shutil.copytree if (tmp_path / "a" / a.key(step, name)).is_dir() else shutil.copy
            copy(tmp_path / "a" / a.key(step, name), tmp_path / "c" / a.key(step, name))
        for run in (a, c):
            stages.cache_prefixes(run, step)
            stages.train_policy(run, step)
    checkpointing.WRITER.wait()  # checkpoints are written in the background
    wa = load_file(str(tmp_path / "a" / a.checkpoint("policy", 1) / "model.safetensors"))
    wc = load_file(str(tmp_path / "c" / c.checkpoint("policy", 1) / "model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(float((wa[k].double() - base[k].double()).abs().max()) > 0 for k in wa)  # training moved
    for name in wa:
        scale = float(wa[name].abs().max())
        assert float((wa[name] - wc[name]).abs().max()) <= 1e-10 * scale, name  # measured 1e-13
