"""Context parallelism on the CPU: one tree's prompt replayed by one rank, then split over two
gloo ranks (real processes, lsreplay/distributed/context.py), memory, traffic, time and the
gradients' agreement.

    .venv/bin/python bench/context_parallel.py                        # a 64k-token prompt (run it alone: hours)
    .venv/bin/python bench/context_parallel.py --prompt-tokens 2048   # the same small (under a minute)

One tree: a random prompt of --prompt-tokens tokens and --leaves leaves of --suffix tokens
(distinct first tokens: the trie branches at the prompt's end), random per-token weights, a
tiny random Llama (4 layers, hidden 256, GQA 4/2) in float64, so that the two ways' gradients
can be compared to the last bits that matter. First `replay_backward` on one rank, its prompt
run layer by layer; then the same on --ranks ranks with the prompt split over them
(replay.context_parallel: each rank a contiguous share of it, run layer by layer, the leaves
spread over the ranks, each attending to every share), the gradients summed over the ranks
as the data-parallel reduction sums them. Every rank and the single one run at --threads
torch threads.

The budget (replay.budget_mb) of the single rank is what the prompt holds run layer by layer
(its layer inputs, K/V and their gradient) plus --budget-mb; of each rank, what its share
holds (memory.share_bytes: the share's, and one layer's K/V of the shares before it and their
gradient) plus --budget-mb.

Printed: each rank's peak (ActivationMeter: saved-for-backward bytes and held K/V,
deterministic, unlike the process's memory) next to the single rank's, the bytes each rank
sent to the others (the shares' K/V and their gradients, the leaves' queries and the answers;
not the gradient reduction, which data parallelism has anyway), each one's seconds. On a
2-core machine two ranks of one thread can at best halve the time of one, and the transfers
(local sockets) take the same cores: the time ratio says little of a pool's devices, where
the plan (`lsreplay plan`, pool.interconnect_gbps, pool.device_tflops) times them instead;
the peaks and the bytes sent are what this shows. The last line is key=value pairs:
prompt_tokens, leaves, ranks, single_peak_mib, rank_peak_mib_R, rank_peak_ratio (the largest
rank's peak over the single rank's), sent_mib_R, single_s, ranks_s (the slowest rank's),
time_ratio (single over ranks), max_grad_gap (per tensor max |difference| over max |gradient|
of the single rank, the worst tensor; float64).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import key_values  # noqa: E402
from synthetic import random_weights  # noqa: E402

from lsreplay.distributed.context import ContextParallel, shares  # noqa: E402
from lsreplay.distributed.parallel import all_reduce_grads, launch  # noqa: E402
from lsreplay.models.distribution import RAW  # noqa: E402
from lsreplay.replay import ActivationMeter, replay_backward  # noqa: E402
from lsreplay.replay.heads import logprob_heads  # noqa: E402
from lsreplay.replay.memory import ModelDims, kv_bytes_per_position, layer_by_layer_bytes, share_bytes  # noqa: E402
from lsreplay.tree import RolloutTree  # noqa: E402

MiB = 2**20
ELT = 8  # float64
TOL = 1e-6  # the project's tolerance, of max |gradient| per tensor
HEADS = logprob_heads(RAW)
MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)


def tiny_llama(positions: int) -> LlamaForCausalLM:
    """The same random model in every process (seeded)."""
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, max_position_embeddings=positions, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(torch.float64).eval()  # eval: replay differentiates the forward it runs


def long_tree(prompt: int, leaves: int, suffix: int, vocab: int, seed: int = 0) -> RolloutTree:
    rng = random.Random(seed)
    firsts = rng.sample(range(vocab), leaves)
    return RolloutTree.from_sequences([rng.randrange(vocab) for _ in range(prompt)],
                                      [[f] + [rng.randrange(vocab) for _ in range(suffix - 1)] for f in firsts])


def single_budget(dims: ModelDims, prompt: int, extra: int) -> int:
    return layer_by_layer_bytes(dims, ELT, prompt) + kv_bytes_per_position(dims, ELT) * prompt + extra


def rank_budget(dims: ModelDims, prompt: int, ranks: int, extra: int) -> int:
    """The same on every rank: what the share that holds most holds, plus `extra`."""
    return max(share_bytes(dims, ELT, hi - lo, lo, False) for lo, hi in shares(prompt, ranks)) + extra


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rank(rank: int, world: int, tree: RolloutTree, weights: list, positions: int, budget: int) -> dict:
    """One rank of the split replay: its peak, bytes sent and seconds; rank 0 the summed gradients."""
    model = tiny_llama(positions)
    context = ContextParallel(list(range(world)), rank, threshold=tree.prompt_len)
    start = time.perf_counter()
    stats = replay_backward(model, [tree], weights, budget_bytes=budget, meter=ActivationMeter(model),
                            heads=HEADS, context=context)
    seconds = time.perf_counter() - start
    all_reduce_grads([p for p in model.parameters() if p.requires_grad])
    return {"peak": stats.peak_activation_bytes, "sent": context.traffic.sent, "seconds": seconds,
            "layer_by_layer": stats.layer_by_layer_positions, "grads": grads(model) if rank == 0 else {}}


def worst_gap(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    if ref.keys() != got.keys():
        raise RuntimeError(f"the ranks' gradients cover other parameters: {sorted(ref.keys() ^ got.keys())}")
    return max(float((got[n] - r).abs().max() / r.abs().max().clamp_min(1e-300)) for n, r in ref.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=65536)
    ap.add_argument("--leaves", type=int, default=8)
    ap.add_argument("--suffix", type=int, default=256, help="tokens per leaf")
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks the prompt is split over")
    ap.add_argument("--budget-mb", type=int, default=64, help="each budget beyond what the prompt (or share) holds")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the single rank and of each rank")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    positions = args.prompt_tokens + args.suffix + 64
    model = tiny_llama(positions)
    dims = ModelDims.from_hf(model.config)
    tree = long_tree(args.prompt_tokens, args.leaves, args.suffix, dims.vocab)
    weights = random_weights(tree, seed=1)
    extra = args.budget_mb * MiB
    print(f"tiny Llama {MODEL}, float64, {args.threads} thread(s) a rank; one tree: a prompt of {args.prompt_tokens} "
          f"tokens, {args.leaves} leaves x {args.suffix} tokens", flush=True)

    start = time.perf_counter()
    single = replay_backward(model, [tree], weights, budget_bytes=single_budget(dims, args.prompt_tokens, extra),
                             meter=ActivationMeter(model), heads=HEADS)
    single_s = time.perf_counter() - start
    print(f"1 rank:  peak {single.peak_activation_bytes / MiB:9.1f} MiB, {single_s:8.2f} s "
          f"({single.layer_by_layer_positions} positions layer by layer)", flush=True)

    outs = launch(_rank, args.ranks, args=(tree, weights, positions,
                                            rank_budget(dims, args.prompt_tokens, args.ranks, extra)),
                  threads=args.threads)
    for rank, out in enumerate(outs):
        print(f"rank {rank}: peak {out['peak'] / MiB:9.1f} MiB ({out['peak'] / single.peak_activation_bytes:.3f} of "
              f"1 rank's), sent {out['sent'] / MiB:9.1f} MiB, {out['seconds']:8.2f} s "
              f"({out['layer_by_layer']} positions layer by layer)", flush=True)
    gap = worst_gap(grads(model), outs[0]["grads"])
    ranks_s = max(o["seconds"] for o in outs)
    fields = {"prompt_tokens": args.prompt_tokens, "leaves": args.leaves, "ranks": args.ranks,
              "single_peak_mib": single.peak_activation_bytes / MiB}
    fields |= {f"rank_peak_mib_{r}": o["peak"] / MiB for r, o in enumerate(outs)}
    fields["rank_peak_ratio"] = max(o["peak"] for o in outs) / single.peak_activation_bytes
    fields |= {f"sent_mib_{r}": o["sent"] / MiB for r, o in enumerate(outs)}
    fields |= {"single_s": single_s, "ranks_s": ranks_s, "time_ratio": single_s / ranks_s, "max_grad_gap": gap}
    print(key_values(fields))
    return 0 if gap <= TOL and fields["rank_peak_ratio"] < 1 else 1


if __name__ == "__main__":
    sys.exit(main())
