"""Does the policy learn? Held-out accuracy of SmolLM2-135M-Instruct before and after GRPO,
branch replay next to the per-rollout baseline, on the same prompts; and PPO with a critic,
online DPO and LoRA adapters from the same start.

    .venv/bin/python bench/learn.py [--config configs/learn.yaml] [--out runs/learn]
                                    [--runs replay,baseline] [--plot docs/learn_curves.png]
                                    [--threads N] [--smoke] [key=value ...]

Real `lsreplay train` flow runs of one config, one after another, in fresh run directories
under --out (same seed, so the same prompts each step and the same held-out set), those
--runs names (default replay,baseline; replay,ppo,dpo compares the algorithms, replay,lora
LoRA with full training):

    replay    the config as it is: GRPO through branch replay
    baseline  replay.mode=naive: every rollout's full sequence forward and backward, as a
              per-rollout GRPO trainer does
    ppo       PPO with a critic (a value head on the policy's trunk), GAE advantages, 2
              epochs of 2 minibatches a step (docs/algorithms.md)
    dpo       online DPO: each tree's best leaf against its worst, the base model as reference
    lora      GRPO through replay training LoRA adapters (rank 16, every projection) on the
              frozen base, at 10x the config's learning rate (adapters start at zero and
              move a low-rank slice of the weights: the usual LoRA practice)

Each evaluates its policy after 0, eval.every, ..., steps updates on the held-out prompts
(lsreplay.stages.evaluate). The accuracy this bench reports is the sampled one: the share
of eval.samples answers per prompt at the rollout temperature that are correct (pass@1,
what GRPO optimises), with its 95% interval over prompts; the greedy accuracy (Wilson
interval) is printed next to it. Wall time to an accuracy is the training time until that
policy existed: from step 0's first stage to the last update before it (evaluation time
left out; both runs evaluate alike).

Printed: each run's evaluations; a line `replay_step_s= replay_activation_peak_mib=
replay_state_mib= ...` per run (its mean step time, the measured peak of the backward's saved
activations, and `lsreplay plan`'s model state: weights, gradients, masters, AdamW); with ppo,
dpo or lora, a line `replay_acc_start= replay_acc_end= ppo_acc_start= ... lora_acc_end=`
(sampled accuracy before and after each run's updates, their 95% intervals in the table above
it); with replay and baseline, on the replay run, how many
held-out prompts' greedy answers went from wrong to right and back between the first and the
last evaluation, with McNemar's exact p-value, and the greedy figures; then the last line
`acc_start= acc_end= baseline_acc_end= wall_ratio=` (sampled accuracy; wall_ratio: the
baseline's wall time to its final accuracy over replay's). `lsreplay report` of the runs
goes to --out/report; --plot also writes the held-out curves alone to that PNG.
--smoke: a few prompts and one step, for the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lsreplay import cli  # noqa: E402
from lsreplay.commands.report import curves, plot, read_metrics, write_report  # noqa: E402

RUNS = {"replay": ["replay.mode=replay"], "baseline": ["replay.mode=naive"],
        "ppo": ["algo.name=ppo", "algo.critic=true", "algo.advantage=gae", "algo.epochs=2", "algo.minibatches=2"],
        "dpo": ["algo.name=dpo"],
        "lora": ["replay.mode=replay", "model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32"]}
# The lora run's learning rate over the config's.
LORA_LR_FACTOR = 10
SMOKE = ["steps=1", "eval.every=1", "eval.size=4", "eval.samples=1", "data.size=16", "data.prompts_per_step=2",
         "rollout.branching=[2]", "rollout.max_new_tokens=4", "drafter.steps=2"]


def train(config: str, run_dir: Path, overrides: list[str]) -> list[dict]:
    if cli.main(["train", config, f"run_dir={run_dir}", *overrides]) != 0:
        raise SystemExit(f"the run in {run_dir} failed")
    return read_metrics(run_dir)


def done(run_dir: Path, step: int, stage: str) -> dict:
    return json.loads((run_dir / f"step_{step:04d}" / f"{stage}.done.json").read_text())


def wall_to(run_dir: Path, updates: int) -> float:
    """Training wall time until the policy after `updates` updates existed (0 for the base model)."""
    if updates == 0:
        return 0.0
    return done(run_dir, updates - 1, "policy")["ended"] - done(run_dir, 0, "prompts")["started"]


def evaluations(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "eval_accuracy" in r]


def greedy_correct(run_dir: Path, updates: int) -> dict[int, bool]:
    answers = json.loads((run_dir / f"step_{updates:04d}" / "eval.json").read_text())["answers"]
    return {a["prompt_index"]: a["greedy_reward"] >= 1 for a in answers}


def mcnemar(improved: int, worsened: int) -> float:
    """Two-sided exact McNemar p-value: of the prompts that changed, as many turn either way?"""
    n = improved + worsened
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(improved, worsened) + 1)) / 2**n
    return min(1.0, 2 * tail)


def interval(row: dict, key: str) -> str:
    return f"{row[key]:.3f} [{row[key + '_lo']:.3f}, {row[key + '_hi']:.3f}]"


def table(name: str, run_dir: Path, rows: list[dict]) -> list[str]:
    return [f"{name:9s} after {r['step']:3d} updates  held-out accuracy sampled {interval(r, 'eval_sample_accuracy')}"
            f"  greedy {interval(r, 'eval_accuracy')}  train wall {wall_to(run_dir, r['step']):7.1f} s"
            for r in evaluations(rows)]


def run_overrides(config: str, common: list[str], name: str) -> list[str]:
    """A run's overrides: the common ones, its own, and for lora the scaled learning rate."""
    if name != "lora":
        return [*common, *RUNS[name]]
    from lsreplay.core.config import load_config

    lr = load_config(config, common).optim.lr * LORA_LR_FACTOR
    return [*common, *RUNS[name], f"optim.lr={lr:g}"]


def costs(config: str, common: list[str], metrics: dict[str, list[dict]]) -> str:
    """Per run, key=value: mean step seconds, the measured peak of the backward's saved
    activations (MiB) and the model state `lsreplay plan` counts for its config (MiB)."""
    from lsreplay.planning.plan import load_plan_config, make_plan

    out = []
    for name, rows in metrics.items():
        steps = [r for r in rows if "step_time" in r]
        state = make_plan(*load_plan_config(config, run_overrides(config, common, name))).state.total
        out += [f"{name}_step_s={sum(r['step_time'] for r in steps) / max(len(steps), 1):.2f}",
                f"{name}_activation_peak_mib={max((r.get('peak_activation_bytes', 0) for r in steps), default=0) / 2**20:.1f}",
                f"{name}_state_mib={state / 2**20:.1f}"]
    return " ".join(out)


def algorithms(metrics: dict[str, list[dict]]) -> str:
    """Each run's sampled held-out accuracy before and after its updates, key=value."""
    return " ".join(f"{name}_acc_{when}={evaluations(rows)[i]['eval_sample_accuracy']:.3f}"
                    for name, rows in metrics.items() for when, i in (("start", 0), ("end", -1)))


def summary(out: Path, metrics: dict[str, list[dict]]) -> list[str]:
    """The paired greedy comparison and the greedy figures, then the key=value headline."""
    replay, baseline = evaluations(metrics["replay"]), evaluations(metrics["baseline"])
    first, last = replay[0], replay[-1]
    before, after = greedy_correct(out / "replay", first["step"]), greedy_correct(out / "replay", last["step"])
    improved = sum(after[i] and not before[i] for i in before)
    worsened = sum(before[i] and not after[i] for i in before)
    replay_wall, baseline_wall = wall_to(out / "replay", last["step"]), wall_to(out / "baseline", baseline[-1]["step"])
    paired = (f"replay, greedy answers between {first['step']} and {last['step']} updates: {improved} held-out "
              f"prompts wrong -> right, {worsened} right -> wrong (McNemar p={mcnemar(improved, worsened):.2g}); "
              f"greedy_acc_start={first['eval_accuracy']:.3f} greedy_acc_end={last['eval_accuracy']:.3f} "
              f"baseline_greedy_acc_end={baseline[-1]['eval_accuracy']:.3f} "
              f"acc_start_hi={first['eval_sample_accuracy_hi']:.3f} acc_end_lo={last['eval_sample_accuracy_lo']:.3f} "
              f"replay_wall_s={replay_wall:.1f} baseline_wall_s={baseline_wall:.1f}")
    headline = (f"acc_start={first['eval_sample_accuracy']:.3f} acc_end={last['eval_sample_accuracy']:.3f} "
                f"baseline_acc_end={baseline[-1]['eval_sample_accuracy']:.3f} "
                f"wall_ratio={baseline_wall / max(replay_wall, 1e-9):.3f}")
    return [paired, headline]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs/learn.yaml"))
    parser.add_argument("--out", default=str(REPO / "runs/learn"))
    parser.add_argument("--runs", default="replay,baseline", help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--plot", help="also write the held-out curves of the runs to this PNG")
    parser.add_argument("--smoke", action="store_true", help="one step on a few prompts (the test suite)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, one per core)")
    parser.add_argument("overrides", nargs="*", help="key=value applied to both runs")
    args = parser.parse_args(argv)
    runs = args.runs.split(",")
    if unknown := [r for r in runs if r not in RUNS]:
        parser.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    common = (SMOKE if args.smoke else []) + args.overrides
    metrics = {name: train(args.config, out / name, run_overrides(args.config, common, name)) for name in runs}
    for name, rows in metrics.items():
        print("\n".join(table(name, out / name, rows)))
    print(costs(args.config, common, metrics))
    write_report([out / name for name in metrics], out / "report")
    if args.plot:
        plot(curves(metrics), Path(args.plot), keys=("eval_sample_accuracy", "eval_accuracy"))

    if {"ppo", "dpo", "lora"} & set(runs):
        print(algorithms(metrics))
    if {"replay", "baseline"} <= set(runs):
        print("\n".join(summary(out, metrics)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
