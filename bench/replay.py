"""Branch replay backward vs the per-rollout backward, side by side in one run.

    .venv/bin/python bench/replay.py [--shapes g8,g16,g4x4] [--quick] [--smoke] [--model smollm2]

A Llama-shaped model with random init (float32, sdpa, GQA) and synthetic rollout trees:
G completions of S tokens after a shared prompt of P tokens, and a two-level tree whose
completions first share a middle segment. `--model smollm2` times instead SmolLM2-135M's
own architecture (random init) on configs/default.yaml's tree, the shape bench/e2e.py trains. Per shape it times, on the same model and
weights (random per token), the per-rollout `naive_backward` and `replay_backward` with
the no-grad caching pass (`capture_tree`) of the K/V it reads (those of the branching nodes
whose graph it does not keep: none where every one is kept), interleaved and repeated (min
of the repeats), after a warm-up. Replay's time is both (the pass also shown alone, as
cache_s). It reports the positions each runs, the ActivationMeter peak of each
(saved-for-backward + held K/V), and the max relative gradient difference.

    ideal      = total_positions / unique_positions   (G(P+S)/(P+GS) for one level)
    speedup    = naive seconds / replay seconds
    efficiency = speedup / ideal
    mem_ratio  = replay peak / naive peak

Two cross-checks sit next to them in the table (not in the targets): cpu_sp, the speedup
in CPU seconds of this process (less sensitive to other processes taking the cores),
and flop_id, the FLOPs ratio, which unlike the positions ratio charges each leaf token
for attending to the whole prefix (see forward_flops).

`--variants` then times replay on attention the fused CPU kernel cannot run unmasked
(lsreplay/replay/attention/), each against the same model without it, same weights:
a sliding window of half the prompt (Mistral: masked parts of the flash kernel, parts out of
the window skipped) and attention logits softcapping (Gemma 2: the plain torch kernel).
Per variant: replay's seconds with it over without it (cost), and its speedup over the
per-rollout backward on the same model.

Targets: efficiency >= 0.8 and mem_ratio <= 1. The machine is shared and noisy, which is
why only ratios measured side by side are reported. The last line is key=value pairs:
the headline is the worst efficiency (with its shape's speedup and ideal) and the
largest mem_ratio; per-shape values carry a `_<shape>` suffix.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lsreplay.core.config import ModelConfig
from lsreplay.models.loading import resolve_model_dir

from lsreplay.models.distribution import RAW
from lsreplay.replay.backward import naive_backward, replay_backward, replay_plan
from lsreplay.replay.capture import capture_tree
from lsreplay.replay.heads import logprob_heads
from lsreplay.replay.memory import ActivationMeter
from lsreplay.replay.view import read_kv_nodes
from lsreplay.tree import RolloutTree


@dataclass(frozen=True)
class Shape:
    name: str
    prompt: int
    levels: tuple[tuple[int, int], ...]  # (branching, segment length) from the root down

    @property
    def leaves(self) -> int:
        return math.prod(b for b, _ in self.levels)

    def describe(self) -> str:
        g = "x".join(str(b) for b, _ in self.levels)
        segs = "+".join(str(n) for _, n in self.levels)
        return f"G={g} P={self.prompt} S={segs}"


# One decoder layer as wide as a small real model's, with Qwen2.5's MLP ratio (intermediate
# = 5.3 x hidden). Width matters: every suffix token attends over the whole prompt, and in a
# model as narrow as hidden 256 that attention is ~60% of the FLOPs at 4k context, far more
# than in the models this trains (Qwen2.5-7B: hidden 3584), which caps speedup / ideal at
# the FLOPs ratio (flop_id) well below 1. Depth only scales the time.
MODEL = {"hidden_size": 768, "intermediate_size": 4096, "num_hidden_layers": 1, "num_attention_heads": 12,
         "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 8192}
SMOKE_MODEL = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 1024}

SHAPES = {s.name: s for s in [
    Shape("g8", 2048, ((8, 128),)),
    Shape("g16", 4096, ((16, 256),)),
    Shape("g4x4", 2048, ((4, 128), (4, 128))),
]}
# --model smollm2: SmolLM2-135M-Instruct's own architecture (30 layers, hidden 576, a tied
# 49k-token head; random init) on the tree of configs/default.yaml, what bench/e2e.py trains:
# a ~650-token few-shot prompt, 4 answers forked again 16 tokens in, up to 48 tokens each.
SMOLLM2_SHAPES = {s.name: s for s in [Shape("default", 650, ((4, 16), (2, 32)))]}
SMOKE_SHAPES = {s.name: s for s in [
    Shape("g4", 128, ((4, 16),)),
    Shape("g2x2", 96, ((2, 8), (2, 8))),
]}


def make_model(spec: dict | None, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama of `spec`, or of the shipped SmolLM2's config (None)."""
    torch.manual_seed(seed)
    if spec is None:
        config = AutoConfig.from_pretrained(resolve_model_dir(ModelConfig()), attn_implementation="sdpa")
    else:
        config = LlamaConfig(**spec, tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()  # replay differentiates exactly what the caching pass computed: no dropout
    return model


# --variants: (family, the keys that turn its variant on). The same weights with the variant
# off are its baseline.
VARIANTS = {"window": ("mistral", lambda shape: {"sliding_window": shape.prompt // 2}),
            "softcap": ("gemma2", lambda shape: {"attn_logit_softcapping": 50.0})}
VARIANT_OFF = {"window": {"sliding_window": None}, "softcap": {"attn_logit_softcapping": None}}


def variant_model(spec: dict, family: str, keys: dict, seed: int):
    """A random model of `family` of `spec`'s dimensions with `keys` set (eager attention where
    the family has no sdpa), float32, eval mode."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **spec, tie_word_embeddings=False, head_dim=spec["hidden_size"]
                                  // spec["num_attention_heads"], **keys)
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(config).to(torch.float32).eval()


def run_variants(spec: dict, shape: Shape, reps: int, seed: int) -> dict:
    """Each variant of VARIANTS on `shape` against the same weights without it (see the
    module docstring)."""
    out = {}
    for name, (family, keys) in VARIANTS.items():
        on = variant_model(spec, family, keys(shape), seed)
        off = variant_model(spec, family, VARIANT_OFF[name], seed)
        off.load_state_dict(on.state_dict())
        with_it, without = run_shape(on, shape, reps, seed), run_shape(off, shape, reps, seed)
        out[name] = {"cost": (with_it["replay_s"] + with_it["cache_s"]) / (without["replay_s"] + without["cache_s"]),
                     "speedup": with_it["speedup"], "ideal": with_it["ideal"], "grad_rel": with_it["grad_rel"]}
    return out


def make_tree(shape: Shape, vocab: int, rng: random.Random) -> RolloutTree:
    """Siblings start with distinct tokens, so the trie has exactly the intended shape."""
    prompt = [rng.randrange(vocab) for _ in range(shape.prompt)]

    def grow(level: int) -> list[list[int]]:
        if level == len(shape.levels):
            return [[]]
        branching, length = shape.levels[level]
        firsts = rng.sample(range(vocab), branching)
        out = []
        for first in firsts:
            segment = [first] + [rng.randrange(vocab) for _ in range(length - 1)]
            out += [segment + rest for rest in grow(level + 1)]
        return out

    return RolloutTree.from_sequences(prompt, grow(0))


def grads(model) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def max_rel_diff(a: list, b: list) -> float:
    """Per tensor max |a - b| / max |a|, the worst over tensors."""
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            if (x is None) != (y is None):
                return math.inf
            continue
        scale = x.abs().max().item()
        diff = (x - y).abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def forward_flops(config, tree: RolloutTree, replay: bool) -> float:
    """Forward FLOPs (backward is ~2x for both methods, so ratios hold): linear layers per
    position, the LM head per predicted token, and attention per (query, key) pair. Unlike
    the positions ratio it charges replay's leaf tokens for attending to the whole prefix,
    which matters in narrow models at thousands of positions."""
    h, L, I, V = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    H, kvh = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or h // H
    per_position = 2 * L * (2 * h * H * hd + 2 * h * kvh * hd + 3 * h * I)
    per_pair = 4 * L * H * hd
    per_target = 2 * h * V
    if replay:  # every trie position once; position start+i attends to start+i+1 keys
        spans = [(n.start, len(n.tokens)) for n in tree.nodes]
        targets = tree.num_entries
    else:
        spans = [(0, tree.prompt_len + len(c)) for c in tree.completions]
        targets = sum(len(c) for c in tree.completions)
    positions = sum(n for _, n in spans)
    pairs = sum(n * start + n * (n + 1) // 2 for start, n in spans)
    return positions * per_position + pairs * per_pair + targets * per_target


def timed(fn):
    """(result, wall seconds, CPU seconds of this process): CPU time is a cross-check that
    is less sensitive to other processes taking the cores."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def run_shape(model, shape: Shape, reps: int, seed: int) -> dict:
    rng = random.Random(seed)
    tree = make_tree(shape, model.config.vocab_size, rng)
    gen = torch.Generator().manual_seed(seed)
    weights = [[torch.randn(len(c), generator=gen, dtype=torch.float64) for c in tree.completions]]
    trees = [tree]

    read = read_kv_nodes(*replay_plan(model, tree)[:2])
    cache_s = cache_cpu = math.inf
    for _ in range(reps):
        acts, wall, cpu = timed(lambda: [capture_tree(model, tree, keep_hidden=False, heads={}, kv_nodes=read)])
        cache_s, cache_cpu = min(cache_s, wall), min(cache_cpu, cpu)
    prefix_kv = lambda i, node: acts[i].prefix_kv.get(node.id)

    naive_s = replay_s = naive_cpu = replay_cpu = math.inf
    rel = 0.0
    for _ in range(reps):  # interleaved, so both see the same machine load
        model.zero_grad(set_to_none=True)
        naive, _, cpu = timed(lambda: naive_backward(model, trees, weights, meter=ActivationMeter(model),
                                                     heads=logprob_heads(RAW)))
        naive_s, naive_cpu = min(naive_s, naive.seconds), min(naive_cpu, cpu)
        g_naive = grads(model)
        model.zero_grad(set_to_none=True)
        replay, _, cpu = timed(lambda: replay_backward(model, trees, weights, prefix_kv=prefix_kv,
                                                       meter=ActivationMeter(model), heads=logprob_heads(RAW)))
        replay_s, replay_cpu = min(replay_s, replay.seconds), min(replay_cpu, cpu)
        g_replay = grads(model)
        model.zero_grad(set_to_none=True)
        rel = max(rel, max_rel_diff(g_naive, g_replay))

    ideal = tree.total_positions / tree.unique_positions
    flop_ideal = forward_flops(model.config, tree, False) / forward_flops(model.config, tree, True)
    speedup = naive_s / (replay_s + cache_s)
    return {
        "shape": shape, "ideal": ideal, "speedup": speedup, "efficiency": speedup / ideal,
        "flop_ideal": flop_ideal, "cpu_speedup": naive_cpu / (replay_cpu + cache_cpu),
        "naive_s": naive_s, "replay_s": replay_s, "cache_s": cache_s,
        "naive_pos": naive.positions, "replay_pos": replay.positions,
        "naive_peak": naive.peak_activation_bytes, "replay_peak": replay.peak_activation_bytes,
        "mem_ratio": replay.peak_activation_bytes / naive.peak_activation_bytes,
        "grad_rel": rel, "objective_gap": abs(naive.objective - replay.objective) / max(abs(naive.objective), 1e-30),
    }


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None,
                    help=f"comma-separated shape names (default: all of {','.join(SHAPES)})")
    ap.add_argument("--quick", action="store_true", help="one timed repeat instead of two (noisier)")
    ap.add_argument("--smoke", action="store_true", help="tiny model and shapes, for the test suite")
    ap.add_argument("--model", choices=["wide", "smollm2"], default="wide",
                    help="wide: one wide decoder layer (the default); smollm2: SmolLM2-135M's architecture "
                         "on the default config's tree")
    ap.add_argument("--reps", type=int, default=None, help="timed repeats per shape (min is kept)")
    ap.add_argument("--variants", action="store_true",
                    help="also time a sliding window and softcapped attention against the same model without")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    catalogue, spec = ((SMOKE_SHAPES, SMOKE_MODEL) if args.smoke else
                       (SMOLLM2_SHAPES, None) if args.model == "smollm2" else (SHAPES, MODEL))
    names = args.shapes.split(",") if args.shapes else list(catalogue)
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; choose from {list(catalogue)}")
    reps = args.reps or (1 if args.quick or args.smoke else 2)

    model = make_model(spec, args.seed)
    n_params, c = sum(p.numel() for p in model.parameters()), model.config
    print(f"model: Llama {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
          f"intermediate {c.intermediate_size}, heads {c.num_attention_heads}/"
          f"{c.num_key_value_heads} kv, vocab {c.vocab_size}{' tied' if c.tie_word_embeddings else ''}, "
          f"{n_params / 1e6:.2f}M params, "
          f"float32, sdpa, {torch.get_num_threads()} threads; timed repeats: {reps} (min)", flush=True)

    # Warm-up: first-call costs (allocator, kernels, lazy init) off the clock.
    warm = Shape("warmup", 64, ((2, 8),))
    run_shape(model, warm, 1, args.seed)

    header = (f"{'shape':<6} {'tree':<24} {'naive_s':>8} {'replay_s':>8} {'cache_s':>7} {'speedup':>7} "
              f"{'ideal':>6} {'effic':>6} {'cpu_sp':>6} {'flop_id':>7} {'naive_pos':>9} {'replay_pos':>10} {'naive_MiB':>9} "
              f"{'replay_MiB':>10} {'mem_ratio':>9} {'grad_rel':>9}")
    print(header)
    print("-" * len(header), flush=True)
    results = []
    for i, name in enumerate(names):
        r = run_shape(model, catalogue[name], reps, args.seed + 1 + i)
        results.append(r)
        print(f"{name:<6} {r['shape'].describe():<24} {r['naive_s']:>8.2f} {r['replay_s']:>8.2f} "
              f"{r['cache_s']:>7.2f} {r['speedup']:>7.2f} {r['ideal']:>6.2f} {r['efficiency']:>6.2f} "
              f"{r['cpu_speedup']:>6.2f} {r['flop_ideal']:>7.2f} {r['naive_pos']:>9} {r['replay_pos']:>10} {mib(r['naive_peak']):>9} "
              f"{mib(r['replay_peak']):>10} {r['mem_ratio']:>9.3f} {r['grad_rel']:>9.2e}", flush=True)

    worst = min(results, key=lambda r: r["efficiency"])
    kv = {"speedup": f"{worst['speedup']:.3f}", "ideal": f"{worst['ideal']:.3f}",
          "efficiency": f"{worst['efficiency']:.3f}",
          "mem_ratio": f"{max(r['mem_ratio'] for r in results):.3f}",
          "grad_rel_diff": f"{max(r['grad_rel'] for r in results):.3e}",
          "worst_shape": worst["shape"].name}
    for r in results:
        n = r["shape"].name
        kv |= {f"speedup_{n}": f"{r['speedup']:.3f}", f"ideal_{n}": f"{r['ideal']:.3f}",
               f"efficiency_{n}": f"{r['efficiency']:.3f}", f"mem_ratio_{n}": f"{r['mem_ratio']:.3f}",
               f"cpu_speedup_{n}": f"{r['cpu_speedup']:.3f}", f"flop_ideal_{n}": f"{r['flop_ideal']:.3f}",
               f"cache_s_{n}": f"{r['cache_s']:.3f}", f"grad_rel_diff_{n}": f"{r['grad_rel']:.3e}"}
    if args.variants:
        shape = catalogue[names[0]]
        for name, r in run_variants(spec or MODEL, shape, reps, args.seed).items():
            print(f"{name}: replay {r['cost']:.2f}x the seconds without it on {shape.name}; speedup over the "
                  f"per-rollout backward {r['speedup']:.2f} (ideal {r['ideal']:.2f}), gradients within "
                  f"{r['grad_rel']:.1e}", flush=True)
            kv |= {f"{name}_cost": f"{r['cost']:.3f}", f"{name}_speedup": f"{r['speedup']:.3f}"}
    kv["wall_s"] = f"{time.perf_counter() - wall:.1f}"
    print(" ".join(f"{k}={v}" for k, v in kv.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
