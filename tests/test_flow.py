"""The real training flow under Prefect: a tiny model, two steps, every stage, the held-out
evaluation before, between and after them, then resume."""

import json

import torch
from safetensors.torch import load_file

from flowrun import tree_records, unique_pool

from lsreplay.core.config import load_config
from lsreplay.core.layout import STAGES
from lsreplay.core.run import Run

POOL = unique_pool()  # the same for the run and its rerun


def overrides(run_dir, model_dir):
    return [f"run_dir={run_dir}", f"model.path={model_dir}", "steps=2", "data.size=8",
            "data.prompts_per_step=2", "rollout.branching=[2,2]", "rollout.segment_tokens=[3]",
            "rollout.max_new_tokens=8", "drafter.steps=2", "drafter.batch_size=2", "optim.lr=1e-3",
            "algo.kl_coef=0.05", "eval.every=1", "eval.size=3", "eval.samples=2", POOL,
            # A budget too small for one leaf: each branching node holds least beside its leaves
            # recomputed after them, so the caching pass writes the K/V of each, and the update
            # reads them back from the store (memory.kept_spans; the other flow tests keep every
            # node's graph at the default budget, and write no K/V).
            "replay.budget_mb=1"]


def step_files(run_dir):
    return {p: p.stat().st_mtime_ns for p in run_dir.glob("step_*/**/*") if p.is_file()}


def test_flow_runs_every_stage_and_resumes(prefect_server, tiny_model_dir, tmp_path, monkeypatch):
    from flows.train import train

    run_dir = tmp_path / "run"
    # The evaluation is a retried task like the others: its first try after 1 update fails.
    monkeypatch.setenv("LSREPLAY_FAULTS", "eval@1:fail")
    monkeypatch.setenv("LSREPLAY_RETRY_DELAY", "0.05")
    metrics = train(overrides=overrides(run_dir, tiny_model_dir))
    monkeypatch.delenv("LSREPLAY_FAULTS")
    assert {k: v for k, v in Run(load_config(None, [f"run_dir={run_dir}"])).executions().items()
            if k[1] == "eval"} == {(0, "eval"): 1, (1, "eval"): 2, (2, "eval"): 1}
    # Held-out evaluations after 0, 1 and 2 updates; the last line has the evaluation alone.
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all({"eval_accuracy", "eval_accuracy_lo", "eval_accuracy_hi", "eval_reward"} <= m.keys() for m in metrics)
    assert ["loss" in m for m in metrics] == [True, True, False]
    evaluated = [json.loads((run_dir / f"step_{s:04d}/eval.done.json").read_text()) for s in range(3)]
    assert [e["prompts"] for e in evaluated] == [3, 3, 3] and evaluated[0]["samples"] == 2
    heldout = [[a["question"] for a in json.loads((run_dir / f"step_{s:04d}/eval.json").read_text())["answers"]]
               for s in range(3)]
    assert heldout[0] == heldout[1] == heldout[2]  # the same prompts every time
    trained = [p["question"] for s in range(2)
               for p in json.loads((run_dir / f"step_{s:04d}/prompts.json").read_text())["prompts"]]
    assert not set(trained) & set(heldout[0])
    for step in (0, 1):
        for stage in STAGES:
            assert (run_dir / f"step_{step:04d}" / f"{stage}.done.json").is_file()
        prefixes = json.loads((run_dir / f"step_{step:04d}" / "prefixes.done.json").read_text())
        assert prefixes["prefix_kv"] and all(prefixes["prefix_kv"])  # every tree cached its branch points
        assert (run_dir / "checkpoints/policy" / f"step_{step:04d}" / "model.safetensors").is_file()
        # A spot session that found its rollouts over trained nothing and saved nothing.
        drafter = json.loads((run_dir / f"step_{step:04d}" / "drafter.done.json").read_text())
        saved = (run_dir / "checkpoints/drafter" / f"step_{step:04d}" / "model.safetensors").is_file()
        assert saved == bool(drafter["checkpoint"]) == (drafter["steps_done"] > 0)
    assert json.loads((run_dir / "step_0001/drafter.done.json").read_text())["steps_done"] == 2  # the last step's
    assert (run_dir / "checkpoints/policy/step_0001/optimizer.safetensors").is_file()
    m = metrics[1]
    assert m["positions_ratio"] > 1 and m["per_rollout_positions"] > m["positions"]
    assert {"reward_mean", "loss", "trees_seconds", "policy_seconds", "drafter_loss"} <= m.keys()
    # Every tree's leaves stand for the 2 x 2 samples of its shape, each counted once or twice.
    trees = tree_records(run_dir, 1)
    assert all(sum(t["counts"]) == 4 and len(t["counts"]) == len(t["completions"]) for t in trees)
    assert m["group_size"] == 4 and m["leaves_per_tree"] == sum(len(t["counts"]) for t in trees) / len(trees)
    assert 1 <= m["effective_group_size"] <= 4
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 3

    base = load_file(str(tiny_model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    trained = load_file(str(run_dir / "checkpoints/policy/step_0001/model.safetensors"))["model.embed_tokens.weight"]
    assert not torch.equal(base, trained)

    # The same command again: every stage is found finished and nothing is rewritten.
    before = step_files(run_dir)
    again = train(overrides=overrides(run_dir, tiny_model_dir))
    assert again == metrics
    assert step_files(run_dir) == before
