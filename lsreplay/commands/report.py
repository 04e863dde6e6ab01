"""A self-contained report of one or more runs: markdown, one PNG of curves, the data.

`lsreplay report RUN_DIR [RUN_DIR ...] --out DIR` writes DIR/report.md, DIR/curves.png
and DIR/curves.json (the plotted numbers, per run). Several runs are overlaid, each
labelled by its run directory's name.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on training machines
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# (metric key in metrics.jsonl, panel title). Missing keys are skipped per run.
PANELS = [
    ("eval_accuracy", "held-out accuracy, greedy (95% CI)"),
    ("eval_sample_accuracy", "held-out accuracy, sampled (95% CI)"),
    ("eval_reward", "held-out reward, sampled (95% CI)"),
    ("reward_mean", "reward (mean over the G samples)"),
    ("loss", "loss"),
    ("kl", "KL to reference"),
    ("positions_saved", "token positions saved by replay"),
    ("step_seconds", "wall time per step (s)"),
    ("drafter_top1_accept", "drafter top-1 agreement"),
    ("rollout_accept_len", "speculative tail: tokens per verify"),
    ("leaves_per_tree", "leaves sampled per tree"),
    ("effective_group_size", "effective group size per tree"),
]


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory with at least one finished step?")
    return with_derived([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def with_derived(rows: list[dict]) -> list[dict]:
    """Copies of metrics rows plus the columns the report plots but runs do not log."""
    rows = [dict(r) for r in rows]
    for r in rows:
        if "positions" in r:  # a line of evaluation alone (after the last update) has none
            r["positions_saved"] = r.get("per_rollout_positions", 0) - r["positions"]
    return rows


def curves(runs: dict[str, list[dict]]) -> dict[str, dict[str, list]]:
    """Per panel, per run: the points plotted, [step, value], or [step, value, low, high]
    for a metric logged with its confidence interval (key_lo, key_hi). The held-out
    evaluation's step is the number of updates the policy had."""
    out: dict[str, dict[str, list]] = {}
    for key, _ in PANELS:
        for name, rows in runs.items():
            points = [[r["step"], r[key], *[r[f"{key}_{end}"] for end in ("lo", "hi") if f"{key}_{end}" in r]]
                      for r in rows if r.get(key) is not None]
            if points:
                out.setdefault(key, {})[name] = points
    return out


def plot(data: dict[str, dict[str, list]], path: Path, keys: tuple[str, ...] | None = None) -> None:
    """The panels of PANELS that have data (only those in `keys`, if given), runs overlaid."""
    panels = [(k, t) for k, t in PANELS if k in data and (keys is None or k in keys)]
    # One colour per run in every panel, also where some runs have no points.
    names = list(dict.fromkeys(name for key, _ in panels for name in data[key]))
    colour = {name: f"C{i}" for i, name in enumerate(names)}
    cols = min(3, len(panels))
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        for name, points in data[key].items():
            steps, values = [p[0] for p in points], [p[1] for p in points]
            ax.plot(steps, values, marker="o", label=name, color=colour[name])
            if all(len(p) == 4 for p in points):
                ax.fill_between(steps, [p[2] for p in points], [p[3] for p in points], color=colour[name], alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("updates done" if key.startswith("eval_") else "step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    # The legend lists every run, whichever panels it has points in.
    axes.flat[0].legend(handles=[Line2D([], [], marker="o", color=colour[n], label=n) for n in names], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(runs: dict[str, list[dict]]) -> str:
    lines = ["# lsreplay report", "", "![curves](curves.png)", "",
             "Held-out accuracy on a row is that of the policy after `step` updates (the policy that "
             "acts in that step), greedy answers, with its 95% Wilson interval.", ""]
    for name, rows in runs.items():
        lines += [f"## {name}", "",
                  "| step | held-out accuracy | reward | loss | leaves / G (effective) per tree "
                  "| positions (replay / per-rollout) | step s | state s | drafter top-1 |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['step']} | {_accuracy(r)} | {_num(r, 'reward_mean', '.3f')} | {_num(r, 'loss', '.4g')} "
                         f"| {_tree_shape(r)} | {r.get('positions', '-')} / {r.get('per_rollout_positions', '-')} "
                         f"| {_num(r, 'step_seconds', '.1f')} | {_num(r, 'state_seconds', '.1f')} "
                         f"| {_num(r, 'drafter_top1_accept', '.3f')} |")
        lines.append("")
    return "\n".join(lines)


def _tree_shape(row: dict) -> str:
    """Leaves sampled / samples they stand for (effective group size), per tree; "-" for
    runs logged before leaves carried counts."""
    if "group_size" not in row:
        return "-"
    return f"{row['leaves_per_tree']:.2f} / {row['group_size']:g} ({row['effective_group_size']:.2f})"


def _num(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "-"


def _accuracy(row: dict) -> str:
    if "eval_accuracy" not in row:
        return "-"
    return f"{row['eval_accuracy']:.3f} [{row['eval_accuracy_lo']:.3f}, {row['eval_accuracy_hi']:.3f}]"


def write_report(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Write report.md, curves.png and curves.json into `out`; returns report.md's path."""
    names = [Path(d).resolve().name for d in run_dirs]
    if len(set(names)) < len(names):  # same folder names: label by full path instead
        names = [str(Path(d).resolve()) for d in run_dirs]
    runs = {name: read_metrics(d) for name, d in zip(names, run_dirs)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = curves(runs)
    plot(data, out / "curves.png")
    (out / "curves.json").write_text(json.dumps(data, indent=1))
    (out / "report.md").write_text(markdown(runs))
    return out / "report.md"
