"""Offline DPO through branch replay vs per-pair training, side by side in one run.

    .venv/bin/python bench/dpo.py [--pairs 4] [--prompt 2048] [--completion 128] [--reps 2] [--smoke]

A preference pair's two answers share its prompt, so offline DPO sees a tree of two leaves
per row (lsreplay.data.preferences). Per DPO step, on the same model, reference and pairs:

    replay    the pipeline's way: a no-grad caching pass of the reference (logprobs) and of
              the policy (logprobs and the prompt's K/V) over each pair's tree, the DPO
              loss's per-token weights, then `replay_backward`: the prompt runs once per pair
    per-pair  a DPO trainer's way (TRL's, one pair at a time): the reference's logprobs of
              the chosen and the rejected sequence (prompt + answer each), then the policy's
              with grad, the pair's loss, backward: the prompt runs twice per pair, twice

Timed interleaved, after a warm-up, the minimum of --reps. The model is bench/replay.py's
one wide decoder layer (float32, sdpa, GQA): width, not depth, decides what a shared
prompt saves; random prompts and answers (the cost does not depend on the tokens). The
reference is the policy with a little noise, so the margins and the gradient are not 0.

    ideal    = positions run forward and backward, per-pair over replay: 2(P+C) / (P+2C)
               per pair (replay's no-grad caching pass of the policy comes on top; both
               sides run the reference's no-grad pass, replay's over the tree)
    speedup  = per-pair seconds / replay seconds, everything of the step counted
    mem_ratio = replay's peak / per-pair's peak (ActivationMeter: saved for backward + held
               K/V; on CUDA the allocator's peaks are printed beside them)

and the max relative gradient difference (float32: <= 1e-4). The last line is key=value.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lsreplay.algos.backward import activations_kv, capture_logprobs, naive_loss_backward  # noqa: E402
from lsreplay.algos.dpo import dpo_loss, sequence_logprobs  # noqa: E402
from lsreplay.algos.weights import loss_and_weights  # noqa: E402
from lsreplay.models.distribution import RAW  # noqa: E402
from lsreplay.replay.backward import replay_backward  # noqa: E402
from lsreplay.replay.capture import capture_rollouts  # noqa: E402
from lsreplay.replay.heads import logprob_heads  # noqa: E402
from lsreplay.replay.memory import ActivationMeter, device_peak_bytes, reset_device_peak  # noqa: E402
from lsreplay.tree import RolloutTree  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_replay", REPO / "bench" / "replay.py")
bench_replay = importlib.util.module_from_spec(_spec)
sys.modules["bench_replay"] = bench_replay  # its dataclasses look their module up
_spec.loader.exec_module(bench_replay)

BETA = 0.1
PAIR = [[(0, 1)]]  # a row's tree: leaf 0 chosen, leaf 1 rejected


def make_pairs(n: int, prompt: int, completion: int, vocab: int, seed: int) -> list[RolloutTree]:
    """Preference rows as trees: a random prompt, two random answers with distinct first tokens."""
    rng = random.Random(seed)
    trees = []
    for _ in range(n):
        first = rng.sample(range(vocab), 2)
        answers = [[f] + [rng.randrange(vocab) for _ in range(completion - 1)] for f in first]
        trees.append(RolloutTree.from_sequences([rng.randrange(vocab) for _ in range(prompt)], answers))
    return trees


def reference_of(model, seed: int):
    """The frozen reference: the policy plus a little noise."""
    ref = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=g).to(p))
    return ref


def replay_step(model, reference, trees: list[RolloutTree]) -> dict:
    """The reference's and the policy's caching passes, DPO's weights, the replay backward."""
    ref_lp, _ = capture_logprobs(reference, trees, keep_kv=False, heads=logprob_heads(RAW))
    ref = [s.detach() for s in sequence_logprobs(ref_lp)]
    logprobs, acts = capture_logprobs(model, trees, heads=logprob_heads(RAW))
    pairs = PAIR * len(trees)
    loss, weights = loss_and_weights(lambda lp: dpo_loss(lp, pairs, ref, BETA), logprobs)
    stats = replay_backward(model, trees, weights, prefix_kv=activations_kv(acts), meter=ActivationMeter(model),
                            heads=logprob_heads(RAW))
    return {"loss": loss, "positions": stats.positions, "peak": stats.peak_activation_bytes}


def per_pair_step(model, reference, trees: list[RolloutTree]) -> dict:
    """One pair at a time: the reference's sequences, then the policy's with grad, backward."""
    meter, loss, positions = ActivationMeter(model), 0.0, 0
    with meter.measure():
        for tree in trees:
            scored = capture_rollouts(reference, tree, heads=logprob_heads(RAW))
            ref = [sequence_logprobs([tree.completion_values(scored.entry_logprobs)])[0]]
            loss += naive_loss_backward(model, [tree], lambda lp, ref=ref: dpo_loss(lp, PAIR, ref, BETA) / len(trees),
                                        heads=logprob_heads(RAW))
            positions += tree.total_positions  # forward and backward, each sequence whole
    return {"loss": loss, "positions": positions, "peak": meter.peak}


def grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def timed(step, model, reference, trees) -> tuple[dict, float, list[torch.Tensor], int | None]:
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    reset_device_peak(device)
    start = time.perf_counter()
    out = step(model, reference, trees)
    seconds = time.perf_counter() - start
    return out, seconds, grads(model), device_peak_bytes(device)


MODEL_SPEC = bench_replay.MODEL


def main(argv: list[str] | None = None) -> int:
    global MODEL_SPEC
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens each pair shares")
    ap.add_argument("--completion", type=int, default=128, help="tokens of each answer")
    ap.add_argument("--reps", type=int, default=2, help="timed repeats (the minimum is kept)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="a tiny model and pairs, for the test suite")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.smoke:
        MODEL_SPEC = bench_replay.SMOKE_MODEL
        args.pairs, args.prompt, args.completion, args.reps = 2, 64, 8, 1
    torch.set_num_threads(args.threads)
    model = bench_replay.make_model(MODEL_SPEC, args.seed).to(args.device)
    reference = reference_of(model, args.seed)
    trees = make_pairs(args.pairs, args.prompt, args.completion, MODEL_SPEC["vocab_size"], args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama {MODEL_SPEC['num_hidden_layers']} layer(s), hidden {MODEL_SPEC['hidden_size']}, "
          f"{n_params / 1e6:.1f}M params, float32, {args.device}, {torch.get_num_threads()} threads; "
          f"{args.pairs} pairs, prompt {args.prompt}, answers {args.completion}; min of {args.reps}", flush=True)
    warm = make_pairs(1, 16, 4, MODEL_SPEC["vocab_size"], args.seed + 1)
    replay_step(model, reference, warm), per_pair_step(model, reference, warm)

    best = {"replay": math.inf, "per_pair": math.inf}
    rel = 0.0
    for _ in range(args.reps):  # interleaved: both see the same machine load
        pp, pp_s, pp_g, pp_dev = timed(per_pair_step, model, reference, trees)
        rp, rp_s, rp_g, rp_dev = timed(replay_step, model, reference, trees)
        best = {"replay": min(best["replay"], rp_s), "per_pair": min(best["per_pair"], pp_s)}
        rel = max(rel, max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(rp_g, pp_g)))
    ideal = pp["positions"] / rp["positions"]
    speedup = best["per_pair"] / best["replay"]
    print(f"{'':9} {'seconds':>8} {'positions':>10} {'peak MiB':>9} {'device MiB':>10} {'loss':>9}")
    for name, r, s, dev in (("per-pair", pp, best["per_pair"], pp_dev), ("replay", rp, best["replay"], rp_dev)):
        device = f"{dev / 2**20:.1f}" if dev is not None else "n/a"
        print(f"{name:9} {s:>8.2f} {r['positions']:>10} {r['peak'] / 2**20:>9.1f} {device:>10} {r['loss']:>9.5f}")
    kv = {"replay_s": f"{best['replay']:.3f}", "per_pair_s": f"{best['per_pair']:.3f}", "speedup": f"{speedup:.3f}",
          "ideal": f"{ideal:.3f}", "replay_peak_mib": f"{rp['peak'] / 2**20:.1f}",
          "per_pair_peak_mib": f"{pp['peak'] / 2**20:.1f}", "mem_ratio": f"{rp['peak'] / pp['peak']:.3f}",
          "loss_gap": f"{abs(rp['loss'] - pp['loss']):.2e}", "grad_rel_diff": f"{rel:.3e}"}
    print(" ".join(f"{k}={v}" for k, v in kv.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
