"""Asynchronous rollouts: synchronous steps against rollout.max_staleness = 1 and 2, side by side.

    .venv/bin/python bench/async.py [--staleness 0,1,2] [--steps 6] [--rounds 1] [--learn-steps 8]
                                    [--out runs/async] [--plot docs/async_curves.png] [--no-default]
                                    [--smoke] [key=value ...]

Real `lsreplay train` flow runs, one per staleness K of --staleness (0 = synchronous steps), in
fresh run directories under --out, in two parts:

1. Speed, on configs/default.yaml over --steps steps. The pool has two slots, the rollouts
   sample on one (pool.rollout_devices=[1]), the caching pass, the update, the evaluation and
   the drafter run on the other, and every stage computes with one thread (threads=1): on a
   2-core machine each slot has a core of its own, as each slot would have its own GPU in a
   pool, and the synchronous run has the same layout (its rollouts and its update take turns).
   Per run: wall time per step, over the run (first stage's start to last update's end, over
   the steps) and in the steady state (between consecutive updates' ends, after the first K +
   1 steps, which fill the pipeline); each slot's busy share (the union of the rollout shards'
   spans, and of the caching passes' and updates' spans, over the run's span); the mean
   reward; and per staleness k of the trees an update trained on, the mean |log p_proximal -
   log p_behaviour| of their tokens (the logprob gap: how far the policy moved in k updates,
   since the HF engine's behaviour logprobs are the sampler's own) with truncated and masked
   importance sampling's figures (docs/async.md). Beside them, unless --no-default, the
   default config's own synchronous layout (sync2t: one slot, every stage with both
   threads). --rounds R runs each R times, the order reversed every round, and reports each
   one's fastest round.
2. Learning, on configs/learn.yaml (--learn-steps steps, 0 = skip): the held-out accuracy of
   each K's policy every eval.every updates (sampled pass@1 with its 95% interval over
   prompts, greedy beside it) and the training reward per step: does staleness cost
   accuracy at this scale? The same pool layout.

The last line is key=value pairs, per speed run (k{K}, sync2t): _step_s (steady-state wall
time per step), _run_step_s (over the whole run), _rollout_busy and _update_busy; per K:
k{K}_speedup (k0's steady-state step time over it: the same layout), k{K}_speedup_vs_default
(sync2t's over it), k{K}_gap (the logprob gap of trees K updates stale), and with the
learning part k{K}_acc_end, k{K}_acc_end_lo, k{K}_acc_end_hi. --plot
writes the held-out curves of part 2 to that PNG; `lsreplay report` of every run goes to
--out/report. --smoke: a few prompts and short answers, for the test suite.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from learn import done, train  # noqa: E402

from lsreplay.commands.report import curves, plot, write_report  # noqa: E402

# Two slots of one core each: the rollouts on slot 1, every other stage on slot 0.
LAYOUT = ["pool.slots=2", "pool.rollout_devices=[1]", "threads=1"]
SMOKE = ["data.size=24", "data.prompts_per_step=2", "rollout.branching=[2,2]", "rollout.segment_tokens=[2]",
         "rollout.max_new_tokens=6", "drafter.steps=2", "eval.size=4", "eval.samples=1", "eval.every=1"]


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds the union of `spans` covers."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def timing(run_dir: Path, steps: int, fill: int, shards: int) -> dict:
    """Wall time per step (over the run, and between the updates after the first `fill`)
    and each slot's busy share, from the stages' manifests."""
    updates = [done(run_dir, s, "policy")["ended"] for s in range(steps)]
    start = min(done(run_dir, s, "prompts")["started"] for s in range(steps))
    spans = {"rollout": [done(run_dir, s, f"trees-shard{k}") for s in range(steps) for k in range(shards)],
             "update": [done(run_dir, s, stage) for s in range(steps) for stage in ("prefixes", "policy")]}
    span, steady = updates[-1] - start, updates[fill:]
    return {"run_step_s": span / steps,
            "step_s": (steady[-1] - steady[0]) / (len(steady) - 1) if len(steady) > 1 else span / steps,
            **{f"{slot}_busy": covered([(m["started"], m["ended"]) for m in ms]) / span for slot, ms in spans.items()}}


def off_policy(rows: list[dict]) -> dict[int, dict[str, float]]:
    """Per staleness k: each off_policy/staleness{k}/ figure's mean over the steps that have it."""
    out: dict[int, dict[str, list[float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("off_policy/staleness"):
                k, name = key.removeprefix("off_policy/staleness").split("/")
                out.setdefault(int(k), {}).setdefault(name, []).append(value)
    return {k: {name: sum(vs) / len(vs) for name, vs in figures.items()} for k, figures in out.items()}


def variants(ks: list[int], default: bool) -> dict[str, list[str]]:
    """The speed runs by name: k{K}, each K in the split pool; with `default`, sync2t, the
    default config's own synchronous layout (one slot, every stage with both threads)."""
    runs = {f"k{k}": [*LAYOUT, f"rollout.max_staleness={k}"] for k in ks}
    return {**runs, "sync2t": ["threads=2"]} if default else runs


def speed(out: Path, runs: dict[str, list[str]], fill: int, rounds: int, steps: int,
          common: list[str]) -> dict[str, dict]:
    """Part 1: each run's fastest round, with its metrics rows; the steady state is measured
    over the same updates for every run, those after the longest pipeline's `fill`."""
    config, best = str(REPO / "configs/default.yaml"), {}
    from lsreplay.core.config import load_config

    shards = load_config(config, common).rollout.shards
    for round_ in range(rounds):
        for name in list(runs) if round_ % 2 == 0 else list(runs)[::-1]:
            run_dir = out / f"speed-{name}-round{round_}"
            rows = train(config, run_dir, [*runs[name], f"steps={steps}", *common])
            figures = {**timing(run_dir, steps, min(fill, steps - 2), shards), "rows": rows, "run_dir": run_dir}
            if name not in best or figures["step_s"] < best[name]["step_s"]:
                best[name] = figures
    return best


def speed_table(best: dict[str, dict]) -> list[str]:
    lines = ["run     step s (steady)  step s (run)  rollout busy  update busy  reward   gap per staleness k "
             "(|log p_prox - log p_behav|; TIS mean weight, capped share; MIS masked share)"]
    for name, f in best.items():
        rewards = [r["reward_mean"] for r in f["rows"] if "reward_mean" in r]
        gaps = "  ".join(f"k={s}: {g['logprob_gap']:.4f} ({g['tis_weight_mean']:.3f}, {g['tis_capped_fraction']:.3f}; "
                         f"{g['mis_masked_fraction']:.3f})" for s, g in sorted(off_policy(f["rows"]).items()))
        lines.append(f"{name:6s}  {f['step_s']:15.1f}  {f['run_step_s']:12.1f}  {f['rollout_busy']:12.2f}  "
                     f"{f['update_busy']:11.2f}  {sum(rewards) / max(len(rewards), 1):.3f}   {gaps or '-'}")
    return lines


def learning(out: Path, ks: list[int], steps: int, common: list[str]) -> dict[int, list[dict]]:
    """Part 2: each K's metrics on configs/learn.yaml."""
    config = str(REPO / "configs/learn.yaml")
    return {k: train(config, out / f"learn-k{k}", [*LAYOUT, f"steps={steps}", f"rollout.max_staleness={k}", *common])
            for k in ks}


def interval(row: dict, key: str) -> str:
    return f"{row[key]:.3f} [{row[key + '_lo']:.3f}, {row[key + '_hi']:.3f}]"


def learning_table(metrics: dict[int, list[dict]]) -> list[str]:
    lines = []
    for k, rows in metrics.items():
        lines += [f"K={k} after {r['step']:3d} updates  held-out accuracy sampled {interval(r, 'eval_sample_accuracy')}"
                  f"  greedy {interval(r, 'eval_accuracy')}" for r in rows if "eval_sample_accuracy" in r]
        lines.append(f"K={k} training reward per step: "
                     + " ".join(f"{r['reward_mean']:.3f}" for r in rows if "reward_mean" in r))
    return lines


def headline(best: dict[str, dict], learned: dict[int, list[dict]]) -> str:
    fields = {}
    for name, f in best.items():
        fields.update({f"{name}_step_s": f["step_s"], f"{name}_run_step_s": f["run_step_s"],
                       f"{name}_rollout_busy": f["rollout_busy"], f"{name}_update_busy": f["update_busy"]})
        for base, suffix in (("k0", "speedup"), ("sync2t", "speedup_vs_default")):
            if base in best and name.startswith("k"):
                fields[f"{name}_{suffix}"] = best[base]["step_s"] / f["step_s"]
        if name.startswith("k") and (gap := off_policy(f["rows"]).get(int(name[1:]))) is not None:
            fields[f"{name}_gap"] = gap["logprob_gap"]
    for k, rows in learned.items():
        last = [r for r in rows if "eval_sample_accuracy" in r][-1]
        fields.update({f"k{k}_acc_end{end}": last[f"eval_sample_accuracy{end}"] for end in ("", "_lo", "_hi")})
    return " ".join(f"{key}={value:.4g}" for key, value in fields.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--staleness", default="0,1,2", help="comma-separated rollout.max_staleness values")
    parser.add_argument("--steps", type=int, default=6, help="RL steps of each speed run (configs/default.yaml)")
    parser.add_argument("--rounds", type=int, default=1, help="speed runs of each staleness, order reversed per round")
    parser.add_argument("--learn-steps", type=int, default=8, help="RL steps of each learning run (0 = none)")
    parser.add_argument("--out", default=str(REPO / "runs/async"))
    parser.add_argument("--plot", help="also write the held-out curves of the learning runs to this PNG")
    parser.add_argument("--no-default", action="store_true", help="leave out the default config's own layout (sync2t)")
    parser.add_argument("--smoke", action="store_true", help="tiny runs (the test suite)")
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.staleness.split(",")]
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    common = (SMOKE if args.smoke else []) + args.overrides
    best = speed(out, variants(ks, not args.no_default), max(ks), args.rounds, args.steps,
                 [o for o in common if not o.startswith("eval.")])
    print("\n".join(speed_table(best)))
    learned = learning(out, ks, args.learn_steps, common) if args.learn_steps else {}
    if learned:
        print("\n".join(learning_table(learned)))
        if args.plot:
            plot(curves({f"K={k}": rows for k, rows in learned.items()}), Path(args.plot),
                 keys=("eval_sample_accuracy", "eval_accuracy", "reward_mean"))
    write_report([f["run_dir"] for f in best.values()] + [out / f"learn-k{k}" for k in learned], out / "report")
    print(headline(best, learned))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
