"""report_to: the metric lines, held-out evaluations and config of a run in TensorBoard,
MLflow, Trackio and W&B, read back with each tool's own reader; a failing tracker is
logged once and never stops the run."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from lsreplay.core.config import ConfigError, load_config
from lsreplay.metrics.trackers import Trackers, check_trackers, hf_keys

RECORDS = [{"step": 0, "eval_accuracy": 0.25}, {"step": 0, "reward": 0.5, "loss": 1.5, "rewards/f/mean": 0.5},
           {"step": 1, "reward": 0.75, "loss": 1.25, "rewards/f/mean": 0.75, "engine": "hf"}]


def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = [p for p in folder.iterdir() if p.is_dir()]
    events = EventAccumulator(str(run))
    events.Reload()
    return [(e.step, round(e.value, 6)) for e in events.Scalars(tag)]


def mlflow_history(db: Path, project: str, key: str) -> tuple[list[tuple[int, float]], dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)], run.data.params


def test_every_tracker_gets_the_lines_and_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    fresh_trackio = "trackio" not in sys.modules and "TRACKIO_DIR" not in os.environ
    if fresh_trackio:  # Trackio reads its folder once, on import: this test sets it, later ones share it
        monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "run/tracking/trackio"))
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "report_to=[tensorboard,mlflow,trackio,wandb]",
                             "tracking.project=lsreplay-test", "optim.lr=3e-5"])
    check_trackers(cfg)
    trackers = Trackers(cfg)
    assert set(trackers.active) == {"tensorboard", "mlflow", "trackio", "wandb"}
    for record in RECORDS:
        trackers.log(record)
    trackers.close()

    folder = tmp_path / "run/tracking"
    # Keys as the HF trainer's callbacks write them: train/ and eval/ (MLflow's as they are).
    assert tensorboard_scalars(folder / "tensorboard", "train/reward") == [(0, 0.5), (1, 0.75)]
    assert tensorboard_scalars(folder / "tensorboard", "eval/accuracy") == [(0, 0.25)]
    history, params = mlflow_history(folder / "mlflow.db", "lsreplay-test", "rewards/f/mean")
    assert history == [(0, 0.5), (1, 0.75)] and params["optim.lr"] == "3e-05" and params["storage.secret"] == ""

    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs("lsreplay-test", "run")
    assert [(r["step"], r.get("train/loss")) for r in logs if "train/loss" in r] == [(0, 1.5), (1, 1.25)]
    assert SQLiteStorage.get_run_config("lsreplay-test", "run")["optim"]["lr"] == 3e-5
    if fresh_trackio:
        assert (folder / "trackio/lsreplay-test.db").is_file()
    assert list((folder / "wandb").glob("offline-run-*/run-*.wandb"))  # W&B's offline run file


def test_runs_go_where_the_trackers_own_variables_say(tmp_path, monkeypatch):
    """No tracking.project: MLFLOW_EXPERIMENT_NAME and WANDB_PROJECT name the project, as for
    the user's other runs (HF's callbacks); Trackio, which reads no variable, files it under
    the HF trainer's default project."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mlflow-env-15")
    monkeypatch.setenv("WANDB_PROJECT", "wandb-env-15")
    cfg = load_config(None, [f"run_dir={tmp_path / 'env-run-15'}", "report_to=mlflow,wandb,trackio"])
    trackers = Trackers(cfg)
    trackers.log(RECORDS[1])
    trackers.close()
    folder = tmp_path / "env-run-15/tracking"
    assert mlflow_history(folder / "mlflow.db", "mlflow-env-15", "reward")[0] == [(0, 0.5)]
    (run_file,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"wandb-env-15" in run_file.read_bytes()

    from trackio.sqlite_storage import SQLiteStorage

    assert [r["train/reward"] for r in SQLiteStorage.get_logs("huggingface", "env-run-15")] == [0.5]


def test_keys_as_metrics_jsonl_has_them_without_prefixes(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "report_to=[tensorboard]", "tracking.prefixes=false"])
    trackers = Trackers(cfg)
    for record in RECORDS:
        trackers.log(record)
    trackers.close()
    assert tensorboard_scalars(tmp_path / "run/tracking/tensorboard", "reward") == [(0, 0.5), (1, 0.75)]
    assert tensorboard_scalars(tmp_path / "run/tracking/tensorboard", "eval_accuracy") == [(0, 0.25)]


def test_hf_keys_are_transformers_rewrite_logs():
    from transformers.integrations.integration_utils import rewrite_logs

    figures = {"reward": 1.0, "eval_accuracy": 0.5, "test_loss": 2.0, "rewards/f/mean": 0.25, "evaluation": 3.0}
    assert hf_keys(figures) == rewrite_logs(figures)


def test_a_failing_tracker_is_logged_once_and_the_run_goes_on(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("tracking.dir is a file: nothing can be written under it")
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "report_to=[tensorboard]", f"tracking.dir={blocked}"])
    with caplog.at_level(logging.WARNING, logger="lsreplay.metrics.trackers"):
        trackers = Trackers(cfg)
        for record in RECORDS:
            trackers.log(record)
        trackers.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("tracker tensorboard failed") and not trackers.active


def test_unknown_or_missing_trackers_say_what_to_install(monkeypatch):
    with pytest.raises(ConfigError, match=r"report_to' = 'neptune' is not allowed: a list of trackers: tensorboard "
                                          r"\(pip install tensorboard\), mlflow \(pip install mlflow-skinny\), trackio "
                                          r"\(pip install trackio\), wandb \(pip install wandb\)"):
        load_config(None, ["report_to=[tensorboard,neptune]"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where it is not installed
    with pytest.raises(ConfigError, match="report_to names wandb, not installed here: pip install wandb"):
        check_trackers(load_config(None, ["report_to=wandb"]))
