"""State handling: stages that load the model from the store every time and a checkpoint
written every step, against resident state with checkpoints in the background, on the same
workload, one after the other in one invocation.

    .venv/bin/python bench/state.py [--steps 3] [--out runs/state] [key=value ...]

The workload (issue #14's): 2 reasoning-gym gsm_symbolic prompts per step from a JSONL
file, 8 flat rollouts of at most 128 tokens each, SmolLM2-135M-Instruct in float32, GRPO
with branch replay, no drafter. Both runs are real `lsreplay train` flows in fresh run
directories under --out:

    reload     checkpoint.resident=false checkpoint.background=false checkpoint.keep_last=0
               checkpoint.keep_step_data=true: every stage loads what it needs from the
               newest checkpoint and every step writes one and waits for it, nothing is
               deleted (the design before resident state)
    resident   the defaults: the policy, its float32 masters and AdamW stay in memory between
               stages and steps; checkpoint.every=1, written in the background, the last 2 kept

Per step, `state_seconds` is what the stages spent loading state and taking the checkpoint's
snapshot (or writing it, when not in the background), next to the policy stage's seconds.
The last line: step_ratio (reload over resident, mean step_seconds), policy_ratio, the
resident run's state share of its policy stage, and what each run left on disk.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e import train  # noqa: E402  (a real `lsreplay train` flow run)
from lsreplay.data import generate_prompt_file  # noqa: E402

WORKLOAD = ["data.prompts_per_step=2", "rollout.branching=[8]", "rollout.segment_tokens=[]",
            "rollout.max_new_tokens=128", "model.dtype=float32", "drafter.enabled=false", "rollout.spec_threshold=0"]
RUNS = {
    "reload": ["checkpoint.resident=false", "checkpoint.background=false", "checkpoint.keep_last=0",
               "checkpoint.keep_step_data=true"],
    "resident": [],
}


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "runs/state"))
    parser.add_argument("overrides", nargs="*", help="key=value applied to both runs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    prompts = generate_prompt_file(out / "gsm_symbolic.jsonl", ["gsm_symbolic"], size=64, seed=0)
    common = [f"steps={args.steps}", f"data.path={prompts}", *WORKLOAD, *args.overrides]
    metrics = {name: train(None, out / name, [*common, *overrides]) for name, overrides in RUNS.items()}
    print("| run | step | step s | rollouts s | prefix cache s | policy s | backward s | state s | policy state s |")
    print("|---" * 9 + "|")
    keys = ("step_seconds", "trees_seconds", "prefixes_seconds", "policy_seconds", "backward_seconds",
            "state_seconds", "policy_state_seconds")
    for name, rows in metrics.items():
        for r in rows:
            backward = r["positions"] / r["train_positions_per_s"]
            values = {**r, "backward_seconds": backward}
            print(f"| {name} | {r['step']} | " + " | ".join(f"{values[k]:.1f}" for k in keys) + " |")
    reload, resident = metrics["reload"], metrics["resident"]

    def avg(rows, key):
        return mean(r[key] for r in rows)

    results = {
        "step_ratio": avg(reload, "step_seconds") / avg(resident, "step_seconds"),
        "policy_ratio": avg(reload, "policy_seconds") / avg(resident, "policy_seconds"),
        "reload_state_share": avg(reload, "policy_state_seconds") / avg(reload, "policy_seconds"),
        "resident_state_share": avg(resident, "policy_state_seconds") / avg(resident, "policy_seconds"),
        "reload_disk_gb": disk_bytes(out / "reload") / 1e9,
        "resident_disk_gb": disk_bytes(out / "resident") / 1e9,
        "steps": args.steps,
    }
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
