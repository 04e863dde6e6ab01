"""End to end: the per-rollout baseline, lsreplay in full, and replay on the baseline's own
rollouts, N RL steps each of one config, run one after another in one invocation.

    .venv/bin/python bench/e2e.py [--config configs/default.yaml] [--steps 3] [--rounds 1] [--flow-rounds 2]
                                  [--out runs/e2e] [key=value ...]

    A  baseline   replay.mode=naive (every rollout's full sequence forward and backward),
                  plain decoding, no drafter
    B  lsreplay   the config as it is: branch replay, the adaptive speculative rollout
                  engine, the spot-trained drafter
    C  replay     replay.mode=replay on A's stored prompts and rollouts, tree for tree,
                  its checkpoints written in the policy stage (checkpoint.background=false)

Each is a real `lsreplay train` flow run (Prefect, the store, checkpoints) in a fresh run
directory under --out. Wall times come from the stage manifests: step_seconds is the RL
step proper, prompts to policy update (B's drafter trains alongside the next step's
rollouts; the last step's drafter trains after the run's last update and is reported on
its own line, not in the step times). C must retrace A's loss curve (replay is exact):

    max_loss_gap = max over steps |loss_A - loss_C| / max over steps |loss_A|

With one update per step on fresh rollouts, GRPO's loss is evaluated at ratio 1, so it
depends on the rewards only; what the backward computed shows in the gradient's norm:

    max_grad_norm_gap = max over steps |grad_norm_A - grad_norm_C| / grad_norm_A

The last line is key=value pairs: step_speedup (A over B, mean step_seconds),
train_speedup (prefix cache + policy update), rollout_speedup (the trees stage),
max_loss_gap, max_grad_norm_gap, positions_ratio (A's trained positions over B's), and on
the same trees, A's: same_trees_train_speedup (the per-rollout caching pass + update over
replay's, less each policy stage's state_seconds: a run on A's trees, whose steps have no
rollouts between them, writes its checkpoints there, where A's rollouts hide A's background
writes), measured side by side in flow runs: --flow-rounds rounds, the first A's and C's own
runs, each further one a fresh flow of each mode on A's rollouts, the order reversed every
round, each mode's fastest round; same_trees_stage_speedup (A's over C's, the state kept in)
next to same_trees_ideal_ratio (the positions a per-rollout backward computes over those
replay computes: the speedup if time were proportional to positions); then, unless
--rounds 0, same_trees_backward_speedup (the backward alone on those trees, both modes
side by side in this process: free of the noise between flow runs minutes apart) next to
same_trees_flop_ideal (their FLOPs ratio). `lsreplay report` of the three runs
(overlaid curves; C's wall time is its caching pass and update only) goes to --out/report.
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

import torch  # noqa: E402

from lsreplay import cli  # noqa: E402
from lsreplay.algos import loss_and_weights  # noqa: E402
from lsreplay.commands.report import read_metrics, write_report  # noqa: E402
from lsreplay.core.run import Run, open_run_config  # noqa: E402
from lsreplay.replay.backward import naive_backward, replay_backward  # noqa: E402
from lsreplay.stages.common import load_trees, trains_nothing  # noqa: E402
from lsreplay.stages.objectives import objective  # noqa: E402
from lsreplay.state.resident import policy_model, policy_train_state  # noqa: E402
from replay import forward_flops  # noqa: E402
from side_by_side import alternating, key_values  # noqa: E402

PLAIN_DECODING = ["rollout.spec_threshold=0", "drafter.enabled=false"]
# A run on A's trees has no rollouts between its steps: a checkpoint written in the
# background would share the cores with the next step's backward, where A's rollouts hide
# A's writes. So it writes each in its policy stage, in the state seconds that
# same_trees_train_speedup leaves out.
ON_A_TREES = [*PLAIN_DECODING, "checkpoint.background=false"]
RUNS = {
    "A-baseline": ["replay.mode=naive", *PLAIN_DECODING],
    "B-lsreplay": [],
    "C-replay-on-A": ["replay.mode=replay", *ON_A_TREES],
}
# What C takes over from A, step by step: the sampled prompts and the rollout trees.
ROLLOUT_FILES = ("prompts.json", "prompts.done.json", "trees.done.json", "trees")


def train(config: str | None, run_dir: Path, overrides: list[str]) -> list[dict]:
    """One `lsreplay train` flow run in `run_dir` (the schema defaults without `config`); its metrics."""
    if cli.main(["train", *([config] if config else []), f"run_dir={run_dir}", *overrides]) != 0:
        raise SystemExit(f"the run in {run_dir} failed")
    return read_metrics(run_dir)


def give_rollouts(source: Path, target: Path, steps: int) -> None:
    """Copy A's prompts and trees (and their done markers) into C's run, so C's flow finds
    those stages finished and trains on exactly A's rollouts."""
    for step in range(steps):
        folder = f"step_{step:04d}"
        (target / folder).mkdir(parents=True, exist_ok=True)
        for name in ROLLOUT_FILES:
            src, dst = source / folder / name, target / folder / name
            if src.is_dir():
                shutil.copytree(src, dst)
            else:
                shutil.copy(src, dst)
        for marker in (source / folder).glob("trees-shard*.done.json"):
            shutil.copy(marker, target / folder / marker.name)
        for marker in (target / folder).glob("*.done.json"):  # A's stage times are not C's
            done = json.loads(marker.read_text())
            marker.write_text(json.dumps({k: v for k, v in done.items() if k not in ("started", "ended")}))


def per_step(rows: list[dict], key: str) -> list[float]:
    return [r.get(key, 0.0) for r in rows]


def train_seconds(rows: list[dict], state: bool = True) -> float:
    """Mean per step of what training costs beyond the rollouts: the caching pass and the
    update; without `state`, less the policy stage's state handling (loading the held state,
    snapshotting a checkpoint and waiting for the previous one's background write)."""
    return mean(r["prefixes_seconds"] + r["policy_seconds"] - (0 if state else r.get("policy_state_seconds", 0.0))
                for r in rows)


def per_round(seconds: dict[str, list[float]]) -> str:
    """Each mode's seconds round by round, for the bench's log: "naive 1.0, 1.1; replay 0.2, 0.3"."""
    return "; ".join(f"{mode} {', '.join(f'{x:.1f}' for x in s)}" for mode, s in seconds.items())


def same_trees_flows(config: str, out: Path, common: list[str], a: list[dict], c: list[dict],
                     rounds: int) -> dict[str, list[float]]:
    """Seconds a step of training (caching pass and update, state left out) in flow runs on
    A's trees, per-rollout ("naive") and replay, over `rounds` alternating rounds: the first
    is A's and C's own runs (A ran first), each further one a fresh run of each mode on A's
    rollouts (C's settings but for the mode), the order reversed every round. Their run
    directories are removed once read (3 GB each, of checkpoints)."""
    seconds = {"naive": [train_seconds(a, state=False)], "replay": [train_seconds(c, state=False)]}
    for round_ in range(1, rounds):
        for mode in list(seconds) if round_ % 2 == 0 else list(seconds)[::-1]:
            run_dir = out / f"same-trees-{mode}-{round_}"
            give_rollouts(out / "A-baseline", run_dir, len(a))
            seconds[mode].append(train_seconds(train(config, run_dir, [*common, f"replay.mode={mode}", *ON_A_TREES]),
                                               state=False))
            shutil.rmtree(run_dir)
    print(f"same trees, caching pass + update a step in flow runs, {rounds} rounds alternating (s): "
          + per_round(seconds))
    return seconds


def backwards_side_by_side(run_dir: Path, steps: int, rounds: int) -> dict:
    """The update's backward alone on C's trees (A's), per-rollout and replay, side by side
    in this process (side_by_side.alternating: the order reversed every round, after a
    warm-up round), so that the machine's noise between the flow runs, which ran minutes
    apart, does not enter the ratio: each mode's seconds over all steps that train
    something, the minimum over `rounds`. Next to it the ratio of their FLOPs
    (bench/replay.py's forward_flops: unlike the positions it charges every position its
    attention over those before it, and every completion token its LM head)."""
    run = Run(open_run_config(str(run_dir))).with_pinned_threads()
    cfg = run.cfg
    torch.set_num_threads(cfg.threads)
    train = policy_train_state(cfg, policy_model(cfg, "cpu"))
    batches, flops = [], {"naive": 0.0, "replay": 0.0}
    for step in range(steps):
        records, trees = load_trees(run, step)
        goal = objective(run, step, records, trees, run.manifest(step, "prefixes"))
        weights = loss_and_weights(goal.loss_for(goal.orders[0][0]), goal.old)[1]
        carry = [i for i, record in enumerate(records) if not trains_nothing(cfg, record)]
        if carry:
            batches.append((trees, weights, goal.heads))
        for mode in flops:
            flops[mode] += sum(forward_flops(train.model.config, trees[i], mode == "replay") for i in carry)
    budget = cfg.replay.budget_mb * 2**20 or None
    backwards = {
        "naive": lambda trees, weights, heads: naive_backward(train.model, trees, weights, heads=heads),
        "replay": lambda trees, weights, heads: replay_backward(train.model, trees, weights, budget_bytes=budget,
                                                                join_below=cfg.replay.join_below, heads=heads),
    }

    def every_step(backward):
        def run():
            for batch in batches:
                backward(*batch)
                train.zero_grad()
        return run

    seconds = alternating({mode: every_step(fn) for mode, fn in backwards.items()}, rounds, torch.device("cpu"))
    best = {mode: min(s) for mode, s in seconds.items()}
    print(f"same trees, backward alone, {rounds} rounds alternating (s): "
          + per_round(seconds))
    return {"same_trees_backward_speedup": best["naive"] / best["replay"],
            "same_trees_flop_ideal": flops["naive"] / flops["replay"]}


def table(runs: dict[str, list[dict]]) -> list[str]:
    cols = [("step_seconds", "step s", ".1f"), ("trees_seconds", "rollouts s", ".1f"),
            ("prefixes_seconds", "prefix cache s", ".1f"), ("policy_seconds", "policy s", ".1f"),
            ("policy_state_seconds", "of which state s", ".1f"),
            ("positions", "train positions", "d"), ("reward_mean", "reward", ".3f"), ("loss", "loss", ".6g")]
    lines = ["| run | step | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for name, rows in runs.items():
        for r in rows:
            # C's prompts and rollouts are A's (copied): its step and rollout times are not its own.
            cells = ["-" if name.startswith("C") and k in ("step_seconds", "trees_seconds") else format(r.get(k, 0), f)
                     for k, _, f in cols]
            lines.append(f"| {name} | {r['step']} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs/default.yaml"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "runs/e2e"))
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of the backward side by side on C's trees (0: none)")
    parser.add_argument("--flow-rounds", type=int, default=2,
                        help="rounds of flow runs on A's trees, per-rollout and replay alternately "
                             "(the first is A's and C's own)")
    parser.add_argument("overrides", nargs="*", help="key=value applied to all three runs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    common = [f"steps={args.steps}", *args.overrides]
    metrics = {}
    for name, overrides in RUNS.items():
        if name.startswith("C"):
            give_rollouts(out / "A-baseline", out / name, args.steps)
        metrics[name] = train(args.config, out / name, [*common, *overrides])
    a, b, c = metrics.values()
    print("\n".join(table(metrics)))
    drafter = json.loads((out / "B-lsreplay" / f"step_{args.steps - 1:04d}" / "drafter.done.json").read_text())
    print(f"B's last drafter (after the last update, not in step times): {drafter['seconds']:.1f} s, "
          f"{drafter['steps_done']} steps")
    write_report([out / name for name in metrics], out / "report")
    scale = max(abs(x) for x in per_step(a, "loss")) or 1.0
    same_trees = same_trees_flows(args.config, out, common, a, c, args.flow_rounds)
    results = {
        "step_speedup": mean(per_step(a, "step_seconds")) / mean(per_step(b, "step_seconds")),
        "train_speedup": train_seconds(a) / train_seconds(b),
        "rollout_speedup": mean(per_step(a, "trees_seconds")) / mean(per_step(b, "trees_seconds")),
        "max_loss_gap": max(abs(x - y) for x, y in zip(per_step(a, "loss"), per_step(c, "loss"))) / scale,
        "max_grad_norm_gap": max(abs(x - y) / x for x, y in zip(per_step(a, "grad_norm"), per_step(c, "grad_norm")) if x),
        "positions_ratio": sum(per_step(a, "positions")) / sum(per_step(b, "positions")),
        # On the same trees (A's, which C trains on): what replay saves against what it could,
        # compared on compute (the state left out), each mode's fastest of the alternating flows.
        "same_trees_train_speedup": min(same_trees["naive"]) / min(same_trees["replay"]),
        "same_trees_stage_speedup": train_seconds(a) / train_seconds(c),
        "same_trees_ideal_ratio": sum(per_step(c, "per_rollout_positions")) / sum(per_step(c, "positions")),
        "steps": args.steps,
    }
    if args.rounds:
        results.update(backwards_side_by_side(out / "C-replay-on-A", args.steps, args.rounds))
    print(key_values(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
