"""Multi-turn episodes: per-episode training against episode-tree replay on the same episodes.

    .venv/bin/python bench/agentic.py [--steps 2] [--tasks environment,tool] [--out runs/agentic] [key=value ...]

Two tasks the default model plays (docs/multi-turn.md), each a config:

    environment  configs/agentic.yaml: one-digit arithmetic; the environment
                 (lsreplay.data.agentic.ArithmeticFeedback) answers "Wrong, try again." for up
                 to 3 replies; episodes branch [4, 2] at turns
    tool         configs/agentic-tool.yaml: the same questions with the calculator tool
                 (lsreplay.data.agentic.calculator), taught by worked examples as earlier
                 turns; a reply that calls it, then one that answers; episodes branch [4, 2]
                 at turns, scored by reasoning-gym's checker

Per task two real `lsreplay train` flow runs, one after the other (bench/e2e.py's A and C):
A, replay.mode=naive, every episode's full sequence forward and backward (the environment's
tokens masked, as TRL's tool mask does), and C, branch replay on A's stored episodes, tree
for tree. Printed per task: each step's caching pass and update seconds (less the policy
stage's state handling) and trained positions, then the last line's key=value pairs per
task: update_speedup (A's caching pass + update over C's) next to positions_ratio (the
positions a per-episode backward computes over those replay computes: the speedup if time
were proportional to positions), max_grad_norm_gap (C retraces A: replay is exact), the
episodes' turns, tool calls and environment-token share.

Run it alone: the ratios are of wall times measured one after another.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e import give_rollouts, per_step, train, train_seconds  # noqa: E402
from side_by_side import key_values  # noqa: E402

TASKS = {"environment": str(REPO / "configs/agentic.yaml"), "tool": str(REPO / "configs/agentic-tool.yaml")}
EPISODE_FIGURES = ("episode_turns_mean", "tool_calls_mean", "tool_error_share", "environment_token_share")


def compare(task: str, out: Path, common: list[str]) -> dict:
    """A (per episode) and C (replay on A's episodes) of `task`; its figures."""
    a = train(TASKS[task], out / "A-per-episode", [*common, "replay.mode=naive"])
    give_rollouts(out / "A-per-episode", out / "C-replay-on-A", len(a))
    c = train(TASKS[task], out / "C-replay-on-A", [*common, "replay.mode=replay"])
    print(f"\n{task}: | step | per-episode s | replay s | per-episode positions | replay positions |")
    for ra, rc in zip(a, c):
        print(f"{task}: | {ra['step']} | {train_seconds([ra], state=False):.2f} | {train_seconds([rc], state=False):.2f} "
              f"| {rc['per_rollout_positions']} | {rc['positions']} |")
    return {
        f"{task}_update_speedup": train_seconds(a, state=False) / train_seconds(c, state=False),
        f"{task}_positions_ratio": sum(per_step(c, "per_rollout_positions")) / sum(per_step(c, "positions")),
        f"{task}_max_grad_norm_gap": max(abs(x - y) / x for x, y in zip(per_step(a, "grad_norm"),
                                                                       per_step(c, "grad_norm")) if x),
        **{f"{task}_{k}": mean(per_step(a, k)) for k in EPISODE_FIGURES},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--out", default=str(REPO / "runs/agentic-bench"))
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    if unknown := [t for t in tasks if t not in TASKS]:
        parser.error(f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    results = {}
    for task in tasks:
        results.update(compare(task, out / task, [f"steps={args.steps}", *args.overrides]))
    print(key_values(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
