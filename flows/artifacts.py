"""What a training flow shows in the Prefect UI (Artifacts tab of the flow run):

- `lsreplay-<run>-metrics`: a table, one row per finished step (one per flow run, updated in
  place after every step and every held-out evaluation)
- a progress bar of finished steps, and one per step's rollout stage
- `lsreplay-<run>-summary`: a markdown summary at the end, with the held-out accuracy, reward
  and loss curves as an embedded PNG (also written to the run's store as curves.png)

Artifacts are a view: a failure to create one is logged and never fails the run.
"""

from __future__ import annotations

import base64
import logging
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from uuid import UUID

from prefect.artifacts import (
    TableArtifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client

from lsreplay.core.run import Run

log = logging.getLogger(__name__)

TABLE_COLUMNS = ("step", "eval_accuracy", "eval_accuracy_lo", "eval_accuracy_hi", "eval_sample_accuracy",
                 "eval_reward", "reward_mean", "loss", "kl", "grad_norm", "leaves_per_tree", "effective_group_size",
                 "positions_ratio", "completion_tokens", "state_seconds",
                 "rollout_tokens_per_s", "train_positions_per_s", "drafter_loss", "drafter_top1_accept",
                 "prompts_seconds", "trees_seconds", "prefixes_seconds", "policy_seconds", "drafter_seconds")


def run_slug(run: Run) -> str:
    """A Prefect artifact key part naming the run: lowercase letters, digits and dashes."""
    tail = run.store.uri.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^a-z0-9]+", "-", tail.lower()).strip("-") or "run"


def _safely(what: str, fn: Callable, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # the UI is a view; never fail the run for it
        log.warning("could not create the %s artifact: %s: %s", what, type(e).__name__, e)
        return None


class MetricsTable:
    """The run's metrics table: created at a flow run's first report, then updated in place.
    A new version with every row at every step, as before, left steps x steps / 2 rows in
    Prefect's database (about 500,000 after 1,000 steps); one artifact per flow run, updated,
    keeps it linear. Updated with the API's PATCH of the artifact, not the client's
    `update_artifact`, whose event would carry every row again, each step."""

    def __init__(self, run: Run):
        self.run = run
        self.id: UUID | None = None

    def __call__(self) -> None:
        rows = [{k: _round(r.get(k)) for k in TABLE_COLUMNS if k in r} for r in self.run.metrics()]
        if self.id is None:
            self.id = _safely("metrics table", create_table_artifact, rows,
                              key=f"lsreplay-{run_slug(self.run)}-metrics",
                              description=f"Per-step metrics of {self.run.store.uri}")
        else:
            _safely("metrics table", _update_table, self.id, rows)


def _update_table(artifact_id: UUID, rows: list[dict]) -> None:
    with get_client(sync_client=True) as client:
        client.request("PATCH", "/artifacts/{id}", path_params={"id": artifact_id},
                       json={"data": TableArtifact(table=rows).format()})


def _round(v):
    return round(v, 6) if isinstance(v, float) else v


class Progress:
    """A Prefect progress artifact, created on first report and updated at most every
    `every` seconds (and always at 100%)."""

    def __init__(self, description: str, every: float = 2.0):
        self.description, self.every = description, every
        self.id: UUID | None = None
        self.last = 0.0
        self.failed = False

    def __call__(self, fraction: float) -> None:
        if self.failed:
            return
        now, percent = time.monotonic(), round(100 * min(max(fraction, 0.0), 1.0), 1)
        if self.id is not None and percent < 100 and now - self.last < self.every:
            return
        self.last = now
        try:
            if self.id is None:
                self.id = create_progress_artifact(percent, description=self.description)
            else:
                update_progress_artifact(self.id, percent)
        except Exception as e:
            self.failed = True
            log.warning("could not report progress (%s): %s: %s", self.description, type(e).__name__, e)


def curves_png(name: str, metrics: list[dict]) -> bytes:
    """The curves of `lsreplay report` (reward, loss, KL, positions saved, step time,
    drafter agreement) for this run, as PNG bytes (the store may be remote)."""
    from lsreplay.commands import report

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "curves.png"
        report.plot(report.curves({name: report.with_derived(metrics)}), path)
        return path.read_bytes()


def summary(run: Run) -> UUID | None:
    """Write curves.png to the run's store and the markdown summary (with the curves inline)."""
    metrics = run.metrics()
    if not metrics:
        return None
    png = _safely("curves", curves_png, run_slug(run), metrics)
    if png is not None:
        _safely("curves.png", run.store.write_bytes, "curves.png", png)
    # The last step that trained; the newest evaluation (after the last update) has a line of its own.
    trained = [m for m in metrics if "loss" in m]
    if not trained:
        return None
    last = trained[-1]
    rows = "\n".join(f"| {k} | {_fmt(last[k])} |" for k in TABLE_COLUMNS
                     if k in last and k != "step" and not k.startswith("eval_"))
    image = f"![reward and loss curves](data:image/png;base64,{base64.b64encode(png).decode()})\n" if png else ""
    last_ckpt = run.checkpoint("policy", last["step"])
    markdown = (
        f"# lsreplay run `{run.store.uri}`\n\n"
        f"{len(trained)} steps finished; config hash `{run.config_hash}`.\n\n"
        f"Policy checkpoint: `{run.store.url(last_ckpt)}`  \n"
        f"Drafter checkpoint: `{run.store.url(run.checkpoint('drafter', last['step']))}`  \n"
        f"Metrics: `{run.store.url('metrics.jsonl')}`, curves: `{run.store.url('curves.png')}`\n\n"
        f"{image}\n"
        f"## Step {last['step']}\n\n{_eval_line(metrics[-1])}| metric | value |\n|---|---|\n{rows}\n")
    return _safely("summary", create_markdown_artifact, markdown, key=f"lsreplay-{run_slug(run)}-summary",
                   description=f"Summary of {run.store.uri}")


def _eval_line(row: dict) -> str:
    if "eval_accuracy" not in row:
        return ""
    sampled = (f"; sampled {row['eval_sample_accuracy']:.3f} (95% CI {row['eval_sample_accuracy_lo']:.3f}-"
               f"{row['eval_sample_accuracy_hi']:.3f})" if "eval_sample_accuracy" in row else "")
    return (f"Held-out accuracy after {row['step']} updates, {row['eval_prompts']} prompts: greedy "
            f"{row['eval_accuracy']:.3f} (95% CI {row['eval_accuracy_lo']:.3f}-{row['eval_accuracy_hi']:.3f}){sampled}\n\n")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
