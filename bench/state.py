"""State handling: the code as issue #14 measured it, stages that load the model from the
store every time with a checkpoint written every step, and resident state with checkpoints
in the background, on the same workload, one after the other in one invocation.

    .venv/bin/python bench/state.py [--steps 3] [--rounds 1] [--out runs/state] [--before REV] [key=value ...]

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

--rounds N runs all of them N times, every other round in reverse order (before, reload,
resident, then resident, reload, before, ...), so that a drift of the shared machine's speed
weighs on each alike; the ratios are over all rounds' steps.

Per step, `state_seconds` is what the stages spent loading state and taking the checkpoint's
snapshot (or writing it, when not in the background), next to the policy stage's seconds.
The last line: step_ratio (before over resident, mean step_seconds: the issue's target),
reload_step_ratio (reload over resident: state handling alone), policy_ratio (reload over
resident), the resident run's state share of its policy stage, and what each run left on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e import train  # noqa: E402  (a real `lsreplay train` flow run)
from lsreplay.commands.report import read_metrics  # noqa: E402
from lsreplay.core.config import ANSWER_INSTRUCTION, SYSTEM_PROMPT  # noqa: E402
from lsreplay.data.sources import generate_prompt_file  # noqa: E402
from side_by_side import key_values  # noqa: E402

WORKLOAD = ["data.prompts_per_step=2", "rollout.branching=[8]", "rollout.segment_tokens=[]",
            "rollout.max_new_tokens=128", "model.dtype=float32", "drafter.enabled=false", "rollout.spec_threshold=0"]
# The prompts as issue #14 sent them: a data.path file gets nothing added now unless the config
# says so, so this checkout's runs ask for lsreplay's system prompt, instruction and template.
AS_GENERATED = [f"data.system_prompt={SYSTEM_PROMPT}", f"data.answer_instruction={json.dumps(ANSWER_INSTRUCTION)}",
                "data.chat_template=true"]
RUNS = {
    "reload": ["checkpoint.resident=false", "checkpoint.background=false", "checkpoint.keep_last=0",
               "checkpoint.keep_step_data=true"],
    "resident": [],
}


def extract(rev: str, out: Path) -> Path:
    """A `git archive` of commit `rev`, unpacked under `out`."""
    source = out / f"source-{rev}"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--before {rev}: {archive.stderr.decode().strip()} (a shallow clone lacks the "
                         "history: git fetch --unshallow; or --before '' to skip the run)")
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    return source


def train_before(source: Path, run_dir: Path, overrides: list[str]) -> list[dict]:
    """The same flow on the code extracted in `source`, imported ahead of this checkout's
    package; its metrics."""
    command = [sys.executable, "-m", "lsreplay.cli", "train", f"run_dir={run_dir.resolve()}",
               f"model.cache_dir={REPO / '.cache/models'}", *overrides]
    if subprocess.run(command, cwd=source, env={**os.environ, "PYTHONPATH": str(source)}).returncode != 0:
        raise SystemExit(f"the run of {source.name} in {run_dir} failed")
    return read_metrics(run_dir)


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "runs/state"))
    parser.add_argument("--before", default="4238b33", help="the commit of the `before` run ('' = none)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run them all this many times, every other round in reverse order")
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    prompts = generate_prompt_file(out / "gsm_symbolic.jsonl", ["gsm_symbolic"], size=64, seed=0)
    common = [f"steps={args.steps}", f"data.path={prompts}", *WORKLOAD, *args.overrides]
    source = extract(args.before, out) if args.before else None
    order = [*(["before"] if source else []), *RUNS]
    metrics: dict[str, list[dict]] = {name: [] for name in order}
    # Rounds in the order A B C, C B A, ...: a drift of this shared machine's speed over the
    # benchmark weighs on every run alike.
    for round_ in range(args.rounds):
        for name in order if round_ % 2 == 0 else order[::-1]:
            run_dir = out / (name if round_ == 0 else f"{name}-{round_}")
            rows = (train_before(source, run_dir, common) if name == "before"
                    else train(None, run_dir, [*common, *AS_GENERATED, *RUNS[name]]))
            metrics[name] += [{**r, "round": round_} for r in rows]
    print("| run | round | step | step s | rollouts s | prefix cache s | policy s | backward s | state s | policy state s |")
    print("|---" * 10 + "|")
    keys = ("step_seconds", "trees_seconds", "prefixes_seconds", "policy_seconds", "backward_seconds",
            "state_seconds", "policy_state_seconds")
    for name, rows in metrics.items():
        for r in rows:
            values = {**r, "backward_seconds": r["positions"] / r["train_positions_per_s"]}
            cells = [f"{values[k]:.1f}" if k in values else "-" for k in keys]  # `before` has no state figures
            print(f"| {name} | {r['round']} | {r['step']} | " + " | ".join(cells) + " |")
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
        "rounds": args.rounds,
    }
    print(key_values(results, digits=3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
