"""Rollout engines side by side in one invocation: lsreplay's HF tree sampler against vLLM.

    .venv/bin/python bench/engines.py [--steps 3] [--drafter-steps 80] [--out runs/engines]

1. The step, per engine and workload: real `lsreplay train` flow runs of configs/default.yaml
   (the default workload: 4 prompts x 8 rollouts as a [4, 2] tree behind the ~620-token
   context, <= 48 tokens; and a flat one: 2 prompts x 8, <= 128 tokens), the drafter off so
   that both engines decode plainly. Per run, over the steps after the first (the first
   holds the engine's start-up): rollout tokens/s, rollout stage seconds, step seconds, and
   the step less its policy stage (rollouts, the weights' update, the caching pass: what the
   engine changes; the update's time follows how many of each engine's trees carry a
   gradient) and the trained positions; then the vllm / hf ratios, the step's also with both
   engines given the same update time (the mean policy stage over both runs' steps:
   `same_update_step_speedup`).
2. The tail, vLLM with and without a drafter the run trained: one more run (HF engine, one
   step) trains its drafter --drafter-steps steps after the update; then vLLM decodes
   held-out prompts of the same source, 1, 2 and 4 at a time (the long tail: at most
   rollout.spec_threshold sequences), greedy and at temperature 1, with the policy's hf/
   folder alone and with that drafter as its EAGLE speculator (3 draft tokens): tokens/s,
   and vLLM's acceptance length (tokens per sequence per verify step).
3. The weights' update: the default config's policy (SmolLM2-135M in float32) loaded into a
   vLLM engine --syncs times, a little changed each time, as after a step: seconds per
   update, and the host memory each process added at the update's peak (its peak resident
   set, reset before each update, over its resident set before; the shared buffer the
   weights go through counts in both, and stays from the first update on). Then the same
   with LoRA (rank 16 on every projection): the engine keeps its base, and each update sends
   the adapters alone (a PEFT folder in shared memory). `--only sync` runs this part alone
   (two minutes).
4. The idle engine: a CPU engine's CPU time while it waits after a call, as during the
   caching pass and the update (`--only idle`, half a minute).
5. The engine's start, --starts times each way (`--only start`, a minute): with a fresh
   fork server (a first engine, and what every start cost before engines were forked:
   vLLM's imports in a new process) and forked from the running one (a retry's engine, the
   first with a drafter): seconds from the start to the first answer (a 32-token reply),
   and their ratio.

Run it alone: the machine's other work weighs on the engines unequally.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e import train  # noqa: E402  (a real `lsreplay train` flow run)
from lsreplay.core.config import load_config  # noqa: E402
from lsreplay.data.prompt_sets import source_prompts  # noqa: E402
from lsreplay.data.rendering import render_prompt  # noqa: E402
from lsreplay.models.loading import load_tokenizer, resolve_model_dir  # noqa: E402
from lsreplay.rollout.vllm_engine import VLLMEngine, engine_spec  # noqa: E402
from lsreplay.rollout.vllm_process import close_fork_servers  # noqa: E402

CONFIG = str(REPO / "configs/default.yaml")
WORKLOADS = {
    "default": [],
    "flat": ["data.prompts_per_step=2", "rollout.branching=[8]", "rollout.segment_tokens=[]",
             "rollout.max_new_tokens=128"],
}
ENGINES = {"hf": ["rollout.engine=hf"], "vllm": ["rollout.engine=vllm"]}
DRAFT_TOKENS = 3


def step_figures(rows: list[dict]) -> dict:
    warm = rows[1:] or rows
    return {"tokens_per_s": sum(r["completion_tokens"] for r in warm) / sum(r["trees_seconds"] for r in warm),
            "trees_s": mean(r["trees_seconds"] for r in warm), "step_s": mean(r["step_seconds"] for r in warm),
            # What the engine changes: the step less its policy stage, whose time follows how
            # many trees carry a gradient, which differs between the engines' samples.
            "engine_side_s": mean(r["step_seconds"] - r["policy_seconds"] for r in warm),
            "update_s": [r["policy_seconds"] for r in warm], "positions": mean(r["positions"] for r in warm),
            "first_trees_s": rows[0]["trees_seconds"]}


def compare_steps(out: Path, steps: int) -> None:
    print("| workload | engine | rollout tok/s | rollouts s | step s | step less update s | trained positions | "
          "first step's rollouts s (engine start) |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = {}
    for workload, shape in WORKLOADS.items():
        figures = {}
        for engine, choice in ENGINES.items():
            rows = train(CONFIG, out / f"{workload}-{engine}",
                         [f"steps={steps}", "drafter.enabled=false", *shape, *choice])
            figures[engine] = f = step_figures(rows)
            print(f"| {workload} | {engine} | {f['tokens_per_s']:.1f} | {f['trees_s']:.1f} | {f['step_s']:.1f} | "
                  f"{f['engine_side_s']:.1f} | {f['positions']:.0f} | "
                  f"{f['first_trees_s']:.1f} |", flush=True)
        hf, vllm = figures["hf"], figures["vllm"]
        # The update's time follows the rewards each engine's samples drew (a tree whose leaves
        # all score alike trains nothing), not the engine: both given the same, the mean over
        # both runs' steps.
        update = mean(hf["update_s"] + vllm["update_s"])
        ratios[workload] = {"rollout_tokens_per_s": vllm["tokens_per_s"] / hf["tokens_per_s"],
                            "rollout_seconds": hf["trees_s"] / vllm["trees_s"],
                            "step_seconds": hf["step_s"] / vllm["step_s"],
                            "engine_side_seconds": hf["engine_side_s"] / vllm["engine_side_s"],
                            "same_update_step_seconds": (hf["engine_side_s"] + update) / (vllm["engine_side_s"] + update)}
    for workload, r in ratios.items():
        print(f"{workload}: vllm/hf rollout_tokens_per_s={r['rollout_tokens_per_s']:.3f} "
              f"rollout_speedup={r['rollout_seconds']:.3f} step_speedup={r['step_seconds']:.3f} "
              f"step_less_update_speedup={r['engine_side_seconds']:.3f} "
              f"same_update_step_speedup={r['same_update_step_seconds']:.3f}")


def held_out(cfg, count: int) -> list[list[int]]:
    """Prompts of the run's source past the ones a short run samples, rendered as the run renders them."""
    tokenizer, prompts = load_tokenizer(cfg.model), source_prompts(cfg)
    return [render_prompt(tokenizer, prompts[len(prompts) - 1 - i], cfg.data)
            for i in range(count)]


def tail(engine: VLLMEngine, prompts: list[list[int]], batch: int, temperature: float, eos: list[int]) -> dict:
    before, tokens, start = engine.spec_counters(), 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        out, _ = engine.generate(prompts[i:i + batch], 128, eos, temperature=temperature)
        tokens += sum(map(len, out))
    seconds, after = time.perf_counter() - start, engine.spec_counters()
    drafts = after.get("drafts", 0) - before.get("drafts", 0)
    accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
    return {"tokens_per_s": tokens / seconds, "accept_len": 1 + accepted / drafts if drafts else 1.0}


def compare_tail(out: Path, drafter_steps: int) -> None:
    run_dir = out / "drafter-run"
    train(CONFIG, run_dir, ["steps=1", f"drafter.steps={drafter_steps}"])
    cfg = load_config(CONFIG, [f"run_dir={run_dir}"])
    policy, drafter = run_dir / "checkpoints/policy/step_0000/hf", run_dir / "checkpoints/drafter/step_0000/hf"
    cfg.model.path = str(policy)
    prompts, eos = held_out(cfg, 8), [load_tokenizer(cfg.model).eos_token_id]
    print(f"\ntail: {len(prompts)} held-out prompts of {mean(map(len, prompts)):.0f} tokens, <= 128 new tokens")
    print("| batch | temperature | vLLM tok/s | with drafter tok/s | speedup | acceptance length |")
    print("|---|---|---|---|---|---|")
    import torch

    engines = {name: VLLMEngine(engine_spec(cfg, torch.device("cpu"), str(resolve_model_dir(cfg.model)), 0, folder))
               for name, folder in (("plain", None), ("drafter", str(drafter)))}
    try:
        for engine in engines.values():  # first calls pay for lazy set-up: not timed
            engine.generate(prompts[:4], 16, eos)
        for temperature in (0.0, 1.0):
            for batch in (1, 2, 4):
                plain, drafted = (tail(engines[n], prompts, batch, temperature, eos) for n in ("plain", "drafter"))
                print(f"| {batch} | {temperature:g} | {plain['tokens_per_s']:.1f} | {drafted['tokens_per_s']:.1f} | "
                      f"{drafted['tokens_per_s'] / plain['tokens_per_s']:.3f} | {drafted['accept_len']:.2f} |",
                      flush=True)
    finally:
        for engine in engines.values():
            engine.close()


def resident_mib(pid: int | str, field: str) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M)[1]) / 1024


def reset_peak(pid: int | str) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak resident set (VmHWM) starts again from now


def compare_sync(syncs: int, lora: bool) -> None:
    """The weights' update --syncs times: full weights, or with LoRA (rank 16 on every
    projection) the adapters alone, the engine keeping its base."""
    import torch

    from lsreplay.models.loading import load_model
    from lsreplay.models.lora import add_adapters, is_adapter

    cfg = load_config(CONFIG, ["model.lora.enabled=true"] if lora else [])
    model = load_model(cfg.model, device="cpu")
    if lora:
        add_adapters(model, cfg.model.lora, cfg.seed)
    sent = [p for n, p in model.named_parameters() if is_adapter(n) or not lora]
    engine = VLLMEngine(engine_spec(cfg, torch.device("cpu"), str(resolve_model_dir(cfg.model)), 0, None))
    size = sum(p.numel() * p.element_size() for p in sent) / 2**20
    what = f"LoRA rank {cfg.model.lora.rank} adapters" if lora else "full weights"
    print(f"\nweights' update, {what}: {cfg.model.path or 'SmolLM2-135M-Instruct'} in {cfg.model.dtype}, "
          f"{size:.1f} MiB sent")
    print("| update | seconds | trainer's peak + MiB | engine's peak + MiB |")
    print("|---|---|---|---|")
    rows = []
    try:
        for i in range(syncs):
            with torch.no_grad():
                for p in sent:
                    p.add_(1e-4 * (i + 1))
            before = {pid: resident_mib(pid, "VmRSS") for pid in ("self", engine.pid)}
            for pid in before:
                reset_peak(pid)
            seconds = engine.load_adapters(model, cfg.model) if lora else engine.load_policy(model)
            peaks = {pid: resident_mib(pid, "VmHWM") - rss for pid, rss in before.items()}
            rows.append((seconds, peaks["self"], peaks[engine.pid]))
            print(f"| {i} | {seconds:.2f} | {peaks['self']:.0f} | {peaks[engine.pid]:.0f} |", flush=True)
    finally:
        engine.close()
    warm = rows[1:] or rows
    print(f"sync ({what}): {mean(r[0] for r in warm):.3f} s per update after the first ({rows[0][0]:.2f} s), peak + "
          f"{max(r[1] for r in warm):.0f} MiB trainer / {max(r[2] for r in warm):.0f} MiB engine after the first "
          f"(first: {rows[0][1]:.0f} / {rows[0][2]:.0f} MiB), for {size:.1f} MiB sent")


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) every thread of process `pid` has used."""
    ticks = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def idle_engine(seconds: float) -> None:
    """What a CPU engine takes from the trainer while it waits (the caching pass and the
    update): its CPU time over `seconds` right after a call, and again 5 s later."""
    import torch

    cfg = load_config(CONFIG, [])
    engine = VLLMEngine(engine_spec(cfg, torch.device("cpu"), str(resolve_model_dir(cfg.model)), 0, None))
    try:
        engine.generate(held_out(cfg, 4), 32, [2])
        for wait in (0.0, 5.0):
            time.sleep(wait)
            before = cpu_seconds(engine.pid)
            time.sleep(seconds)
            used = cpu_seconds(engine.pid) - before
            print(f"idle engine, {wait:.0f} s after its last call: {used:.2f} CPU s in {seconds:.0f} s "
                  f"({used / seconds:.1%} of one core)")
    finally:
        engine.close()


def compare_starts(starts: int) -> None:
    """Seconds from an engine's start to its first answer, with a fresh fork server and
    forked from the running one, `starts` times each (alternating)."""
    import torch

    cfg = load_config(CONFIG, [])
    spec, prompts = engine_spec(cfg, torch.device("cpu"), str(resolve_model_dir(cfg.model)), 0, None), held_out(cfg, 1)
    seconds: dict[str, list[float]] = {"fresh": [], "forked": []}
    for _ in range(starts):
        for way in seconds:
            if way == "fresh":
                close_fork_servers()
            started = time.perf_counter()
            engine = VLLMEngine(spec)
            engine.generate(prompts, 32, [2])
            seconds[way].append(time.perf_counter() - started)
            engine.close()
    fresh, forked = mean(seconds["fresh"]), mean(seconds["forked"])
    print(f"engine start to first answer: fresh fork server {fresh:.2f} s, forked {forked:.2f} s "
          f"({' '.join(f'{s:.2f}' for s in seconds['fresh'])} / {' '.join(f'{s:.2f}' for s in seconds['forked'])}); "
          f"forked_start_speedup={fresh / forked:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--drafter-steps", type=int, default=80)
    parser.add_argument("--out", default=str(REPO / "runs/engines"))
    parser.add_argument("--syncs", type=int, default=6)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--only", choices=("steps", "tail", "sync", "idle", "start"), help="run this part alone")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    if args.only in (None, "steps"):
        compare_steps(out, args.steps)
    if args.only in (None, "tail"):
        compare_tail(out, args.drafter_steps)
    if args.only in (None, "sync"):
        compare_sync(args.syncs, lora=False)
        compare_sync(args.syncs, lora=True)
    if args.only in (None, "idle"):
        idle_engine(10.0)
    if args.only in (None, "start"):
        compare_starts(args.starts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
