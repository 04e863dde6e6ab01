"""What the drafter and the background checkpoint cost the default step, side by side.

    .venv/bin/python bench/drafter_cost.py [--steps 3] [--rounds 1] [--out runs/drafter_cost] [key=value ...]

Real `lsreplay train` flow runs of configs/default.yaml (SmolLM2-135M, 4 prompts x 8
rollouts behind the ~620-token context), one after another, in fresh run directories:

    off         drafter.enabled=false
    on          the default: hidden states kept for the drafter, the drafter of each step
                distilled (on a one-slot CPU pool: the last step's after the last update,
                which is not part of any step), speculation in the tail once one trained
    sync        as `on`, with checkpoint.background=false: the policy stage writes each
                checkpoint itself, and no write overlaps a step

--rounds N runs them N times, every other round in reverse order. Per step, from the
stages' manifests: step seconds and each stage's. The last line:

    drafter_step_ratio     on / off, mean step seconds (the issue's target: <= 1.15)
    overlap_ratio          on's steps / sync's steps without their checkpoint writes: what a
                           background write costs the step it overlaps (1 = nothing)
    write_seconds          sync's mean checkpoint write, which `on` takes off the step

Run it alone: another job on the machine weighs on the runs unequally.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e import train  # noqa: E402  (a real `lsreplay train` flow run)
from side_by_side import key_values  # noqa: E402

CONFIG = str(REPO / "configs/default.yaml")
RUNS = {"off": ["drafter.enabled=false"], "on": [], "sync": ["checkpoint.background=false"]}
STAGES = ("trees", "prefixes", "policy")


def write_seconds(run_dir: Path, step: int) -> float:
    """How long the checkpoint of `step` took to write (its checkpoint.json records it)."""
    record = run_dir / f"checkpoints/policy/step_{step:04d}/checkpoint.json"
    return json.loads(record.read_text())["write_seconds"] if record.is_file() else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "runs/drafter_cost"))
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    rows: dict[str, list[dict]] = {name: [] for name in RUNS}
    for round_ in range(args.rounds):
        for name in RUNS if round_ % 2 == 0 else list(RUNS)[::-1]:
            run_dir = out / f"{name}-{round_}"
            for r in train(CONFIG, run_dir, [f"steps={args.steps}", *args.overrides, *RUNS[name]]):
                # The last step's checkpoint is kept (it is not pruned) and never overlaps a step.
                rows[name].append({**r, "round": round_, "write_seconds": write_seconds(run_dir, r["step"])})
    print("| run | round | step | step s | rollouts s | prefix cache s | policy s | checkpoint write s |")
    print("|---" * 8 + "|")
    for name, runs in rows.items():
        for r in runs:
            cells = [r["step_seconds"], *(r[f"{s}_seconds"] for s in STAGES), r["write_seconds"]]
            print(f"| {name} | {r['round']} | {r['step']} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")

    def avg(name: str, key: str) -> float:
        return mean(r[key] for r in rows[name])

    sync_compute = mean(r["step_seconds"] - r["write_seconds"] for r in rows["sync"])
    results = {"drafter_step_ratio": avg("on", "step_seconds") / avg("off", "step_seconds"),
               "overlap_ratio": avg("on", "step_seconds") / sync_compute,
               "write_seconds": avg("sync", "write_seconds"),
               **{f"{s}_ratio": avg("on", f"{s}_seconds") / avg("off", f"{s}_seconds") for s in STAGES},
               "steps": args.steps, "rounds": args.rounds}
    print(key_values(results, digits=3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
