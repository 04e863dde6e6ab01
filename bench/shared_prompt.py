"""Rollouts of long prompts with each prompt's K/V held once, against every row holding its own.

    .venv/bin/python bench/shared_prompt.py [--prompt-tokens 1024,4096] [--prompts 1] [--max-new-tokens 64] [--smoke]

SmolLM2-135M-Instruct samples a rollout stage of the default tree shape ([4, 2], a branch
point 16 tokens in, temperature 1; lsreplay's short system prompt) on the long-context task's prompts
(kv_retrieval, lsreplay/data/long_context.py) of each length in tokens, twice on the same
prompts with the same generators, in alternating order: with each tree's prompt K/V held
once (rollout.shared_prompt, the default) and with every row its own copy (the layout before
it, and still that of models it does not apply to). A length past SmolLM2's 8,192 positions
runs it YaRN-stretched (model.rope_scaling) in both.

Per length it reports the K/V bytes each layout held at its peak (measured from the cache
tensors: the trace's kv_bytes_peak) next to the ideal ratio G(P + C) / (P + G C) for G rows,
a P-token prompt and C completion tokens; each layout's stage and decode seconds; and the
share of leaves whose tokens are identical in both (float32: the layouts sum the softmax in
another order, so a near-tie could flip a draw; in float64 the tests find every token the same).

The last line is key=value: kv_ratio_<P> (repeated / shared K/V bytes), ideal_<P>,
kv_shared_mib_<P>, kv_repeated_mib_<P>, stage_speedup_<P> (repeated / shared seconds),
same_leaves_<P>, and kv_ratio, the longest prompt's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lsreplay.core.config import load_config  # noqa: E402
from lsreplay.data.prompt_sets import source_prompts  # noqa: E402
from lsreplay.data.rendering import render_prompt  # noqa: E402
from lsreplay.models.distribution import SamplingParams  # noqa: E402
from lsreplay.models.loading import eos_ids, load_model, load_tokenizer  # noqa: E402
from lsreplay.rollout.tree_sampler import sample_trees  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_POSITIONS = 8192
LAYOUTS = ("shared", "repeated")


def log(message: str) -> None:
    print(message, flush=True)


def length_config(args, prompt_tokens: int):
    """The schema's defaults at this prompt length, on kv_retrieval, stretched where SmolLM2 needs it."""
    needed = prompt_tokens + args.max_new_tokens
    factor = math.ceil(needed / SMOLLM2_POSITIONS)
    stretch = [f"model.rope_scaling={{rope_type: yarn, factor: {factor}}}"] if factor > 1 else []
    return load_config(None, [
        "data.tasks=[kv_retrieval]", f"data.size={max(args.prompts, 4)}", f"data.prompts_per_step={args.prompts}",
        f"data.max_prompt_tokens={prompt_tokens}", f"seed={args.seed}", f"rollout.max_new_tokens={args.max_new_tokens}",
        *stretch])


def stage(model, prompts, cfg, eos, share: bool, seed: int):
    """One rollout stage: (trees, trace, seconds)."""
    r = cfg.rollout
    generators = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(len(prompts))]
    start = time.perf_counter()
    trees, trace = sample_trees(model, prompts, list(r.branching), list(r.segment_tokens), r.max_new_tokens,
                                SamplingParams(r.temperature, r.top_p, r.top_k), eos, generators, share_prompt=share)
    return trees, trace, time.perf_counter() - start


def measure(args, prompt_tokens: int) -> dict:
    cfg = length_config(args, prompt_tokens)
    model, tokenizer = load_model(cfg.model, trainable=False), load_tokenizer(cfg.model)
    source = source_prompts(cfg)
    prompts = [render_prompt(tokenizer, source[i], cfg.data) for i in range(args.prompts)]
    eos = eos_ids(tokenizer, model)
    runs = {}
    for share in ((True, False) if args.seed % 2 == 0 else (False, True)):
        runs[LAYOUTS[0] if share else LAYOUTS[1]] = stage(model, prompts, cfg, eos, share, args.seed)
    (shared, shared_trace, shared_s), (repeated, repeated_trace, repeated_s) = runs["shared"], runs["repeated"]
    leaves = [(a, b) for s, r in zip(shared, repeated) for a, b in zip(s.completions, r.completions)]
    same = sum(a == b for a, b in leaves) / max(len(leaves), 1) if len(shared[0].completions) == len(
        repeated[0].completions) else 0.0
    rows = math.prod(cfg.rollout.branching) * len(prompts)
    length = sum(map(len, prompts)) / len(prompts)
    completion = max(len(c) for t in shared for c in t.completions)
    ideal = rows * (length + completion) / (len(prompts) * length + rows * completion)
    figures = {"kv_shared": shared_trace.kv_bytes_peak, "kv_repeated": repeated_trace.kv_bytes_peak,
               "shared_s": shared_s, "repeated_s": repeated_s, "same": same, "ideal": ideal, "length": length,
               "shared_decode_s": sum(shared_trace.seconds), "repeated_decode_s": sum(repeated_trace.seconds)}
    log(f"prompt {prompt_tokens} tokens ({len(prompts)} x {length:.0f} rendered, {rows} rows, completions up to "
        f"{completion}): K/V held shared {figures['kv_shared'] / 2**20:.1f} MiB, repeated "
        f"{figures['kv_repeated'] / 2**20:.1f} MiB ({figures['kv_repeated'] / figures['kv_shared']:.2f}x; ideal "
        f"{ideal:.2f}x); stage shared {shared_s:.1f} s (decode {figures['shared_decode_s']:.1f}), repeated "
        f"{repeated_s:.1f} s (decode {figures['repeated_decode_s']:.1f}); identical leaves {same:.0%}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", default="1024,4096", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--prompts", type=int, default=1, help="trees per stage")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the wiring only")
    args = parser.parse_args()
    if args.smoke:
        args.prompt_tokens, args.max_new_tokens = "256", 20
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    log(f"SmolLM2-135M-Instruct, kv_retrieval prompts, {args.prompts} tree(s) a stage, max_new_tokens "
        f"{args.max_new_tokens}, {args.threads} thread(s)")
    fields = {}
    for n in lengths:
        f = measure(args, n)
        fields.update({f"kv_ratio_{n}": f"{f['kv_repeated'] / f['kv_shared']:.3f}", f"ideal_{n}": f"{f['ideal']:.3f}",
                       f"kv_shared_mib_{n}": f"{f['kv_shared'] / 2**20:.1f}",
                       f"kv_repeated_mib_{n}": f"{f['kv_repeated'] / 2**20:.1f}",
                       f"stage_speedup_{n}": f"{f['repeated_s'] / f['shared_s']:.3f}", f"same_leaves_{n}": f"{f['same']:.3f}"})
    fields["kv_ratio"] = fields[f"kv_ratio_{lengths[-1]}"]
    log(" ".join(f"{k}={v}" for k, v in {**fields, "threads": args.threads}.items()))


if __name__ == "__main__":
    main()
