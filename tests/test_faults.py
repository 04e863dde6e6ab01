"""Injected faults: transient ones are retried and change nothing; a permanent one stops
the run with a message naming the stage, the step and the cause, and commits nothing."""

from __future__ import annotations

import hashlib
import json

import pytest
from flowrun import digests, reference_run, step0_copy, unique_pool

from lsreplay import cli

from lsreplay.core import faults
from lsreplay.core.config import load_config
from lsreplay.core.layout import STAGES
from lsreplay.core.run import Run


def test_parse_faults():
    parsed = faults.parse("trees@1:kill, prefixes@0:fail*2,storage:fail*3,policy:nan,trees@0:kill_engine")
    assert [(f.target, f.step, f.action, f.remaining) for f in parsed][:3] == [
        ("trees", 1, "kill", 1), ("prefixes", 0, "fail", 2), ("storage", None, "fail", 3)]
    assert (parsed[-1].action, parsed[-1].remaining) == ("kill_engine", 1)
    assert [(f.target, f.step, f.action, f.remaining) for f in faults.parse("policy@1:interrupt")] == [
        ("policy", 1, "interrupt", 1)]
    for bad in ("trees@x:kill", "tree@1:kill", "trees@1:explode", "storage@1:fail", "trees:nan", "policy:kill_engine",
                "trees@1:interrupt"):
        with pytest.raises(ValueError, match="LSREPLAY_FAULTS"):
            faults.parse(bad)


def test_transient_faults_are_retried_and_artifacts_exist(prefect_server, tiny_model_dir, tmp_path_factory):
    """The reference run had two failing store writes and a failing first try of step 0's
    prefix stage injected; it completed (and test_resume shows its weights equal a run
    without faults). Its Prefect artifacts are there too."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    ref = reference_run(tmp_path_factory, tiny_model_dir)
    assert [m["step"] for m in ref.metrics] == [0, 1]
    injected = [m for m in ref.warnings if m.startswith("injected transient")]
    assert len(injected) == 3, ref.warnings
    assert any("retrying in" in m for m in ref.warnings), ref.warnings  # the store's own retry
    ran = Run(load_config(None, [f"run_dir={ref.run_dir}"])).executions()
    assert ran == {**{(s, st): 1 for s in (0, 1) for st in STAGES}, (0, "prefixes"): 2}

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[ref.flow_run_id])))
    by_type = {}
    for a in found:
        by_type.setdefault(a.type, []).append(a)
    table = [a for a in by_type["table"] if a.key and a.key.endswith("-metrics")]
    rows = [json.loads(a.data) if isinstance(a.data, str) else a.data for a in table]
    # One table for the flow run, updated in place as steps finish (not a version per step).
    assert [[r["step"] for r in table] for table in rows] == [[0, 1]]
    summary = [a for a in by_type["markdown"] if a.key and a.key.endswith("-summary")]
    assert summary and "data:image/png;base64," in summary[0].data
    assert len(by_type["progress"]) >= 3  # steps, and each step's rollouts
    assert (ref.run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nan_loss_stops_the_run_and_commits_nothing(prefect_server, tiny_model_dir, tmp_path_factory, tmp_path,
                                                    monkeypatch, capsys):
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    run_dir = step0_copy(ref, tmp_path / "run")
    step0 = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    monkeypatch.setenv("LSREPLAY_FAULTS", "policy@1:nan")
    monkeypatch.setenv("LSREPLAY_RETRY_DELAY", "0.05")

    assert cli.main(["resume", str(run_dir), "--steps", "2", unique_pool()]) == 1
    err = capsys.readouterr().err
    assert "stage policy of step 1 failed: NonFiniteLoss" in err and "loss=nan" in err, err
    assert "the step was not committed" in err and "Lower optim.lr" in err
    assert not (run_dir / "checkpoints/policy/step_0001").exists()
    assert not (run_dir / "step_0001/policy.done.json").exists()
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (run_dir / "checkpoints").rglob("*")
            if p.is_file()} == step0
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    # Not retried: a NaN does not go away.
    assert Run(load_config(None, [f"run_dir={run_dir}"])).executions()[1, "policy"] == 1


def test_a_try_interrupted_after_its_optimizer_step_is_not_stepped_twice(prefect_server, tiny_model_dir,
                                                                         tmp_path_factory, tmp_path, monkeypatch):
    """Step 1's update is interrupted right after AdamW stepped the copy it holds, before the
    copy is recorded as updated (where Prefect's task timeout can strike); the retry does not
    step that copy again: the run ends with the reference run's weights."""
    ref = reference_run(tmp_path_factory, tiny_model_dir)
    run_dir = step0_copy(ref, tmp_path / "run")
    monkeypatch.setenv("LSREPLAY_FAULTS", "policy@1:interrupt")
    monkeypatch.setenv("LSREPLAY_RETRY_DELAY", "0.05")
    assert cli.main(["resume", str(run_dir), "--steps", "2", unique_pool()]) == 0
    assert Run(load_config(None, [f"run_dir={run_dir}"])).executions()[1, "policy"] == 2  # interrupted, retried
    assert digests(run_dir, "checkpoints/policy") == digests(ref.run_dir, "checkpoints/policy")
