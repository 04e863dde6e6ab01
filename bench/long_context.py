"""Long prompts on one device: branch replay against the per-rollout backward as the shared
prompt grows, time and memory.

    .venv/bin/python bench/long_context.py            # 2k, 8k, 32k side by side; 64k, 128k replay alone
    .venv/bin/python bench/long_context.py --smoke    # the same at tiny lengths (under a minute)
    .venv/bin/python bench/long_context.py --flow 32768   # one `lsreplay train` step at a 32k prompt

One tree per prompt length: a random prompt of P tokens and G=8 leaves of 256 tokens (distinct
first tokens: the trie branches at the prompt's end), random per-token weights, a tiny random
Llama with positions for the longest prompt (4 layers, hidden 256, GQA 4/2, float32, on the
CPU). Per length, `replay_backward` and (up to --side-by-side's longest) `naive_backward`,
timed in alternating order (bench/side_by_side.py; a warm-up round at the first length only:
the longer runs take minutes), each with its own ActivationMeter (saved-for-backward bytes
and held K/V: deterministic, unlike the process's memory). On two CPU cores expect hours, most
of them the attention of the 32k per-rollout backward and of the 128k replay; run it alone.

Replay's budget (replay.budget_mb) at each length is what the prompt holds run layer by layer
(memory.layer_by_layer_bytes: its layer inputs, K/V and their gradient) plus --budget-mb for
the rest: a micro-batch of leaves, a layer's recompute over a chunk of the prompt. Checked at
every length: replay's peak stays within twice what the prompt's layer inputs and K/V take
(per position: every layer's input, and its keys and values) plus --budget-mb, and at or below
the per-rollout backward's peak where that ran.

Printed per length: seconds of each, their ratio next to the positions ratio G(P+S)/(P+G*S),
each peak, and replay's peak per prompt position next to what the layer inputs and K/V take
per position. The last line is key=value pairs: per length P, time_ratio_P, positions_ratio_P,
replay_peak_mib_P, naive_peak_mib_P, replay_bytes_per_position_P; then within_bound and
below_naive (true where every length passed).

--flow P runs a whole flow instead: one step of `lsreplay train` (configs/default.yaml's
SmolLM2-135M-Instruct, float32) on the long-context task at a P-token prompt, its rotary
positions stretched by YaRN to reach P plus the answers; 4 answers of up to 32 tokens
(branching [2,2]); every stage runs, the drafter's one step included. A 135M model rarely finds
the needle that far out, and a group whose answers all score 0 trains nothing, so the answers
are scored by tests/varied_rewards.py's character-code parity: the step's backward replays the
prompt. Printed: each stage's seconds and the step's memory from its metrics.jsonl record
(peak_activation_bytes: replay's saved activations and held K/V; kv_bytes_peak: the rollouts'
K/V) and the run's peak resident memory; the last line key=value pairs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import alternating, key_values  # noqa: E402
from synthetic import random_weights  # noqa: E402

from lsreplay.core.config import completion_tokens, load_config  # noqa: E402
from lsreplay.models.distribution import RAW  # noqa: E402
from lsreplay.models.loading import hf_config, reachable_positions  # noqa: E402
from lsreplay.replay import ActivationMeter, naive_backward, replay_backward  # noqa: E402
from lsreplay.replay.heads import logprob_heads  # noqa: E402
from lsreplay.replay.memory import ModelDims, kv_bytes_per_position, layer_by_layer_bytes  # noqa: E402
from lsreplay.tree import RolloutTree  # noqa: E402

MiB = 2**20
HEADS = logprob_heads(RAW)  # the token logprob of the policy's own distribution
MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
SMOKE_MODEL = dict(vocab_size=128, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)


def tiny_llama(dims: dict, positions: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**dims, max_position_embeddings=positions, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()  # eval: replay differentiates exactly the forward it runs


def long_tree(prompt: int, leaves: int, suffix: int, vocab: int, seed: int = 0) -> RolloutTree:
    rng = random.Random(seed)
    firsts = rng.sample(range(vocab), leaves)
    return RolloutTree.from_sequences([rng.randrange(vocab) for _ in range(prompt)],
                                      [[f] + [rng.randrange(vocab) for _ in range(suffix - 1)] for f in firsts])


def kept_per_position(dims: ModelDims, elt: int) -> int:
    """What a prompt run layer by layer must keep per position: every layer's input, its K/V."""
    return dims.layers * dims.hidden * elt + kv_bytes_per_position(dims, elt)


def replay_budget(dims: ModelDims, elt: int, prompt: int, extra_mb: int) -> int:
    """What the prompt holds run layer by layer, its K/V's gradient, and `extra_mb` for the rest."""
    return layer_by_layer_bytes(dims, elt, prompt) + kv_bytes_per_position(dims, elt) * prompt + extra_mb * MiB


def measure(model, prompt: int, args, side_by_side: bool, warm_up: bool) -> dict:
    dims, elt = ModelDims.from_hf(model.config), 4
    tree = long_tree(prompt, args.leaves, args.suffix, dims.vocab)
    weights = random_weights(tree, seed=1)
    budget = replay_budget(dims, elt, prompt, args.budget_mb)
    stats = {}

    def run(name, fn):
        model.zero_grad(set_to_none=True)
        stats[name] = fn()

    runs = {"replay": lambda: run("replay", lambda: replay_backward(model, [tree], weights, budget_bytes=budget,
                                                                    meter=ActivationMeter(model), heads=HEADS))}
    if side_by_side:
        runs["naive"] = lambda: run("naive", lambda: naive_backward(model, [tree], weights,
                                                                    meter=ActivationMeter(model), heads=HEADS))
    seconds = alternating(runs, args.rounds, torch.device("cpu"), warm_up)
    replay = stats["replay"]
    out = {"prompt": prompt, "budget": budget, "replay_s": min(seconds["replay"]),
           "positions_ratio": tree.total_positions / tree.unique_positions,
           "replay_peak": replay.peak_activation_bytes, "layer_by_layer": replay.layer_by_layer_positions,
           "per_position": replay.peak_activation_bytes / prompt, "kept_per_position": kept_per_position(dims, elt)}
    out["within_bound"] = replay.peak_activation_bytes <= 2 * prompt * out["kept_per_position"] + args.budget_mb * MiB
    if side_by_side:
        out |= {"naive_s": min(seconds["naive"]), "naive_peak": stats["naive"].peak_activation_bytes}
        out["time_ratio"] = out["naive_s"] / out["replay_s"]
        out["below_naive"] = replay.peak_activation_bytes <= out["naive_peak"]
    return out


def report(r: dict) -> None:
    line = (f"prompt {r['prompt']:>6}: replay {r['replay_s']:8.2f} s, peak {r['replay_peak'] / MiB:8.1f} MiB "
            f"(budget {r['budget'] / MiB:.1f}; {r['per_position']:.0f} B per prompt position, the layer inputs and "
            f"K/V {r['kept_per_position']} B; {r['layer_by_layer']} positions layer by layer)")
    if "naive_s" in r:
        line += (f"; per-rollout {r['naive_s']:8.2f} s, peak {r['naive_peak'] / MiB:8.1f} MiB; time ratio "
                 f"{r['time_ratio']:.2f} (positions ratio {r['positions_ratio']:.2f})")
    print(line, flush=True)


def flow_step(prompt: int, run_dir: Path, extra_mb: int) -> int:
    """One `lsreplay train` step at a `prompt`-token kv_retrieval prompt; its record printed."""
    root = Path(__file__).resolve().parents[1]
    config = root / "configs/default.yaml"
    overrides = [f"run_dir={run_dir}", "steps=1", "data.tasks=[kv_retrieval]", "data.size=2", "data.prompts_per_step=1",
                 f"data.max_prompt_tokens={prompt}", "rollout.branching=[2,2]", "rollout.max_new_tokens=32",
                 "drafter.steps=1", f"reward.functions=[{root / 'tests/varied_rewards.py'}:code_parity]"]
    cfg = load_config(config, overrides)
    model = hf_config(cfg.model)
    # The YaRN factor the run's preflight asks for (models.loading.check_positions), and the budget
    # of the prompt run layer by layer.
    factor = math.ceil((prompt + completion_tokens(cfg.rollout)) / reachable_positions(model))
    budget_mb = math.ceil(replay_budget(ModelDims.from_hf(model), 4, prompt, extra_mb) / MiB)
    overrides += [f"model.rope_scaling={{rope_type: yarn, factor: {factor}}}", f"replay.budget_mb={budget_mb}"]
    command = [str(Path(sys.executable).parent / "lsreplay"), "train", str(config), *overrides]
    print(" ".join(command), flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume of the last one
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=root)
    seconds = time.perf_counter() - started
    [record] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stages = {k: v for k, v in record.items() if k.endswith("_seconds") and isinstance(v, (int, float))}
    print("stages: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    fields = {"prompt_tokens": prompt, "yarn_factor": factor, "budget_mib": budget_mb, "run_s": seconds, "step_s": record["step_seconds"],
              "positions": record["positions"], "per_rollout_positions": record["per_rollout_positions"],
              "peak_activation_mib": record["peak_activation_bytes"] / MiB,
              "kv_peak_mib": record["kv_bytes_peak"] / MiB,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
              "grad_norm": record["grad_norm"]}
    print(key_values(fields))
    return 0 if record["grad_norm"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and lengths (under a minute)")
    ap.add_argument("--side-by-side", type=int, nargs="+", default=[2048, 8192, 32768],
                    help="prompt lengths run both ways")
    ap.add_argument("--replay-only", type=int, nargs="*", default=[65536, 131072], help="prompt lengths replay alone")
    ap.add_argument("--leaves", type=int, default=8)
    ap.add_argument("--suffix", type=int, default=256, help="tokens per leaf")
    ap.add_argument("--budget-mb", type=int, default=64,
                    help="replay's budget beyond what the prompt holds run layer by layer")
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds at each length")
    ap.add_argument("--flow", type=int, metavar="TOKENS",
                    help="instead: one `lsreplay train` step of SmolLM2 on kv_retrieval at this prompt length")
    ap.add_argument("--run-dir", type=Path, default=Path("runs/bench-long-context"), help="--flow's run folder")
    args = ap.parse_args(argv)
    if args.flow:
        return flow_step(args.flow, args.run_dir.resolve(), args.budget_mb)
    if args.smoke:
        args.side_by_side, args.replay_only, args.suffix, args.budget_mb = [128, 256], [512], 16, 1
        torch.set_num_threads(1)
    lengths = [(p, True) for p in args.side_by_side] + [(p, False) for p in args.replay_only]
    model = tiny_llama(SMOKE_MODEL if args.smoke else MODEL, max(p for p, _ in lengths) + args.suffix + 64)
    print(f"tiny Llama {MODEL if not args.smoke else SMOKE_MODEL}, float32, {torch.get_num_threads()} threads; "
          f"one tree of {args.leaves} leaves x {args.suffix} tokens per prompt length", flush=True)
    results = []
    for prompt, both in lengths:
        results.append(measure(model, prompt, args, both, warm_up=not results))
        report(results[-1])
    fields = {}
    for r in results:
        p = r["prompt"]
        if "time_ratio" in r:
            fields[f"time_ratio_{p}"] = r["time_ratio"]
        fields[f"positions_ratio_{p}"] = r["positions_ratio"]
        fields[f"replay_peak_mib_{p}"] = r["replay_peak"] / MiB
        if "naive_peak" in r:
            fields[f"naive_peak_mib_{p}"] = r["naive_peak"] / MiB
        fields[f"replay_bytes_per_position_{p}"] = r["per_position"]
    fields["within_bound"] = str(all(r["within_bound"] for r in results)).lower()
    fields["below_naive"] = str(all(r.get("below_naive", True) for r in results)).lower()
    print(key_values(fields))
    return 0 if fields["within_bound"] == fields["below_naive"] == "true" else 1


if __name__ == "__main__":
    sys.exit(main())
