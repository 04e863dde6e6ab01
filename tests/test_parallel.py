"""Data parallel / FSDP2 branch replay equals one process on the same batch.

Two gloo ranks on CPU run their share of the trees and sum gradients (all-reduce, or
FSDP2's reduce-scatter); after one AdamW step every parameter must equal what a single
process computes: per tensor max|diff| <= 1e-6 * max|value| (float64 tiny Llama; HF's
RMSNorm computes in float32, so a correct result lands near 1e-7 on the gradients).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import RAW_LOGPROB

from lsreplay.distributed.parallel import (
    data_parallel_backward,
    full_grads,
    full_state,
    gathered,
    launch,
    shard_model,
    split_trees,
)
from lsreplay.replay import replay_backward
from lsreplay.replay.capture import capture_tree
from lsreplay.tree import RolloutTree

TOL = 1e-6
LR = 1e-2


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         initializer_range=0.1, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(torch.float64).eval()


def make_batch():
    """Five trees of different sizes and shapes, and global per-token weights."""
    rng = random.Random(0)
    trees = []
    for prompt_len, fan, depth_tokens in [(9, 3, 4), (4, 2, 6), (14, 4, 3), (6, 2, 2), (3, 5, 5)]:
        prompt = [rng.randrange(64) for _ in range(prompt_len)]
        stem = [rng.randrange(64) for _ in range(2)]
        comps = [stem + [rng.randrange(64) for _ in range(rng.randrange(1, depth_tokens + 1))] for _ in range(fan)]
        comps.append([rng.randrange(64) for _ in range(depth_tokens)])
        trees.append(RolloutTree.from_sequences(prompt, comps))
    g = torch.Generator().manual_seed(1)
    weights = [[torch.randn(len(c), generator=g, dtype=torch.float64) / 10 for c in t.completions] for t in trees]
    return trees, weights


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _rank_fn(rank: int, world: int) -> dict:
    trees, weights = make_batch()
    out = {}
    # Plain data parallel, replay with the caching pass's prefix K/V (indexed by batch tree).
    model = make_model()
    acts = [capture_tree(model, t, keep_hidden=False, heads=RAW_LOGPROB) for t in trees]
    opt = adamw(model)
    stats = data_parallel_backward(model, trees, weights, rank, world,
                                   prefix_kv=lambda i, node: acts[i].prefix_kv.get(node.id), heads=RAW_LOGPROB)
    out["dp_grads"], out["dp_positions"] = full_grads(model), stats.positions
    opt.step()
    out["dp_params"] = full_state(model)
    # Plain data parallel, the per-rollout (naive) backward.
    model = make_model()
    data_parallel_backward(model, trees, weights, rank, world, mode="naive", heads=RAW_LOGPROB)
    out["naive_grads"] = full_grads(model)
    # FSDP2: sharded parameters, gradients and AdamW state.
    model = shard_model(make_model())
    opt = adamw(model)  # over the sharded DTensors
    out["fsdp_local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    data_parallel_backward(model, trees, weights, rank, world, fsdp=True, heads=RAW_LOGPROB)
    out["fsdp_grads"] = full_grads(model)
    opt.step()
    out["fsdp_params"] = full_state(model)
    # FSDP2 with fewer trees than ranks: rank 1 has no work but joins every collective;
    # the caching pass runs on the gathered model.
    model = shard_model(make_model())
    with gathered(model):
        acts = [capture_tree(model, trees[0], keep_hidden=False, heads=RAW_LOGPROB)]
    data_parallel_backward(model, trees[:1], weights[:1], rank, world,
                           prefix_kv=lambda i, node: acts[i].prefix_kv.get(node.id), heads=RAW_LOGPROB)
    out["fsdp_one_tree_grads"] = full_grads(model)
    return out if rank == 0 else {"fsdp_local_numel": out["fsdp_local_numel"]}


def _worst(ref: dict, got: dict) -> float:
    worst = 0.0
    for name, r in ref.items():
        g = got[name]
        assert g is not None and g.shape == r.shape, name
        worst = max(worst, ((g - r).abs().max() / r.abs().max().clamp_min(1e-300)).item())
    return worst


def test_split_trees_whole_and_balanced():
    trees, _ = make_batch()
    for ranks in (1, 2, 3, 8):
        split = split_trees(trees, ranks)
        assert sorted(i for part in split for i in part) == list(range(len(trees)))
        assert split == split_trees(trees, ranks)  # deterministic: every rank agrees
    costs = [t.unique_positions for t in trees]
    split = split_trees(trees, 2)
    loads = [sum(costs[i] for i in part) for part in split]
    assert max(loads) - min(loads) <= max(costs)
    # Greedy largest-first, sizes 10, 7, 6, 5, 4 over 2 ranks: 10 | 7, 6 | then 5 to rank 0, 4 to rank 1.
    fake = [RolloutTree.from_sequences([1] * n, [[2]]) for n in (9, 6, 5, 4, 3)]
    assert split_trees(fake, 2) == [[0, 3], [1, 2, 4]]
    assert split_trees(fake, 8)[5:] == [[], [], []]


def test_two_gloo_ranks_equal_one_process():
    trees, weights = make_batch()
    model = make_model()
    ref_stats = replay_backward(model, trees, weights, heads=RAW_LOGPROB)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    adamw(model).step()
    ref_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    model = make_model()
    replay_backward(model, trees[:1], weights[:1], heads=RAW_LOGPROB)
    one_tree_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    r0, r1 = launch(_rank_fn, 2, threads=1)
    assert _worst(ref_grads, r0["dp_grads"]) <= TOL
    assert _worst(ref_grads, r0["naive_grads"]) <= TOL
    assert _worst(ref_grads, r0["fsdp_grads"]) <= TOL
    assert _worst(ref_params, r0["dp_params"]) <= TOL
    assert _worst(ref_params, r0["fsdp_params"]) <= TOL
    assert _worst(one_tree_grads, r0["fsdp_one_tree_grads"]) <= TOL
    assert r0["dp_positions"] == ref_stats.positions  # summed over ranks, padding included
    # FSDP really shards: each rank holds about half of the parameters.
    total = sum(p.numel() for p in model.parameters())
    assert r0["fsdp_local_numel"] + r1["fsdp_local_numel"] == total
    assert max(r0["fsdp_local_numel"], r1["fsdp_local_numel"]) <= 0.55 * total


def _own_sockets() -> list[tuple[str, str]]:
    """(local address, TCP state) of every TCP socket this process holds, IPv4 and IPv6, from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                found.append((fields[1].split(":")[0], fields[3]))
    return found


def _rank_sockets(rank: int, world: int) -> list[tuple[str, str]]:
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank connected to every other
    return _own_sockets()


# Loopback, as /proc writes it: 127.0.0.1 (IPv4), ::1 and ::ffff:127.0.0.1 (IPv6).
LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def test_the_ranks_rendezvous_where_only_this_user_and_host_reach():
    """No socket of any rank listens beyond the loopback interface (before: rank 0's TCP store
    listened on every interface, `::`, with no authentication), and the ranks still meet."""
    per_rank = launch(_rank_sockets, world_size=2, backend="gloo")
    assert all(per_rank), per_rank  # gloo's own sockets are there: the check reads them
    listening = [address for sockets in per_rank for address, state in sockets if state == "0A"]
    assert listening and all(a in LOOPBACK for a in listening), per_rank


def _rank_origin(rank: int, world: int) -> tuple[int, str | None]:
    return os.getppid(), os.environ.get("LSREPLAY_TEST_MARK")


def test_gloo_ranks_fork_from_one_server_with_the_callers_environment(monkeypatch):
    """Gloo ranks fork from one fork server per process (its imports paid once, not by each
    rank of each step), and each sees the environment of the call that launched it, not the
    one the server started with (a test's or a stage's faults and devices)."""
    monkeypatch.setenv("LSREPLAY_TEST_MARK", "first")
    first = launch(_rank_origin, world_size=2, backend="gloo")
    monkeypatch.setenv("LSREPLAY_TEST_MARK", "second")
    second = launch(_rank_origin, world_size=2, backend="gloo")
    monkeypatch.delenv("LSREPLAY_TEST_MARK")
    third = launch(_rank_origin, world_size=2, backend="gloo")
    assert [mark for _, mark in first + second + third] == ["first"] * 2 + ["second"] * 2 + [None] * 2
    servers = {parent for parent, _ in first + second + third}
    assert len(servers) == 1 and servers != {os.getpid()}, (servers, os.getpid())


def test_a_group_that_does_not_form_is_started_again(monkeypatch, caplog):
    """Ranks whose process group fails to form (gloo's mesh on the loopback interface now and
    then does) are started again, up to RENDEZVOUS_TRIES launches; past them the error is raised."""
    from lsreplay.core import faults
    from lsreplay.distributed.parallel import RENDEZVOUS_FAILED, RENDEZVOUS_TRIES

    monkeypatch.setenv(faults.ENV, f"ranks:fail*{RENDEZVOUS_TRIES - 1}")
    faults.reset()
    assert launch(_rank_sockets, world_size=2, backend="gloo")  # formed at the last try
    assert sum(RENDEZVOUS_FAILED in r.getMessage() for r in caplog.records) == RENDEZVOUS_TRIES - 1
    monkeypatch.setenv(faults.ENV, f"ranks:fail*{RENDEZVOUS_TRIES}")
    with pytest.raises(Exception, match=f"{RENDEZVOUS_FAILED}: injected failure"):
        launch(_rank_sockets, world_size=2, backend="gloo")
