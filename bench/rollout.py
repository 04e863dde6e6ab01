"""One rollout stage with a long-tailed length distribution, with and without the adaptive engine.

    .venv/bin/python bench/rollout.py [--max-new-tokens 192] [--threshold 8] [--repeats 2] [--smoke]

The target is the real SmolLM2-135M-Instruct; prompts are the default config's tasks,
rendered as the trees stage renders them; a stage samples `--prompts` trees (the
default prompts_per_step) of the default shape ([4, 2], a branch point 16 tokens in) at
the default sampling parameters, with a larger max_new_tokens so that the answers that
ramble make a long tail.

1. Drafter: distilled, as the drafter stage does a step behind, on the target's own
   tree rollouts of other prompts (same shape and sampling), for `--steps` steps. Its
   proposals are restricted to the `--draft-vocab` tokens the target gives the most
   probability over those rollouts (bench/specdec.py's `draft_head` during distillation):
   on held-out rollouts that vocabulary holds more of the target's probability than the
   tokens the rollouts happen to contain, at the same drafting cost.
2. The stage, `--repeats` times on fresh prompts: plain tree sampling and the adaptive
   engine (speculation once at most `--threshold` sequences are live after the last
   branch point; draft length from one UCB1-Tuned bandit kept across repeats), on the
   same prompts with the same generators, in alternating order so that the machine's
   noise falls on both alike. Both sample identically up to the switch; after it the
   draws differ (same distribution), so the two runs' tails differ in length and in how
   many rows stay live, and the stage ratio carries that sampling noise too.
   `tail_speedup` compares only what the engine changes, like with like: per live-count
   bucket, plain tokens/s (last-level steps at <= threshold live) and the speculative
   rounds' tokens/s; it is the plain tail's time over the time the spec rates would take
   for the same tokens in the same buckets.

The last line is key=value: stage_speedup (plain wall / adaptive wall over all repeats),
accept_len (tokens emitted per sequence per verify forward), tail_time_share (plain:
share of decode time after 90% of the leaves finished), ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specdec import ROOT, draft_head, log, parse_run_args, prompt_ids, with_features  # noqa: E402

from lsreplay.core.config import ModelConfig, load_config  # noqa: E402
from lsreplay.drafter.distill import distill  # noqa: E402
from lsreplay.drafter.model import Drafter  # noqa: E402
from lsreplay.models.loading import eos_ids, load_model, load_tokenizer  # noqa: E402
from lsreplay.rollout.bandit import DraftLengthBandit  # noqa: E402
from lsreplay.models.distribution import SamplingParams  # noqa: E402
from lsreplay.rollout.tree_sampler import (  # noqa: E402
    DECISION_KEYS,
    DecodeTrace,
    Speculation,
    sample_trees,
)

MODES = ("plain", "adaptive")


@dataclass
class Totals:
    """One mode's measurements summed over the repeats."""

    wall: float = 0.0
    tail_seconds: float = 0.0  # decode time after 90% of a stage's leaves had finished
    low_live_seconds: float = 0.0  # decode time at <= threshold live sequences
    # Per live-count bucket: [tokens, seconds] of the tail steps (plain: last-level steps at
    # <= threshold live; adaptive: the speculative rounds).
    tail_buckets: dict[int, list[float]] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    traces: list[DecodeTrace] = field(default_factory=list)

    def add(self, trees, trace: DecodeTrace, seconds: float, threshold: int, last_level: int) -> None:
        lengths = [len(c) for t in trees for c in t.completions]
        summary = trace.summary(lengths)
        self.wall += seconds
        self.tail_seconds += summary["tail_time_share"] * summary["decode_seconds"]
        self.low_live_seconds += sum(s for s, live in zip(trace.seconds, trace.live) if live <= threshold)
        speculative = "spec" in trace.mode
        for step in trace.decisions()[last_level:]:
            if step["mode"] == "spec" if speculative else step["live"] <= threshold:
                bucket = self.tail_buckets.setdefault(DraftLengthBandit.bucket(step["live"]), [0, 0.0])
                bucket[0] += step["tokens"]
                bucket[1] += step["seconds"]
        self.lengths += lengths
        self.traces.append(trace)


def stage(target, prompts, cfg, args, params, eos, seed: int, speculation=None):
    """One trees stage: (trees, trace, wall seconds)."""
    r = cfg.rollout
    generators = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(len(prompts))]
    start = time.perf_counter()
    trees, trace = sample_trees(target, prompts, list(r.branching), list(r.segment_tokens), args.max_new_tokens,
                                params, eos, generators, speculation=speculation)
    return trees, trace, time.perf_counter() - start


@torch.inference_mode()
def likely_tokens(target, sequences, size: int) -> torch.LongTensor:
    """The `size` tokens with the most next-token probability summed over every position of `sequences`."""
    mass = torch.zeros(target.get_output_embeddings().weight.shape[0])
    for _, hidden in sequences:
        mass += target.get_output_embeddings()(hidden).float().softmax(-1).sum(0)
    return mass.topk(min(size, len(mass))).indices.sort().values


def train_drafter(target, prompts, cfg, args, params, eos) -> tuple[Drafter, torch.LongTensor, dict]:
    """A drafter distilled on the target's own tree rollouts of `prompts`, and its draft vocabulary."""
    started = time.perf_counter()
    trees, _, _ = stage(target, prompts, cfg, args, params, eos, seed=args.seed + 999)
    sequences = with_features(target, [tree.prompt_ids + c for tree in trees for c in tree.completions], batch=8)
    vocab = likely_tokens(target, sequences, args.draft_vocab)
    rollout_s = time.perf_counter() - started
    torch.manual_seed(args.seed)
    drafter = Drafter.from_target(target)
    with draft_head(drafter, vocab):
        stats = distill(drafter, sequences, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                        generator=torch.Generator().manual_seed(args.seed), progress=False)
    info = {"paths": len(sequences), "train_tokens": sum(len(t) for t, _ in sequences), "rollout_s": rollout_s,
            "distill_s": time.perf_counter() - started - rollout_s, "top1": stats.top1_accept}
    return drafter.eval(), vocab, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="trees per stage (the default prompts_per_step)")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    # Why 8. A round replaces an A-row forward by an A*(k+1)-row verify (plus k small
    # drafter steps). On these CPUs a SmolLM2-135M forward costs roughly 60 ms + 15-20 ms
    # per row, so at A <= 8 and k = 1 a round costs about 1.3-1.5 plain steps: a drafter
    # whose first proposal is accepted 35-40% of the time at temperature 1 (what this
    # bench's drafter reaches on held-out rollouts) about breaks even there and loses at
    # larger A. Lower would be better per round, but here about a quarter of the leaves
    # ramble to max_new_tokens, so the live count seldom falls below ~8 and a lower
    # threshold would seldom switch at all. Arm 0 lets the bandit turn speculation off in a
    # bucket where it loses. An accelerator's forward stays memory-bound to far more rows:
    # there the threshold can be much higher.
    parser.add_argument("--threshold", type=int, default=8)
    # 0 = no drafting (a plain step through the speculator). At ~35% acceptance drafts
    # beyond 3 are rarely kept.
    parser.add_argument("--arms", default="0,1,2,3", help="the bandit's draft lengths")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--train-prompts", type=int, default=8, help="prompts whose trees the drafter learns from")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=4096)
    args = parse_run_args(parser)
    if args.smoke:
        args.prompts, args.max_new_tokens, args.repeats, args.train_prompts, args.steps = 1, 24, 1, 1, 3
    bench_start = time.perf_counter()

    cfg = load_config(ROOT / "configs/default.yaml")
    r = cfg.rollout
    target = load_model(ModelConfig(), trainable=False)
    tokenizer = load_tokenizer(ModelConfig())
    eos = eos_ids(tokenizer, target)
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    prompts = prompt_ids(cfg, tokenizer, args.train_prompts + args.repeats * args.prompts, args.seed)
    train_prompts, stage_prompts = prompts[:args.train_prompts], prompts[args.train_prompts:]
    log(f"SmolLM2-135M-Instruct, tasks {list(cfg.data.tasks)}, trees {list(r.branching)} segment "
        f"{list(r.segment_tokens)}, max_new_tokens {args.max_new_tokens}, {params}, {args.threads} thread(s)")

    drafter, vocab, info = train_drafter(target, train_prompts, cfg, args, params, eos)
    log(f"drafter: {info['paths']} paths of {args.train_prompts} other prompts' trees, {info['train_tokens']} tokens "
        f"({info['rollout_s']:.0f}s); {args.steps} distill steps ({info['distill_s']:.0f}s), top1 on its training "
        f"data {info['top1']:.3f}; draft vocabulary {len(vocab)} tokens")

    bandit = DraftLengthBandit(arms=tuple(int(a) for a in args.arms.split(",")), seed=args.seed)
    speculation = Speculation(drafter, args.threshold, bandit, vocab)
    totals = {mode: Totals() for mode in MODES}
    for rep in range(args.repeats):
        group = stage_prompts[rep * args.prompts:(rep + 1) * args.prompts]
        runs = {mode: stage(target, group, cfg, args, params, eos, seed=args.seed + rep,
                            speculation=speculation if mode == "adaptive" else None)
                for mode in (MODES if rep % 2 == 0 else MODES[::-1])}
        for mode, (trees, trace, seconds) in runs.items():
            totals[mode].add(trees, trace, seconds, args.threshold, sum(cfg.rollout.segment_tokens))
        adaptive = runs["adaptive"][1]
        switch = adaptive.mode.index("spec") if "spec" in adaptive.mode else None
        where = "no switch" if switch is None else f"switch at step {switch}, {adaptive.live[switch]} live"
        log(f"repeat {rep}: " + ", ".join(f"{mode} {runs[mode][2]:.1f}s" for mode in runs) + f"; {where}")
    report(args, totals, bandit, len(vocab), info, time.perf_counter() - bench_start)


def compare_tails(plain: Totals, adaptive: Totals) -> float:
    """Print tokens/s per live-count bucket of both tails; return the plain tail's time over
    the time the speculative rates would take for its tokens (buckets both tails reached)."""
    rate = lambda t, b: t.tail_buckets[b][0] / max(t.tail_buckets[b][1], 1e-9)  # noqa: E731
    shared = sorted(set(plain.tail_buckets) & set(adaptive.tail_buckets))
    for b in sorted(set(plain.tail_buckets) | set(adaptive.tail_buckets)):
        cells = [f"{rate(t, b):5.1f} tok/s over {t.tail_buckets[b][1]:5.1f}s" if b in t.tail_buckets else "-"
                 for t in (plain, adaptive)]
        live = f"{b // 2 + 1}-{b}" if b > 2 else str(b)  # DraftLengthBandit.bucket's ranges
        log(f"  tail at {live:>5} live: plain {cells[0]}, speculative rounds {cells[1]}")
    plain_s = sum(plain.tail_buckets[b][1] for b in shared)
    spec_s = sum(plain.tail_buckets[b][0] / max(rate(adaptive, b), 1e-9) for b in shared)
    return plain_s / spec_s if spec_s else float("nan")


def report(args, totals: dict[str, Totals], bandit, vocab_size: int, info: dict, bench_s: float) -> None:
    log("")
    for mode, t in totals.items():
        ordered = sorted(t.lengths)
        p10, p50, p90 = (ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.1, 0.5, 0.9))
        log(f"{mode:<9} wall {t.wall:6.1f}s  lengths p10/p50/p90/max {p10}/{p50}/{p90}/"
            f"{ordered[-1]}, {sum(n == args.max_new_tokens for n in ordered)}/{len(ordered)} at the cap  "
            f"tail_time_share {t.tail_seconds / t.wall:.2f}  time at <= {args.threshold} live "
            f"{t.low_live_seconds / t.wall:.2f}")
    spec = DecodeTrace()
    for trace in totals["adaptive"].traces:  # the speculative steps of every stage, as one trace
        for step in trace.decisions():
            if step["mode"] == "spec":
                spec.record(*(step[key] for key in DECISION_KEYS))
        for name in ("drafted", "accepted", "draft_seconds", "verify_seconds"):
            setattr(spec.spec, name, getattr(spec.spec, name) + getattr(trace.spec, name))
    figures = spec.summary([1])
    round_s = spec.spec.draft_seconds + spec.spec.verify_seconds
    log(f"adaptive: {figures['spec_rounds']} spec rounds, {figures['spec_tokens']} tokens, accept_len "
        f"{figures['accept_len']:.2f}, drafts accepted {spec.spec.acceptance:.3f}, drafting "
        f"{spec.spec.draft_seconds / max(round_s, 1e-9):.0%} of round time")
    tail_speedup = compare_tails(totals["plain"], totals["adaptive"])
    arms = {b: {a: (n, round(m, 1)) for a, (n, m) in per.items() if n} for b, per in bandit.summary().items()}
    log(f"bandit {{bucket: {{draft_len: (pulls, mean tok/s)}}}}: {arms}")
    switched = [trace for trace in totals["adaptive"].traces if "spec" in trace.mode]
    if switched:
        steps = [{k: round(v, 3) if isinstance(v, float) else v for k, v in step.items()}
                 for step in switched[0].decisions() if step["mode"] == "spec"]
        log(f"first stage's spec decisions, 4 of {len(steps)}: {json.dumps(steps[:4])}")
    plain, adaptive = totals["plain"], totals["adaptive"]
    fields = {
        "stage_speedup": f"{plain.wall / adaptive.wall:.3f}", "accept_len": f"{figures['accept_len']:.2f}",
        "tail_time_share": f"{plain.tail_seconds / plain.wall:.3f}",
        "tail_speedup": f"{tail_speedup:.3f}",
        "plain_s": f"{plain.wall:.1f}", "adaptive_s": f"{adaptive.wall:.1f}",
        "low_live_share": f"{plain.low_live_seconds / plain.wall:.3f}",
        "spec_time_share": f"{sum(spec.seconds) / adaptive.wall:.3f}", "acceptance": f"{spec.spec.acceptance:.3f}",
        "spec_rounds": figures["spec_rounds"], "threshold": args.threshold, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "draft_vocab": vocab_size, "distill_steps": args.steps,
        "train_tokens": info["train_tokens"], "threads": args.threads, "bench_s": f"{bench_s:.0f}",
    }
    log(" ".join(f"{k}={v}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
