"""Multi-turn episodes: per-episode training against episode-tree replay on the same episodes,
and episodes that wait for each other at every turn against episodes that run concurrently.

    .venv/bin/python bench/agentic.py [--steps 2] [--tasks environment,tool,concurrency] [--prompts 8]
                                      [--rounds 2] [--out runs/agentic] [key=value ...]

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

The concurrency task: the tool task's trees stage (--prompts prompts) with a calculator that
sleeps a random 0-200 ms per call (as a tool behind a network would), the HF engine, twice
per round in alternating order after a warm-up round (the stage's rollout seconds, less
its loading of the model): rollout.turn_barrier=true (every
episode waits at each turn for the group's slowest reply and call) and false (each goes on as
soon as its own call returns). Printed: each mode's rollout seconds per round, and the HF
engine's prefill positions per episode: what it read (prompt once, then each turn's new
tokens, each episode's KV kept between turns) against what re-reading each turn's history
would (the turn-by-turn sampler before); then concurrency_speedup (barrier over concurrent,
each mode's fastest round) and the positions.

Run it alone: the ratios are of wall times measured one after another.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path
from statistics import mean

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e import give_rollouts, per_step, train, train_seconds  # noqa: E402
from side_by_side import alternating, key_values  # noqa: E402
from tool_calls import rollout_stage  # noqa: E402

from lsreplay.data import agentic  # noqa: E402

TASKS = {"environment": str(REPO / "configs/agentic.yaml"), "tool": str(REPO / "configs/agentic-tool.yaml"),
         "concurrency": str(REPO / "configs/agentic-tool.yaml")}
EPISODE_FIGURES = ("episodes/turns_mean", "episodes/tool_calls_mean", "episodes/tool_error_share",
                   "episodes/environment_token_share")
MAX_SLEEP = 0.2  # seconds a call of the concurrency task's calculator sleeps at most


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, after a wait of 0-200 ms (a tool behind a network).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 5"
    """
    time.sleep(random.Random(expression).uniform(0, MAX_SLEEP))  # the same wait for the same call in both modes
    return agentic.calculator(expression)


def concurrency(prompts: int, rounds: int, common: list[str]) -> dict:
    """The concurrency task (see the module): its table printed, its figures returned."""
    common = [*common, f"rollout.tools=[{Path(__file__).resolve()}:calculator]", "rollout.engine=hf"]
    modes = {"barrier": "rollout.turn_barrier=true", "concurrent": "rollout.turn_barrier=false"}
    manifests: dict[str, list[dict]] = {mode: [] for mode in modes}

    def stage(mode: str):
        return lambda: manifests[mode].append(rollout_stage(TASKS["concurrency"], prompts, [*common, modes[mode]])[0])

    alternating({mode: stage(mode) for mode in modes}, rounds, torch.device("cpu"))
    # The rollouts' wall time (decoding, tools), not the stage's loading of the model: each round's but the warm-up's.
    seconds = {mode: [m["decode_seconds"] for m in manifests[mode][1:]] for mode in modes}
    print("\nconcurrency: | mode | rollout s per round | episodes | prefill positions / episode | "
          "re-read positions / episode | tool calls / episode |")
    figures = {}
    for mode, manifest in ((m, manifests[m][-1]) for m in modes):
        episodes = manifest["rollouts"]
        prefill, reread = (manifest[f"episodes/{k}"] / episodes for k in ("prefill_positions", "history_positions"))
        print(f"concurrency: | {mode} | {' '.join(f'{x:.2f}' for x in seconds[mode])} | {episodes} | {prefill:.1f} | "
              f"{reread:.1f} | {manifest['episodes/tool_calls_mean']:.2f} |")
        figures[f"concurrency_{mode}_rollout_s"] = min(seconds[mode])
        figures.update(prefill_positions_per_episode=prefill, reread_positions_per_episode=reread)
    figures["concurrency_speedup"] = min(seconds["barrier"]) / min(seconds["concurrent"])
    return figures


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
        **{f"{task}_{k.removeprefix('episodes/')}": mean(per_step(a, k)) for k in EPISODE_FIGURES},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--prompts", type=int, default=8, help="the concurrency task's prompts (8 episodes each)")
    parser.add_argument("--rounds", type=int, default=2, help="the concurrency task's rounds per mode")
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
        if task == "concurrency":
            results.update(concurrency(args.prompts, args.rounds, args.overrides))
        else:
            results.update(compare(task, out / task, [f"steps={args.steps}", *args.overrides]))
    print(key_values(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
