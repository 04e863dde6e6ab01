"""Speculative decoding with a self-distilled drafter vs plain greedy vs HF assisted generation.

    .venv/bin/python bench/specdec.py [--draft-len 5,4,bandit] [--rollouts greedy|sampled] [--smoke]

The target is the real SmolLM2-135M-Instruct (`load_model`), prompts are the default
prompt set's tasks (basic_arithmetic, chain_sum from configs/default.yaml) rendered with
the chat template, exactly as rollouts render them. In one run:

1. Rollouts: the target's own greedy continuations of `--train-prompts` prompts
   (`--rollouts sampled` draws them at temperature 1 instead), `--rollout-tokens` long.
2. Drafter: `Drafter.from_target`, distilled (`distill`) on those paths and the target's
   last hidden states for `--steps` steps. Its proposals are restricted to the tokens the
   rollouts contain (the draft vocabulary): the 49k-row LM head would otherwise be most
   of a one-layer drafter's cost, in distillation and in decoding. (Distillation swaps
   the drafter's shared head for those rows for the duration; decoding passes
   `draft_vocab` to `speculative_generate`.)
3. Long-tail decoding, batch 1, on `--eval-prompts` held-out prompts, `--new-tokens`
   tokens each with EOS ignored (an RL long tail is the few answers that keep going):
   plain greedy decoding with a KV cache (`greedy_generate`), our speculative decoding
   (greedy), and transformers' assisted generation with a 4-layer truncation of the
   target as assistant_model. Methods alternate per prompt after a warm-up, so the
   machine's noise falls on all of them alike; outputs are checked identical to plain.

Caveat printed as `ngram_overlap`: after the short arithmetic answer and EOS, this
model's greedy continuation is almost prompt-independent, so held-out greedy text largely
repeats text seen in the greedy training rollouts. The share of held-out 5-grams that
occur in the rollouts says how much of the acceptance is that repetition; with
`--rollouts sampled` the drafter has not seen the greedy continuation.

Targets on CPU: accept_len >= 2.5 and speedup >= 1.5. The last line is key=value.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lsreplay.core.config import SYSTEM_PROMPT, ModelConfig, load_config  # noqa: E402
from lsreplay.data.rendering import render_prompt  # noqa: E402
from lsreplay.data.sources import PromptSet, generate_prompt_file  # noqa: E402
from lsreplay.drafter.distill import distill, drafter_train_state  # noqa: E402
from lsreplay.drafter.model import Drafter  # noqa: E402
from lsreplay.models.loading import load_model, load_tokenizer  # noqa: E402
from lsreplay.rollout.bandit import DraftLengthBandit  # noqa: E402
from lsreplay.rollout.speculative import (  # noqa: E402
    SpecStats,
    greedy_generate,
    speculative_generate,
)

ROOT = Path(__file__).resolve().parents[1]
BANDIT_ARMS = (3, 4, 5, 6, 8)


def log(msg: str) -> None:
    print(msg, flush=True)


def prompt_ids(cfg, tokenizer, count: int, seed: int) -> list[list[int]]:
    """`count` rendered prompts of the default prompt set's tasks, with the short system
    prompt (SYSTEM_PROMPT, lsreplay's for generated prompts), not the config's long shared context: these benchmarks
    measure decoding, and their README figures were taken on short prompts."""
    d = cfg.data
    short = dataclasses.replace(d, system_prompt=SYSTEM_PROMPT)
    key = hashlib.sha256(json.dumps([list(d.tasks), count, seed, dict(d.task_args)], sort_keys=True).encode())
    path = generate_prompt_file(ROOT / ".cache/prompts" / f"specdec-{key.hexdigest()[:12]}.jsonl", list(d.tasks),
                                count, seed, dict(d.task_args))
    prompts = PromptSet.from_file(path)
    return [render_prompt(tokenizer, prompts[i], short) for i in range(count)]


def left_pad(prompts: list[list[int]]) -> tuple[torch.LongTensor, torch.LongTensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def ignore_eos(model) -> None:
    """Make `generate` run to max_new_tokens: an unset eos_token_id falls back to these defaults."""
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None


def no_eos_config(model, max_new_tokens: int, sample: bool):
    """A generation config that runs exactly max_new_tokens (EOS ignored) and nothing else."""
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.pad_token_id = None, 0
    gc.max_new_tokens, gc.min_new_tokens = max_new_tokens, None
    gc.do_sample = sample
    gc.temperature, gc.top_p, gc.top_k = (1.0, 1.0, 0) if sample else (None, None, None)
    return gc


@torch.inference_mode()
def rollouts(target, prompts, new_tokens: int, mode: str, batch: int, seed: int):
    """Root-to-leaf paths (tokens, last hidden states) of the target's own continuations."""
    paths, torch_seed = [], torch.random.get_rng_state()
    torch.manual_seed(seed)
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        ids, mask = left_pad(group)
        if mode == "greedy":
            completion = greedy_generate(target, ids, new_tokens, attention_mask=mask)
        else:
            out = target.generate(ids, attention_mask=mask, generation_config=no_eos_config(target, new_tokens, True))
            completion = out[:, ids.shape[1]:]
        paths += [prompt + row.tolist() for prompt, row in zip(group, completion)]
    torch.random.set_rng_state(torch_seed)
    return with_features(target, paths, batch)


@torch.inference_mode()
def with_features(target, paths: list[list[int]], batch: int) -> list[tuple[torch.LongTensor, torch.Tensor]]:
    """(tokens, the target's last hidden states) of each token path, encoded in left-padded batches."""
    sequences = []
    for start in range(0, len(paths), batch):
        group = paths[start:start + batch]
        ids, mask = left_pad(group)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        hidden = target.base_model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        for row, path in enumerate(group):
            cut = ids.shape[1] - len(path)
            sequences.append((ids[row, cut:].clone(), hidden[row, cut:].clone()))
    return sequences


@contextlib.contextmanager
def draft_head(drafter: Drafter, vocab: torch.LongTensor):
    """Distil against the LM head rows of `vocab` only: what decoding with draft_vocab uses.

    The token loss becomes a soft cross-entropy over the draft vocabulary (the target's
    distribution renormalised to it), and costs |vocab| / 49152 of the full one.
    """
    shared = drafter._shared
    head = torch.nn.Linear(shared.lm_head.in_features, len(vocab), bias=False)
    head.weight = torch.nn.Parameter(shared.lm_head.weight.detach()[vocab].clone(), requires_grad=False)
    drafter._shared = dataclasses.replace(shared, lm_head=head)
    try:
        yield
    finally:
        drafter._shared = shared


def assistant_for(target, layers: int):
    """The target truncated to its first `layers` layers (shared config and weights), as in NOTES.md."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    assistant = type(target)(config).to(target.dtype)
    assistant.load_state_dict(target.state_dict(), strict=False)
    ignore_eos(assistant)
    return assistant.eval()


def ngram_overlap(held_out: list[torch.LongTensor], train: list[torch.LongTensor], n: int = 5) -> float:
    """Share of the held-out completions' n-grams that occur anywhere in the training rollouts."""
    seen = {tuple(seq[i:i + n].tolist()) for seq in train for i in range(len(seq) - n + 1)}
    grams = [tuple(seq[i:i + n].tolist()) for seq in held_out for i in range(len(seq) - n + 1)]
    return sum(g in seen for g in grams) / max(len(grams), 1)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def distill_with_curve(target, drafter: Drafter, sequences, vocab: torch.LongTensor, args, probe: torch.LongTensor):
    """Distil `args.steps` steps in chunks of `args.curve_every`; after each chunk, the
    accept_len of greedy speculative decoding (k=5) of `probe`, a held-out prompt, for 64
    tokens. Chunks share one trainable state and batch generator: the training is the same as
    one `distill` call. Returns (stats of the last chunk, distillation seconds, [(steps, accept_len)])."""
    train = drafter_train_state(drafter, args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    curve, seconds, done, stats = [], 0.0, 0, None

    def probe_accept() -> float:
        drafter.eval()
        st = SpecStats()
        with torch.inference_mode():
            speculative_generate(target, drafter, probe, 64, draft_len=5, draft_vocab=vocab, stats=st)
        return st.accept_len

    curve.append((0, probe_accept()))
    while done < args.steps:
        chunk = min(args.curve_every, args.steps - done)
        with draft_head(drafter, vocab):
            stats, s = timed(lambda n=chunk: distill(drafter, sequences, steps=n, lr=args.lr, batch_size=args.batch_size,
                                                     generator=generator, train=train, progress=False))
        seconds, done = seconds + s, done + chunk
        curve.append((done, probe_accept()))
    drafter.eval()
    return stats, seconds, curve


def plot_curve(curve: list[tuple[int, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([s for s, _ in curve], [a for _, a in curve], marker="o")
    ax.set_xlabel("distillation steps")
    ax.set_ylabel("held-out accept_len (k=5)")
    ax.set_title(f"drafter acceptance: {title}", fontsize=8)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_run_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Add the options every decoding benchmark has (threads, seed, smoke), parse, and
    set the thread count."""
    parser.add_argument("--threads", type=int, default=1,
                        help="1 by default: on a shared 2-core machine a 2-thread pool stalls on busy cores")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the wiring only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-prompts", type=int, default=16)
    parser.add_argument("--rollout-tokens", type=int, default=192)
    parser.add_argument("--rollouts", choices=["greedy", "sampled"], default="greedy")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--curve-every", type=int, default=25,
                        help="distillation steps between held-out acceptance probes")
    parser.add_argument("--plot", default="", help="write the acceptance curve as a PNG here")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--draft-len", default="5",
                        help="comma-separated configurations measured side by side, each an int or 'bandit' "
                             "(UCB1-Tuned over 3,4,5,6,8); the first is the headline")
    parser.add_argument("--assistant-layers", type=int, default=4)
    parser.add_argument("--no-assisted", action="store_true", help="skip HF assisted generation (slowest)")
    args = parse_run_args(parser)
    if args.smoke:
        args.train_prompts, args.rollout_tokens, args.steps, args.eval_prompts, args.new_tokens = 2, 24, 3, 1, 16
        args.curve_every = 2
    bench_start = time.perf_counter()

    cfg = load_config(ROOT / "configs/default.yaml")
    target = load_model(ModelConfig(), trainable=False)
    ignore_eos(target)
    tokenizer = load_tokenizer(ModelConfig())
    prompts = prompt_ids(cfg, tokenizer, args.train_prompts + args.eval_prompts, args.seed)
    train_prompts, eval_prompts = prompts[:args.train_prompts], prompts[args.train_prompts:]
    log(f"target SmolLM2-135M-Instruct, tasks {list(cfg.data.tasks)}, {args.threads} threads; "
        f"{len(train_prompts)} train prompts, {len(eval_prompts)} held-out")

    # 1-2. The drafter, distilled from the target's own rollouts.
    sequences, rollout_s = timed(lambda: rollouts(target, train_prompts, args.rollout_tokens, args.rollouts,
                                                  batch=8, seed=args.seed))
    vocab = torch.unique(torch.cat([tokens for tokens, _ in sequences]))
    train_tokens = sum(len(t) for t, _ in sequences)
    log(f"rollouts ({args.rollouts}): {len(sequences)} paths, {train_tokens} tokens in {rollout_s:.0f}s; "
        f"draft vocabulary {len(vocab)} tokens")
    torch.manual_seed(args.seed)
    drafter = Drafter.from_target(target)
    probe = torch.tensor([eval_prompts[0]])
    stats, distill_s, curve = distill_with_curve(target, drafter, sequences, vocab, args, probe)
    log(f"distill: {args.steps} steps in {distill_s:.0f}s (acceptance probes not counted), "
        f"last-{min(20, args.steps)} top1 {stats.top1_accept:.3f} feature_loss {stats.feature_loss:.4f}")
    log("held-out accept_len over distillation steps: " + ", ".join(f"{s}: {a:.2f}" for s, a in curve))
    if args.plot:
        plot_curve(curve, Path(args.plot), f"{args.rollouts} rollouts, {train_tokens} tokens, draft vocab {len(vocab)}")
        log(f"plot: {args.plot}")

    # 3. Side by side, batch 1.
    configs = [c.strip() for c in args.draft_len.split(",")]
    policies = {c: DraftLengthBandit(arms=BANDIT_ARMS, seed=args.seed) if c == "bandit" else int(c) for c in configs}
    specs = [f"spec[{c}]" for c in configs]
    spec_stats = {name: SpecStats() for name in specs}
    assistant = None if args.no_assisted else assistant_for(target, args.assistant_layers)
    gc = no_eos_config(target, args.new_tokens, sample=False)

    def runner(name: str, ids: torch.LongTensor, n: int, stats: SpecStats | None = None):
        if name == "plain":
            return lambda: greedy_generate(target, ids, n)
        if name == "assisted":
            config = copy.deepcopy(gc)
            config.max_new_tokens = n
            return lambda: target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                           assistant_model=assistant)[:, ids.shape[1]:]
        policy = policies[name[5:-1]]
        return lambda: speculative_generate(target, drafter, ids, n, draft_len=policy, draft_vocab=vocab,
                                            stats=stats if stats is not None else SpecStats())

    methods = ["plain", *specs] + ([] if assistant is None else ["assisted"])
    warm = torch.tensor([eval_prompts[0]])
    with torch.inference_mode():
        for name in methods:
            runner(name, warm, 6)()
    seconds = dict.fromkeys(methods, 0.0)
    identical = dict.fromkeys(methods[1:], True)
    generated = []
    for i, prompt in enumerate(eval_prompts):
        ids = torch.tensor([prompt])
        order = methods[i % len(methods):] + methods[:i % len(methods)]  # rotate: noise falls on all alike
        outs, this = {}, {}
        for name in order:
            with torch.inference_mode():
                outs[name], this[name] = timed(runner(name, ids, args.new_tokens, spec_stats.get(name)))
            seconds[name] += this[name]
        for name in identical:
            identical[name] &= torch.equal(outs[name], outs["plain"])
        generated.append(outs["plain"][0])
        log(f"held-out prompt {i}: " + ", ".join(f"{k} {args.new_tokens / v:.1f}" for k, v in this.items())
            + " tok/s")
    tokens = args.new_tokens * len(eval_prompts)
    overlap = ngram_overlap(generated, [t for t, _ in sequences])

    log("")
    log(f"batch-1 decoding, {len(eval_prompts)} held-out prompts x {args.new_tokens} new tokens (EOS ignored), "
        f"{args.threads} thread(s)")
    log(f"{'method':<36}{'tok/s':>8}{'vs plain':>10}{'accept_len':>12}{'verify %':>10}{'identical':>11}")
    for name in methods:
        rate, ratio = tokens / seconds[name], seconds["plain"] / seconds[name]
        if name == "plain":
            label, accept, verify = "plain greedy (own loop, KV cache)", "1.00", "-"
        elif name == "assisted":
            label, accept, verify = f"HF assisted, {args.assistant_layers}-layer truncation", "?", "-"
        else:
            st = spec_stats[name]
            label = f"speculative {'bandit' if name == 'spec[bandit]' else 'k=' + name[5:-1]}, EAGLE drafter"
            accept = f"{st.accept_len:.2f}"
            verify = f"{st.verify_seconds / max(st.verify_seconds + st.draft_seconds, 1e-9):.0%}"
        same = "-" if name == "plain" else str(identical[name])
        log(f"{label:<36}{rate:>8.2f}{ratio:>10.2f}{accept:>12}{verify:>10}{same:>11}")
    for name, policy in policies.items():
        if isinstance(policy, DraftLengthBandit):
            summary = {b: {a: (n, round(m, 1)) for a, (n, m) in arms.items()} for b, arms in policy.summary().items()}
            log(f"bandit {{bucket: {{draft_len: (pulls, mean tok/s)}}}}: {summary}")
    log(f"held-out 5-grams seen in the training rollouts: {overlap:.0%}")

    head = specs[0]  # the headline is the first --draft-len
    st = spec_stats[head]
    fields = {
        "accept_len": f"{st.accept_len:.2f}", "speedup": f"{seconds['plain'] / seconds[head]:.2f}",
        "vs_assisted": f"{seconds['assisted'] / seconds[head]:.2f}" if assistant is not None else "na",
        "identical": all(identical[s] for s in specs),
        "assisted_identical": identical["assisted"] if assistant is not None else "na",
        "draft_len": configs[0], "plain_tok_s": f"{tokens / seconds['plain']:.2f}",
        "spec_tok_s": f"{tokens / seconds[head]:.2f}",
        "assisted_tok_s": f"{tokens / seconds['assisted']:.2f}" if assistant is not None else "na",
        "acceptance": f"{st.acceptance:.3f}", "draft_vocab": len(vocab), "rollouts": args.rollouts,
        "train_tokens": train_tokens, "distill_steps": args.steps, "top1": f"{stats.top1_accept:.3f}",
        "ngram_overlap": f"{overlap:.2f}", "threads": args.threads, "bench_s": f"{time.perf_counter() - bench_start:.0f}",
    }
    log(" ".join(f"{k}={v}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
