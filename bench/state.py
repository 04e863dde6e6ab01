"""State handling: the code as issue #14 measured it, stages that load the model from the
store every time with a checkpoint written every step, and resident state with checkpoints
in the background, on the same workload, one after the other in one invocation.

    .venv/bin/python bench/state.py [--steps 3] [--out runs/state] [--before REV] [key=value ...]

The workload (issue #14's): 2 reasoning-gym gsm_symbolic prompts per step from a JSONL
file, 8 flat rollouts of at most 128 tokens each, SmolLM2-135M-Instruct in float32, GRPO
with branch replay, no drafter. All runs are real `lsreplay train` flows in fresh run
directories under --out:

    before     the code of commit --before (default 4238b33, the one the issue measured:
               every stage loads from the store, every step writes a full checkpoint, the
               caching pass scores every rollout token), extracted with `git archive` and
               run with this venv; --before '' skips it
    reload     checkpoint.resident=false checkpoint.background=false checkpoint.keep_last=0
               checkpoint.keep_step_data=true: every stage loads what it needs from the
               newest checkpoint and every step writes one and waits for it, nothing is
               deleted (the design before resident state)
    resident   the defaults: the policy, its float32 masters and AdamW stay in memory between
               stages and steps; checkpoint.every=1, written in the background, the last 2 kept

Per step, `state_seconds` is what the stages spent loading state and taking the checkpoint's
snapshot (or writing it, when not in the background), next to the policy stage's seconds.
The last line: step_ratio (before over resident, mean step_seconds: the issue's target),
reload_step_ratio (reload over resident: state handling alone), policy_ratio (reload over
resident), the resident run's state share of its policy stage, and what each run left on disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e import train  # noqa: E402  (a real `lsreplay train` flow run)
from lsreplay.data import generate_prompt_file  # noqa: E402
from lsreplay.report import read_metrics  # noqa: E402

WORKLOAD = ["data.prompts_per_step=2", "rollout.branching=[8]", "rollout.segment_tokens=[]",
            "rollout.max_new_tokens=128", "model.dtype=float32", "drafter.enabled=false", "rollout.spec_threshold=0"]
RUNS = {
    "reload": ["checkpoint.resident=false", "checkpoint.background=false", "checkpoint.keep_last=0",
               "checkpoint.keep_step_data=true"],
    "resident": [],
}


def train_before(rev: str, run_dir: Path, overrides: list[str]) -> list[dict]:
    """The same flow on the code of commit `rev`, imported from a `git archive` of it ahead
    of this checkout's package; its metrics."""
    source = run_dir.parent / f"source-{rev}"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--before {rev}: {archive.stderr.decode().strip()} (a shallow clone lacks the "
                         "history: git fetch --unshallow; or --before '' to skip the run)")
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    command = [sys.executable, "-m", "lsreplay.cli", "train", f"run_dir={run_dir.resolve()}",
               f"model.cache_dir={REPO / '.cache/models'}", *overrides]
    if subprocess.run(command, cwd=source, env={**os.environ, "PYTHONPATH": str(source)}).returncode != 0:
        raise SystemExit(f"the run of commit {rev} in {run_dir} failed")
    return read_metrics(run_dir)


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "runs/state"))
    parser.add_argument("--before", default="4238b33", help="the commit of the `before` run ('' = none)")
    parser.add_argument("overrides", nargs="*", help="key=value applied to both runs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    prompts = generate_prompt_file(out / "gsm_symbolic.jsonl", ["gsm_symbolic"], size=64, seed=0)
    common = [f"steps={args.steps}", f"data.path={prompts}", *WORKLOAD, *args.overrides]
    metrics = {"before": train_before(args.before, out / "before", common)} if args.before else {}
    metrics.update({name: train(None, out / name, [*common, *overrides]) for name, overrides in RUNS.items()})
    print("| run | step | step s | rollouts s | prefix cache s | policy s | backward s | state s | policy state s |")
    print("|---" * 9 + "|")
    keys = ("step_seconds", "trees_seconds", "prefixes_seconds", "policy_seconds", "backward_seconds",
            "state_seconds", "policy_state_seconds")
    for name, rows in metrics.items():
        for r in rows:
            values = {**r, "backward_seconds": r["positions"] / r["train_positions_per_s"]}
            cells = [f"{values[k]:.1f}" if k in values else "-" for k in keys]  # `before` has no state figures
            print(f"| {name} | {r['step']} | " + " | ".join(cells) + " |")
    reload, resident = metrics["reload"], metrics["resident"]

    def avg(rows, key):
        return mean(r[key] for r in rows)

    results = {
        **({"step_ratio": avg(metrics["before"], "step_seconds") / avg(resident, "step_seconds")}
           if "before" in metrics else {}),
        "reload_step_ratio": avg(reload, "step_seconds") / avg(resident, "step_seconds"),
        "policy_ratio": avg(reload, "policy_seconds") / avg(resident, "policy_seconds"),
        "reload_state_share": avg(reload, "policy_state_seconds") / avg(reload, "policy_seconds"),
        "resident_state_share": avg(resident, "policy_state_seconds") / avg(resident, "policy_seconds"),
        **({"before_disk_gb": disk_bytes(out / "before") / 1e9} if "before" in metrics else {}),
        "reload_disk_gb": disk_bytes(out / "reload") / 1e9,
        "resident_disk_gb": disk_bytes(out / "resident") / 1e9,
        "steps": args.steps,
    }
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
