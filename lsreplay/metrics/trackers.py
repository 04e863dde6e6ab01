"""Experiment trackers (`report_to`, TRL's key): every metric line of a run, its held-out
evaluations and its config, with the step as the x axis, to TensorBoard, MLflow, Trackio
and W&B, as the HF trainer's callbacks (which TRL reports through) write them.

Each tracker files the run where the user's other runs are: in `tracking.project`, else
the project its own environment variable names (MLFLOW_EXPERIMENT_NAME, WANDB_PROJECT;
Trackio reads none), else the callbacks' default (MLflow's default experiment, "huggingface"
for W&B and Trackio). Keys are written as the callbacks write them (transformers'
rewrite_logs): train/NAME, and eval/NAME for eval_NAME, to TensorBoard, Trackio and W&B;
MLflow's as they are, characters MLflow refuses replaced by _ (`tracking.prefixes=false`:
metrics.jsonl's keys everywhere).

The training flow's process is the only one that reports (flows/train.py). Files stay under
`tracking.dir` (default <run_dir>/tracking): TensorBoard's event files in tensorboard/,
MLflow's sqlite store mlflow.db (unless tracking.mlflow_uri or MLFLOW_TRACKING_URI says
otherwise), Trackio's store in trackio/ (unless TRACKIO_DIR is set: Trackio reads it once,
when it is first imported), W&B's run files in wandb/ (WANDB_MODE=offline keeps them
there). A tracker that fails is logged once and left out for the rest of the run: a
tracker never stops training.
"""

from __future__ import annotations

import importlib.util
import logging
import numbers
import os
import re
from pathlib import Path

from lsreplay.core.config import TRACKERS, Config, ConfigError, to_dict, tracker_install_hint

log = logging.getLogger(__name__)

# The module each tracker imports as.
MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "trackio": "trackio", "wandb": "wandb"}
# The project the HF trainer's W&B and Trackio callbacks file a run in when none is named
# (WandbCallback: WANDB_PROJECT or "huggingface"; TrainingArguments.project: "huggingface").
HF_PROJECT = "huggingface"
# MLflow's experiment for runs that name none (every store has it).
MLFLOW_DEFAULT_EXPERIMENT = "Default"
# The characters of a metric name MLflow refuses, replaced by _ (as HF's MLflowCallback does).
_MLFLOW_REFUSED = re.compile(r"[^0-9A-Za-z_\-. :/]")


def tracking_dir(cfg: Config) -> Path:
    return Path(cfg.tracking.dir or Path(cfg.run_dir) / "tracking")


def run_name(cfg: Config) -> str:
    return cfg.tracking.run_name or Path(cfg.run_dir).resolve().name


def check_trackers(cfg: Config) -> None:
    """Every tracker of report_to is installed (checked before any work; nothing is imported)."""
    missing = [name for name in cfg.report_to if importlib.util.find_spec(MODULES[name]) is None]
    if missing:
        raise ConfigError(f"report_to names {', '.join(missing)}, not installed here: "
                          + "; ".join(f"pip install {TRACKERS[name]}" for name in missing)
                          + f" (supported: {tracker_install_hint()})")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def numbers_of(record: dict) -> dict[str, float]:
    """The figures of a metrics line a tracker plots: its numbers but the step."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)}


def hf_keys(figures: dict[str, float]) -> dict[str, float]:
    """Keys as the HF trainer's callbacks write them (transformers' rewrite_logs): eval_NAME
    as eval/NAME, test_NAME as test/NAME, every other as train/NAME."""
    out = {}
    for key, value in figures.items():
        for prefix in ("eval", "test"):
            if key.startswith(prefix + "_"):
                out[f"{prefix}/{key[len(prefix) + 1:]}"] = value
                break
        else:
            out[f"train/{key}"] = value
    return out


def project(cfg: Config, variable: str | None = None) -> str:
    """Where a tracker files the run: tracking.project, else the tracker's environment
    variable, else the HF callbacks' default."""
    return cfg.tracking.project or (os.environ.get(variable) if variable else None) or HF_PROJECT


class TensorBoard:
    prefixed = True  # HF's TensorBoardCallback rewrites the keys

    def __init__(self, cfg: Config, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(tracking_dir(cfg) / "tensorboard" / run_name(cfg)))
        self.writer.add_text("config", "\n".join(f"    {k}: {v!r}" for k, v in _flat(config).items()), 0)

    def log(self, figures: dict[str, float], step: int) -> None:
        for key, value in figures.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflow:
    prefixed = False  # HF's MLflowCallback writes the keys as they are

    def __init__(self, cfg: Config, config: dict):
        from mlflow.tracking import MlflowClient

        folder = tracking_dir(cfg).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        uri = cfg.tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{folder / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        # tracking.project, else MLFLOW_EXPERIMENT_NAME (HF's MLflowCallback), else MLflow's default experiment.
        name = cfg.tracking.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or MLFLOW_DEFAULT_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            name, artifact_location=(folder / "mlartifacts").as_uri())
        self.run_id = self.client.create_run(experiment_id, run_name=run_name(cfg)).info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, figures: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_REFUSED.sub("_", k), v, now, step) for k, v in figures.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackio:
    prefixed = True  # HF's TrackioCallback rewrites the keys

    def __init__(self, cfg: Config, config: dict):
        os.environ.setdefault("TRACKIO_DIR", str((tracking_dir(cfg) / "trackio").resolve()))
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project(cfg), name=run_name(cfg), config=config, resume="allow",
                                auto_log_cpu=False, auto_log_gpu=False)

    def log(self, figures: dict[str, float], step: int) -> None:
        self.run.log(figures, step=step)

    def close(self) -> None:
        self.run.finish()


class WandB:
    prefixed = True  # HF's WandbCallback rewrites the keys

    def __init__(self, cfg: Config, config: dict):
        import wandb

        folder = tracking_dir(cfg)
        folder.mkdir(parents=True, exist_ok=True)
        # wandb.init(project=...) wins over WANDB_PROJECT: the variable is read here, as HF's WandbCallback does.
        self.run = wandb.init(project=project(cfg, "WANDB_PROJECT"), name=run_name(cfg), dir=str(folder),
                              config=config, reinit="create_new")
        # The step is a metric of its own: a line logged late (the drafter's figures of the
        # step before) is still plotted at its step, as W&B's own step only grows.
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step")

    def log(self, figures: dict[str, float], step: int) -> None:
        self.run.log({**figures, "train/global_step": step})

    def close(self) -> None:
        self.run.finish()


ADAPTERS = {"tensorboard": TensorBoard, "mlflow": MLflow, "trackio": Trackio, "wandb": WandB}


class Trackers:
    """The run's trackers: each gets the config at start, then every metrics line; one
    that raises is logged once and dropped."""

    def __init__(self, cfg: Config):
        config = to_dict(cfg)  # secrets redacted
        self.active, self.prefixes = {}, cfg.tracking.prefixes
        for name in cfg.report_to:
            self._guard(name, lambda name=name: self.active.__setitem__(name, ADAPTERS[name](cfg, config)))

    def log(self, record: dict) -> None:
        figures = numbers_of(record)
        for name, tracker in list(self.active.items()):
            keyed = hf_keys(figures) if self.prefixes and tracker.prefixed else figures
            self._guard(name, tracker.log, keyed, int(record["step"]))

    def close(self) -> None:
        for name, tracker in list(self.active.items()):
            self._guard(name, tracker.close)
        self.active.clear()

    def _guard(self, name: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # a view of the run: never stop training for it
            self.active.pop(name, None)
            log.warning("tracker %s failed (%s: %s); the run goes on without it", name, type(e).__name__, e)
