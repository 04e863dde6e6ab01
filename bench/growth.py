"""How a run's directory and Prefect's database grow over the steps of one run.

    .venv/bin/python bench/growth.py [--steps 200] [--every 25] [--code REV] [--out runs/growth]

One `lsreplay train` run of a tiny random model (2 layers of width 32 over SmolLM2's
tokenizer: the stages' records and Prefect's bookkeeping, not the model, are what grows) in
a fresh folder under --out, on a temporary Prefect server with a database of its own
(PREFECT_HOME there). While it runs, after every step: the run directory's bytes, the
database's bytes (with its write-ahead log), and the rows and data bytes the database holds
for artifacts and events. A row every --every steps, then each quantity's growth per step
over the first and the second half of the run: about equal where it grows linearly, about
3x where it grows with the square of the steps; the last line, key=value pairs of the growth
per step (the mean of the halves) and its ratio (second half over first). The run's files are counted in two parts: its
records (every step's, its config and metrics) and its checkpoints (the newest
checkpoint.keep_last, so bounded; their count varies while one is written).

--code REV runs lsreplay as of commit REV instead (`git archive`, this venv): 46b284b is the
code before issue #36 (a metrics table of every row at every step; every step's trees written
twice, one token id per line).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

from state import extract  # a commit's code, unpacked (bench/ is this script's folder: on sys.path)

REPO = Path(__file__).resolve().parents[1]

TINY = ("model.arch={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 49152}")
WORKLOAD = [TINY, "data.size=512", "data.prompts_per_step=2", "rollout.branching=[2,2]", "rollout.segment_tokens=[3]",
            "rollout.max_new_tokens=8", "drafter.steps=2", "drafter.batch_size=2", "threads=1"]
# What the database holds of artifacts (the metrics table's versions, the progress bars) and
# events (each task run's state changes, each artifact's creation and updates).
TABLES = {"artifact": "data", "event": "payload"}


def run_bytes(run_dir: Path) -> dict[str, int]:
    """The bytes of the run's files: its records (every step's, its config and metrics) and
    its checkpoints (the newest checkpoint.keep_last kept), a hard-linked file counted once."""
    seen, figures = set(), {"records_bytes": 0, "checkpoint_bytes": 0}
    for path in run_dir.rglob("*"):
        try:
            info = path.stat()
        except FileNotFoundError:  # deleted or renamed while the run writes
            continue
        if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            part = "checkpoint_bytes" if path.relative_to(run_dir).parts[0] == "checkpoints" else "records_bytes"
            figures[part] += info.st_size
    return figures


def database(home: Path) -> dict[str, int]:
    """The database's bytes, and per table of TABLES its rows and data bytes."""
    files = list(home.glob("prefect.db*"))
    figures = {"db_bytes": sum(p.stat().st_size for p in files)}
    if not (home / "prefect.db").exists():
        return figures
    with sqlite3.connect(f"file:{home / 'prefect.db'}?mode=ro", uri=True, timeout=30) as db:
        names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        for table, column in TABLES.items():
            found = next((n for n in (table, f"{table}s") if n in names), None)
            rows, size = db.execute(f"SELECT count(*), coalesce(sum(length({column})), 0) FROM {found}").fetchone() \
                if found else (0, 0)
            figures |= {f"{table}_rows": rows, f"{table}_bytes": size}
    return figures


def steps_done(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def watch(command: list[str], env: dict, cwd: Path, run_dir: Path, home: Path, steps: int) -> list[dict]:
    """Run `command`; after each step it finishes, what the run directory and database hold."""
    samples, seen = [], 0
    with subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as run:
        while run.poll() is None or seen < steps_done(run_dir):
            if (done := steps_done(run_dir)) > seen:
                seen = done
                samples.append({"step": done, **run_bytes(run_dir), **database(home)})
            time.sleep(0.5)
    if run.returncode != 0 or seen < steps:
        raise SystemExit(f"the run in {run_dir} failed (exit {run.returncode}, {seen} steps)")
    return samples


def growth(samples: list[dict], key: str) -> tuple[float, float]:
    """Growth per step of `key` over the first and the second half of the samples."""
    middle, last = samples[len(samples) // 2], samples[-1]
    first = samples[0]
    return ((middle[key] - first[key]) / (middle["step"] - first["step"]),
            (last[key] - middle[key]) / (last["step"] - middle["step"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--code", default="", help="a commit whose lsreplay to run (default: this checkout)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "growth")
    args = parser.parse_args()
    out = args.out / f"{args.code or 'this'}-{uuid.uuid4().hex[:6]}"
    source = extract(args.code, out) if args.code else REPO
    run_dir, home = out / "run", out / "prefect"
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # a temporary server of its own
    env |= {"PREFECT_HOME": str(home), "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lsreplay.cli", "train", f"run_dir={run_dir.resolve()}", f"steps={args.steps}",
               f"model.cache_dir={REPO / '.cache/models'}", f"pool.name=growth-{uuid.uuid4().hex[:8]}", *WORKLOAD]
    start = time.monotonic()
    samples = watch(command, env, source, run_dir, home, args.steps)
    minutes = (time.monotonic() - start) / 60
    print(f"lsreplay {args.code or 'this checkout'}: {args.steps} steps in {minutes:.1f} min\n")
    columns = ["step", "records_bytes", "checkpoint_bytes", "db_bytes", "artifact_rows", "artifact_bytes", "event_rows",
               "event_bytes"]
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for sample in samples:
        if sample["step"] % args.every == 0 or sample is samples[-1]:
            print("| " + " | ".join(f"{sample.get(c, 0):,}" for c in columns) + " |")
    print("\ngrowth per step, first half -> second half (bytes or rows):")
    summary = {"steps": args.steps, "minutes": round(minutes, 1)}
    for key in columns[1:]:
        early, late = growth(samples, key)
        print(f"  {key}: {early:,.0f} -> {late:,.0f} ({late / early if early else float('nan'):.2f}x)")
        if key != "checkpoint_bytes":  # bounded (keep_last), not per step
            summary |= {f"{key}_per_step": round((early + late) / 2), f"{key}_ratio": round(late / early, 2)}
    low, high = min(s["checkpoint_bytes"] for s in samples), max(s["checkpoint_bytes"] for s in samples)
    print(f"  checkpoint_bytes: between {low:,} and {high:,} (the checkpoints kept, and one being written)")
    print(" ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
