"""Branch replay vs the per-rollout backward at Qwen2.5 scale, on one accelerator.

    .venv/bin/python bench/gpu_scale.py [--models 1.5b,7b] [--budget-s 450]
    .venv/bin/python bench/gpu_scale.py --smoke          # tiny shape on CPU, < 1 minute

Qwen2.5-shaped models with random init (Qwen2Config: 1.5B and 7B dims), bfloat16, sdpa,
gradients in bfloat16 (no optimizer: this measures the backward). Per model:

1. throughput: one G=16 tree (a long shared prompt P, 16 completions of S tokens); the
   per-rollout `naive_backward` and `replay_backward` given the K/V of the caching pass
   (`capture_tree`, timed separately: the pipeline runs it anyway for old logprobs), after
   a warm-up. Token positions/s counted per rollout (G x (P + S): what is trained) and as
   computed. speedup = naive s / replay s; ideal = G(P+S) / (P+GS).
2. largest tree: grow P (doubling, then bisecting) until the backward runs out of device
   memory (torch.cuda.OutOfMemoryError, caught) -- replay on the G=16 tree, naive on one
   rollout of it (the naive backward runs rollouts one by one, so one rollout is its peak).
   Reported as the G=16 tree's per-rollout positions at the largest P that trained.
   Replay's leaf micro-batches follow replay.budget_mb (--replay-budget-mb; 0 = the
   library's default, one root-to-leaf path's worth by its own estimate; 1 = one leaf per
   micro-batch).

Next to each measured device peak it prints the planner's estimate (lsreplay.plan: weights
+ bf16 grads + saved activations + workspace) and their ratio. Everything fits a time
budget (--budget-s, default 450 s: one H200 in 8 minutes with start-up); a search that runs
out of time reports the largest size that trained so far and says so.

The last line is key=value: per model `<key>_<model>` (speedup, ideal, replay_tok_s,
naive_tok_s, max_positions_replay, max_positions_naive, max_ratio, ...) and wall_s.
With --smoke, "out of memory" is simulated by a cap on ActivationMeter's peak (CPU has
no OOM to catch).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from lsreplay.plan import ModelDims, TreeShape, naive_peak, replay_peak, workspace_bytes  # noqa: E402
from lsreplay.replay.backward import naive_backward, replay_backward  # noqa: E402
from lsreplay.replay.capture import capture_tree  # noqa: E402
from lsreplay.replay.memory import ActivationMeter  # noqa: E402
from lsreplay.tree import RolloutTree  # noqa: E402

GiB = 2**30
QWEN = {
    # Qwen2.5-1.5B and -7B dimensions (config.json of the released models)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "smoke": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
}


@dataclass
class Setting:
    G: int
    prompt: int  # throughput tree
    suffix: int
    start_prompt: int  # largest-tree search
    max_prompt: int
    cap_bytes: int | None = None  # simulated OOM (smoke)
    budget_bytes: int | None = None  # replay's leaf micro-batch budget (None: the library default)


SETTINGS = {
    "1.5b": Setting(G=16, prompt=8192, suffix=512, start_prompt=8192, max_prompt=131072),
    "7b": Setting(G=16, prompt=4096, suffix=256, start_prompt=4096, max_prompt=65536),
    "smoke": Setting(G=4, prompt=48, suffix=6, start_prompt=32, max_prompt=1024, cap_bytes=2**20),
}


def make_model(name: str, device: torch.device, dtype: torch.dtype, max_positions: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN[name], max_position_embeddings=max_positions, rope_theta=1e6,
                         attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise directly in bf16 on the device: no fp32 copy
    try:
        with device:
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()  # eval: replay differentiates exactly the cached pass


def make_tree(G: int, prompt: int, suffix: int, vocab: int, seed: int) -> RolloutTree:
    rng = random.Random(seed)
    firsts = rng.sample(range(vocab), G)
    completions = [[f] + [rng.randrange(vocab) for _ in range(suffix - 1)] for f in firsts]
    return RolloutTree.from_sequences([rng.randrange(vocab) for _ in range(prompt)], completions)


def weights_for(tree: RolloutTree, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(len(c), generator=g, dtype=torch.float64) / 1000 for c in tree.completions]]


def size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def free(model) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def planned_device_bytes(dims: ModelDims, dtype: torch.dtype, run) -> int:
    """What the planner expects the allocator to peak at here: weights + bf16 grads (no
    optimizer in this benchmark) + the run's held K/V and saved activations + workspace."""
    elt = torch.tensor([], dtype=dtype).element_size()
    return 2 * dims.params() * elt + run.total + workspace_bytes(dims, elt, run)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


# -- 1. throughput ----------------------------------------------------------------------------
def throughput(model, dims: ModelDims, s: Setting, device, dtype) -> dict:
    tree = make_tree(s.G, s.prompt, s.suffix, dims.vocab, seed=1)
    trees, weights = [tree], weights_for(tree, 1)
    warm = make_tree(2, 64, 8, dims.vocab, seed=2)  # first-call costs off the clock
    replay_backward(model, [warm], weights_for(warm, 2))
    naive_backward(model, [warm], weights_for(warm, 2))
    free(model)

    sync(device)
    t = time.perf_counter()
    acts = [capture_tree(model, tree, keep_hidden=False)]
    sync(device)
    cache_s = time.perf_counter() - t
    prefix_kv = lambda i, node: acts[i].prefix_kv.get(node.id)  # noqa: E731

    reset_peak(device)
    sync(device)
    t = time.perf_counter()
    replay = replay_backward(model, trees, weights, prefix_kv=prefix_kv, meter=ActivationMeter(model),
                             budget_bytes=s.budget_bytes)
    sync(device)
    replay_s = time.perf_counter() - t
    replay_dev = replay.device_peak_bytes
    free(model)
    acts = None  # the cached prefix K/V: free it before the naive run

    reset_peak(device)
    sync(device)
    t = time.perf_counter()
    naive = naive_backward(model, trees, weights, meter=ActivationMeter(model))
    sync(device)
    naive_s = time.perf_counter() - t
    naive_dev = naive.device_peak_bytes
    free(model)

    shape = TreeShape(s.prompt, ((s.G, s.suffix),))
    plan_replay = planned_device_bytes(dims, dtype, replay_peak(dims, dtype, shape, s.budget_bytes))
    plan_naive = planned_device_bytes(dims, dtype, naive_peak(dims, torch.tensor([], dtype=dtype).element_size(), shape))
    per_rollout = tree.total_positions
    out = dict(
        tree=f"G={s.G} P={s.prompt} S={s.suffix}", per_rollout_positions=per_rollout,
        replay_positions=replay.positions, ideal=per_rollout / tree.unique_positions,
        naive_s=naive_s, replay_s=replay_s, cache_s=cache_s, speedup=naive_s / replay_s,
        naive_tok_s=per_rollout / naive_s, replay_tok_s=per_rollout / replay_s,
        replay_cache_tok_s=per_rollout / (replay_s + cache_s),
        replay_computed_tok_s=replay.positions / replay_s,
        replay_meter=replay.peak_activation_bytes, naive_meter=naive.peak_activation_bytes,
    )
    if replay_dev is not None:
        out |= dict(replay_dev_gib=replay_dev / GiB, naive_dev_gib=naive_dev / GiB,
                    replay_plan_ratio=replay_dev / plan_replay, naive_plan_ratio=naive_dev / plan_naive)
    return out


# -- 2. the largest tree ----------------------------------------------------------------------
def trains(model, dims: ModelDims, s: Setting, mode: str, prompt: int, dtype) -> tuple[bool, int | None]:
    """Does one backward at this prompt length fit? (measured peak or None)"""
    G = s.G if mode == "replay" else 1  # naive: one rollout is its whole peak
    tree = make_tree(G, prompt, s.suffix, dims.vocab, seed=prompt)
    weights = weights_for(tree, prompt)
    device = next(model.parameters()).device
    reset_peak(device)
    ok, peak = True, None
    try:
        meter = ActivationMeter(model)
        if mode == "replay":
            stats = replay_backward(model, [tree], weights, meter=meter, budget_bytes=s.budget_bytes)
        else:
            stats = naive_backward(model, [tree], weights, meter=meter)
        sync(device)
        peak = stats.device_peak_bytes or stats.peak_activation_bytes
        if s.cap_bytes is not None and stats.peak_activation_bytes > s.cap_bytes:
            ok = False  # simulated out-of-memory (smoke)
    except torch.cuda.OutOfMemoryError:
        ok = False
    except RuntimeError as e:  # some kernels (cuBLAS workspace, sdpa) report OOM as a plain RuntimeError
        if "out of memory" not in str(e).lower():
            raise
        ok = False
    free(model)  # outside the except block: the exception's frames are gone
    return ok, peak


def largest(model, dims: ModelDims, s: Setting, mode: str, dtype, budget: Budget, share: float) -> dict:
    """Double P from start_prompt until a backward fails, then bisect (to 1/8 of the last
    step) while time allows."""
    deadline = time.perf_counter() + share
    good, bad, peak_at_good, probes = None, None, None, []
    prompt = s.start_prompt
    while prompt <= s.max_prompt and time.perf_counter() < deadline and budget.left() > 0:
        ok, peak = trains(model, dims, s, mode, prompt, dtype)
        probes.append(f"{prompt}:{'ok' if ok else 'oom'}")
        if not ok:
            bad = prompt
            break
        good, peak_at_good = prompt, peak
        prompt *= 2
    if good is None and bad is not None:  # even the start failed: halve down
        prompt = bad // 2
        while prompt >= 16 and time.perf_counter() < deadline and budget.left() > 0:
            ok, peak = trains(model, dims, s, mode, prompt, dtype)
            probes.append(f"{prompt}:{'ok' if ok else 'oom'}")
            if ok:
                good, peak_at_good = prompt, peak
                break
            bad, prompt = prompt, prompt // 2
    if good is not None and bad is not None:
        resolution = max((bad - good) // 8, 1)
        while bad - good > resolution and time.perf_counter() < deadline and budget.left() > 0:
            mid = (good + bad) // 2
            ok, peak = trains(model, dims, s, mode, mid, dtype)
            probes.append(f"{mid}:{'ok' if ok else 'oom'}")
            if ok:
                good, peak_at_good = mid, peak
            else:
                bad = mid
    prompt = good or 0
    return dict(prompt=prompt, positions=s.G * (prompt + s.suffix) if good else 0,
                unique=(prompt + s.G * s.suffix) if good else 0,
                peak=peak_at_good or 0, bounded=bad is not None, probes=" ".join(probes))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1.5b,7b", help="comma-separated: 1.5b, 7b")
    ap.add_argument("--smoke", action="store_true", help="a tiny Qwen2 shape on CPU, well under a minute")
    ap.add_argument("--budget-s", type=float, default=450.0, help="overall time budget, seconds")
    ap.add_argument("--skip-largest", action="store_true", help="throughput only")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (smoke)")
    ap.add_argument("--replay-budget-mb", type=int, default=0,
                    help="replay's leaf micro-batch budget (replay.budget_mb); 0 = the library default")
    args = ap.parse_args(argv)

    wall = time.perf_counter()
    budget = Budget(args.budget_s)
    names = ["smoke"] if args.smoke else args.models.split(",")
    unknown = [n for n in names if n not in QWEN or n == "smoke" and not args.smoke]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from 1.5b, 7b")
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.bfloat16
        torch.set_num_threads(args.threads)
    else:
        if not torch.cuda.is_available():
            print("gpu_scale: no CUDA device; run with --smoke for the CPU check", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
        gpu = torch.cuda.get_device_properties(device)
        print(f"device: {gpu.name}, {gpu.total_memory / GiB:.1f} GiB; torch {torch.__version__}", flush=True)

    kv: dict[str, str] = {}
    for i, name in enumerate(names):
        s = SETTINGS[name]
        s.budget_bytes = args.replay_budget_mb * 2**20 or None
        t0 = time.perf_counter()
        model = make_model(name, device, dtype, max(s.max_prompt, s.prompt) + s.suffix + 64)
        dims = ModelDims.from_hf(model.config)
        print(f"\n== Qwen2.5-{name} shape: {dims.params() / 1e9:.3f}B params, {str(dtype)[6:]}, sdpa "
              f"(built in {time.perf_counter() - t0:.1f}s)", flush=True)
        r = throughput(model, dims, s, device, dtype)
        print(f"throughput  {r['tree']}: naive {r['naive_s']:.2f}s, replay {r['replay_s']:.2f}s "
              f"(+ caching pass {r['cache_s']:.2f}s); per-rollout tok/s naive {r['naive_tok_s']:.0f}, "
              f"replay {r['replay_tok_s']:.0f} ({r['replay_cache_tok_s']:.0f} with the caching pass); "
              f"speedup {r['speedup']:.2f} of ideal {r['ideal']:.2f}", flush=True)
        if "replay_dev_gib" in r:
            print(f"            device peak replay {r['replay_dev_gib']:.1f} GiB (plan ratio "
                  f"{r['replay_plan_ratio']:.2f}), naive {r['naive_dev_gib']:.1f} GiB (plan ratio "
                  f"{r['naive_plan_ratio']:.2f})", flush=True)
        print(f"            activations (meter) replay {size(r['replay_meter'])}, naive {size(r['naive_meter'])}",
              flush=True)
        kv |= {f"speedup_{name}": f"{r['speedup']:.3f}", f"ideal_{name}": f"{r['ideal']:.3f}",
               f"efficiency_{name}": f"{r['speedup'] / r['ideal']:.3f}",
               f"replay_tok_s_{name}": f"{r['replay_tok_s']:.0f}", f"naive_tok_s_{name}": f"{r['naive_tok_s']:.0f}",
               f"replay_cache_tok_s_{name}": f"{r['replay_cache_tok_s']:.0f}"}
        if "replay_plan_ratio" in r:
            kv |= {f"replay_plan_ratio_{name}": f"{r['replay_plan_ratio']:.3f}",
                   f"naive_plan_ratio_{name}": f"{r['naive_plan_ratio']:.3f}"}
        if not args.skip_largest:
            left_models = len(names) - i
            share = max(budget.left(), 0) / left_models / 2  # per mode
            res = {}
            for mode in ("replay", "naive"):
                res[mode] = m = largest(model, dims, s, mode, dtype, budget, share)
                note = "" if m["bounded"] else " (not bounded: ran out of time or reached max_prompt)"
                print(f"largest     {mode:<6} P={m['prompt']}: G={s.G} tree of {m['positions']} per-rollout "
                      f"positions ({m['unique']} unique), peak {size(m['peak'])}{note}; probes {m['probes']}",
                      flush=True)
            ratio = res["replay"]["positions"] / max(res["naive"]["positions"], 1)
            kv |= {f"max_prompt_replay_{name}": res["replay"]["prompt"],
                   f"max_prompt_naive_{name}": res["naive"]["prompt"],
                   f"max_positions_replay_{name}": res["replay"]["positions"],
                   f"max_positions_naive_{name}": res["naive"]["positions"],
                   f"max_ratio_{name}": f"{ratio:.3f}",
                   f"max_bounded_{name}": str(res["replay"]["bounded"] and res["naive"]["bounded"]).lower()}
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    kv["wall_s"] = f"{time.perf_counter() - wall:.1f}"
    print(" ".join(f"{k}={v}" for k, v in kv.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
