"""Branch replay vs the per-rollout backward at Qwen2.5 scale, on one accelerator.

    .venv/bin/python bench/gpu_scale.py [--models 1.5b,7b] [--budget-s 450]
    .venv/bin/python bench/gpu_scale.py --smoke          # tiny shape on CPU, < 1 minute

Qwen2.5-shaped models with random init (Qwen2Config: 1.5B and 7B dims), bfloat16, sdpa,
gradients in bfloat16 (no optimizer: this measures the backward). Per model:

1. throughput: one G=16 tree (a long shared prompt P, 16 completions of S tokens); the
   per-rollout `naive_backward` and `replay_backward` given the K/V of the caching pass
   (`capture_tree`, timed separately: the pipeline runs it anyway for the K/V), in
   alternating order (--rounds rounds, after a warm-up round at the same shape; the fastest
   round of each counts). Token positions/s counted per rollout (G x (P + S): what is
   trained) and as computed. speedup = naive s / replay s; ideal = G(P+S) / (P+GS). Then
   one more run of each, and their gradients compared (bench/side_by_side.py:
   grad_rel = max |replay - naive| / max |naive| over all tensors, and the cosine).
2. largest tree: grow P (doubling, then bisecting) until the backward runs out of device
   memory (torch.cuda.OutOfMemoryError, caught) -- replay on the G=16 tree, naive on one
   rollout of it (the naive backward runs rollouts one by one, so one rollout is its peak).
   Reported as the G=16 tree's per-rollout positions at the largest P that trained.
   Replay's leaf micro-batches follow replay.budget_mb (--replay-budget-mb; 0 = the
   library's default, one root-to-leaf path's worth by its own estimate; 1 = one leaf per
   micro-batch).

Next to each measured device peak it prints the planner's estimate (lsreplay.planning's run and
workspace for the same tree with pool.accelerator=cuda, plus weights + bf16 grads) and their
ratio. Everything fits a time
budget (--budget-s, default 450 s: one H200 in 8 minutes with start-up); a search that runs
out of time reports the largest size that trained so far and says so.

The last line is key=value: per model `<key>_<model>` (speedup, ideal, replay_tok_s,
naive_tok_s, grad_rel, grad_cosine, max_positions_replay, max_positions_naive, max_ratio,
...) and wall_s.
With --smoke, "out of memory" is simulated by a cap on ActivationMeter's peak (CPU has
no OOM to catch).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from side_by_side import GiB, alternating, gradient_agreement, peak_measured, sync  # noqa: E402
from synthetic import qwen_model, random_weights  # noqa: E402

from lsreplay.core.config import load_config  # noqa: E402
from lsreplay.models.distribution import RAW  # noqa: E402
from lsreplay.planning.plan import make_plan, plan_values  # noqa: E402
from lsreplay.planning.shape import TreeShape  # noqa: E402
from lsreplay.planning.update import RunPeak  # noqa: E402
from lsreplay.replay.backward import naive_backward, replay_backward  # noqa: E402
from lsreplay.replay.capture import capture_tree  # noqa: E402
from lsreplay.replay.heads import logprob_heads  # noqa: E402
from lsreplay.replay.memory import ActivationMeter, ModelDims  # noqa: E402
from lsreplay.tree import RolloutTree  # noqa: E402

MODELS = ("1.5b", "7b")


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


def make_tree(G: int, prompt: int, suffix: int, vocab: int, seed: int) -> RolloutTree:
    """A G-way tree: a prompt, then G completions of `suffix` tokens."""
    return TreeShape(prompt, ((G, suffix),)).random_tree(vocab, seed)


def size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


def free(model) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def planned_device_bytes(dims: ModelDims, dtype: torch.dtype, run: RunPeak, workspace: int) -> int:
    """What the planner expects the allocator to peak at here: weights + bf16 grads (no
    optimizer in this benchmark) + the run's held K/V and saved activations + workspace."""
    elt = torch.tensor([], dtype=dtype).element_size()
    return 2 * dims.params() * elt + run.total + workspace


def plan_for(dims: ModelDims, s: Setting, device: torch.device):
    """lsreplay.planning's plan of one G-way tree of `s` on one device of this kind (the
    accelerator's attention kernels on CUDA), replay leaves batched as replay_backward
    batches them here."""
    cfg = load_config(None, ["model.dtype=bfloat16", f"data.max_prompt_tokens={s.prompt}", "data.prompts_per_step=1",
                             f"rollout.branching=[{s.G}]", "rollout.segment_tokens=[]",
                             f"rollout.max_new_tokens={s.suffix}", f"replay.budget_mb={(s.budget_bytes or 0) // 2**20}",
                             "replay.join_below=0", f"pool.accelerator={device.type}", "pool.slots=1"])
    return make_plan(cfg, plan_values(cfg), dims)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


# -- 1. throughput ----------------------------------------------------------------------------
def throughput(model, dims: ModelDims, s: Setting, device, dtype, rounds: int) -> dict:
    tree = make_tree(s.G, s.prompt, s.suffix, dims.vocab, seed=1)
    trees, weights = [tree], random_weights(tree, 1)

    sync(device)
    t = time.perf_counter()
    acts = [capture_tree(model, tree, keep_hidden=False, heads=logprob_heads(RAW))]
    sync(device)
    cache_s = time.perf_counter() - t
    prefix_kv = lambda i, node: acts[i].prefix_kv.get(node.id)  # noqa: E731
    stats, peaks = {}, {"replay": [], "naive": []}

    def replay():
        model.zero_grad(set_to_none=True)
        stats["replay"] = replay_backward(model, trees, weights, prefix_kv=prefix_kv, meter=ActivationMeter(model),
                                          budget_bytes=s.budget_bytes, heads=logprob_heads(RAW))

    def naive():
        model.zero_grad(set_to_none=True)
        stats["naive"] = naive_backward(model, trees, weights, meter=ActivationMeter(model), heads=logprob_heads(RAW))

    runs = {"replay": replay, "naive": naive}
    seconds = alternating({k: (lambda k=k: peaks[k].append(peak_measured(device, runs[k]))) for k in runs},
                          rounds, device)
    replay()
    replay_grads = [p.grad.clone() for p in model.parameters()]
    naive()
    agreement = gradient_agreement(replay_grads, [p.grad for p in model.parameters()])
    del replay_grads, acts
    free(model)

    naive_s, replay_s = min(seconds["naive"]), min(seconds["replay"])
    per_rollout = tree.total_positions
    out = dict(
        tree=f"G={s.G} P={s.prompt} S={s.suffix}", per_rollout_positions=per_rollout,
        replay_positions=stats["replay"].positions, ideal=per_rollout / tree.unique_positions, rounds=rounds,
        naive_s=naive_s, replay_s=replay_s, cache_s=cache_s, speedup=naive_s / replay_s,
        naive_tok_s=per_rollout / naive_s, replay_tok_s=per_rollout / replay_s,
        replay_cache_tok_s=per_rollout / (replay_s + cache_s),
        replay_computed_tok_s=stats["replay"].positions / replay_s,
        replay_meter=stats["replay"].peak_activation_bytes, naive_meter=stats["naive"].peak_activation_bytes,
        grad_rel=agreement["rel"], grad_cosine=agreement["cosine"],
    )
    if device.type == "cuda":
        replay_dev, naive_dev, plan = max(peaks["replay"]), max(peaks["naive"]), plan_for(dims, s, device)
        plan_replay = planned_device_bytes(dims, dtype, plan.replay, plan.replay_workspace)
        plan_naive = planned_device_bytes(dims, dtype, plan.naive, plan.naive_workspace)
        out |= dict(replay_dev_gib=replay_dev / GiB, naive_dev_gib=naive_dev / GiB,
                    replay_plan_ratio=replay_dev / plan_replay, naive_plan_ratio=naive_dev / plan_naive)
    return out


# -- 2. the largest tree ----------------------------------------------------------------------
def trains(model, dims: ModelDims, s: Setting, mode: str, prompt: int, dtype) -> tuple[bool, int | None]:
    """Does one backward at this prompt length fit? (measured peak or None)"""
    G = s.G if mode == "replay" else 1  # naive: one rollout is its whole peak
    tree = make_tree(G, prompt, s.suffix, dims.vocab, seed=prompt)
    weights = random_weights(tree, prompt)
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ok, peak = True, None
    try:
        meter = ActivationMeter(model)
        if mode == "replay":
            stats = replay_backward(model, [tree], weights, meter=meter, budget_bytes=s.budget_bytes,
                                    heads=logprob_heads(RAW))
        else:
            stats = naive_backward(model, [tree], weights, meter=meter, heads=logprob_heads(RAW))
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
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of the throughput, after one warm-up round")
    args = ap.parse_args(argv)

    wall = time.perf_counter()
    budget = Budget(args.budget_s)
    names = ["smoke"] if args.smoke else args.models.split(",")
    unknown = [n for n in names if n not in MODELS and not args.smoke]
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
        model = qwen_model(name, device, dtype, max(s.max_prompt, s.prompt) + s.suffix + 64)
        dims = ModelDims.from_hf(model.config)
        print(f"\n== Qwen2.5-{name} shape: {dims.params() / 1e9:.3f}B params, {str(dtype)[6:]}, sdpa "
              f"(built in {time.perf_counter() - t0:.1f}s)", flush=True)
        r = throughput(model, dims, s, device, dtype, args.rounds)
        print(f"throughput  {r['tree']}, fastest of {r['rounds']} alternating rounds: naive {r['naive_s']:.2f}s, "
              f"replay {r['replay_s']:.2f}s (+ caching pass {r['cache_s']:.2f}s); per-rollout tok/s naive "
              f"{r['naive_tok_s']:.0f}, replay {r['replay_tok_s']:.0f} ({r['replay_cache_tok_s']:.0f} with the "
              f"caching pass); speedup {r['speedup']:.2f} of ideal {r['ideal']:.2f}", flush=True)
        print(f"            gradients replay vs naive: rel {r['grad_rel']:.2e}, cosine {r['grad_cosine']:.6f}",
              flush=True)
        if "replay_dev_gib" in r:
            print(f"            device peak replay {r['replay_dev_gib']:.1f} GiB (plan ratio "
                  f"{r['replay_plan_ratio']:.2f}), naive {r['naive_dev_gib']:.1f} GiB (plan ratio "
                  f"{r['naive_plan_ratio']:.2f})", flush=True)
        print(f"            activations (meter) replay {size(r['replay_meter'])}, naive {size(r['naive_meter'])}",
              flush=True)
        kv |= {f"speedup_{name}": f"{r['speedup']:.3f}", f"ideal_{name}": f"{r['ideal']:.3f}",
               f"efficiency_{name}": f"{r['speedup'] / r['ideal']:.3f}",
               f"replay_tok_s_{name}": f"{r['replay_tok_s']:.0f}", f"naive_tok_s_{name}": f"{r['naive_tok_s']:.0f}",
               f"replay_cache_tok_s_{name}": f"{r['replay_cache_tok_s']:.0f}",
               f"grad_rel_{name}": f"{r['grad_rel']:.3e}", f"grad_cosine_{name}": f"{r['grad_cosine']:.6f}"}
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
