"""replay_backward == naive_backward, and the stored prefix K/V path (verified, recomputed when bad)."""

import logging

import pytest
import torch
from conftest import RAW_LOGPROB, tiny_model

from lsreplay.replay import naive_backward, replay_backward
from lsreplay.replay.capture import capture_rollouts, capture_tree
from lsreplay.tree import RolloutTree


def random_trees(vocab=64, seed=1):
    """Two trees: a shared prompt, branch points inside the answer, uneven leaves, a rollout
    ending where another continues, a duplicate, different prompt lengths."""
    g = torch.Generator().manual_seed(seed)

    def rnd(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    trees = []
    for prompt_len in (7, 12):
        a, b = rnd(3), rnd(4)
        comps = [a + b + rnd(5), a + b + rnd(2), a + rnd(6), a + b, a + b + rnd(3), rnd(4), a + rnd(6)[:0] + b]
        trees.append(RolloutTree.from_sequences(rnd(prompt_len), comps))
    weights = [[torch.randn(len(c), generator=g, dtype=torch.float64) for c in t.completions] for t in trees]
    return trees, weights


def fallback_model(arch: str = "llama"):
    """A tiny model cascade attention does not take (float16: the CPU's flash kernel has
    none), whose branching nodes a budget of a byte sends to the fallback: their K/V read
    from the source, each run again after its subtree (memory.kept_spans). A model it takes
    refuses such a budget."""
    return tiny_model(arch, dtype=torch.float16)


def grads_of(model, fn, *args, **kwargs):
    """`fn` (replay_backward or naive_backward) of the policy's own logprobs, and the gradient."""
    model.zero_grad()
    stats = fn(model, *args, heads=RAW_LOGPROB, **kwargs)
    return stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_diff(a, b):
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).abs().max() / a[n].abs().max()).item() for n in a)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_replay_equals_naive_float64(arch):
    model = tiny_model(arch)
    trees, weights = random_trees()
    assert trees[0].depth >= 2  # a branch point inside the answer
    naive, g_naive = grads_of(model, naive_backward, trees, weights)
    replay, g_replay = grads_of(model, replay_backward, trees, weights)
    assert max_rel_diff(g_naive, g_replay) <= 1e-6
    assert replay.objective == pytest.approx(naive.objective, rel=1e-9)
    # every unique position once (plus padding of micro-batched leaves), far below per-rollout
    assert sum(t.unique_positions for t in trees) <= replay.positions < naive.positions


def test_replay_with_micro_batched_leaves_float32():
    model = tiny_model("llama", dtype=torch.float32)
    trees, weights = random_trees(seed=2)
    _, g_naive = grads_of(model, naive_backward, trees, weights)
    # a large budget puts all sibling leaves in one padded micro-batch
    _, g_replay = grads_of(model, replay_backward, trees, weights, budget_bytes=1 << 30)
    assert max_rel_diff(g_naive, g_replay) <= 1e-4


def test_cached_prefix_kv_gives_identical_gradients():
    model = tiny_model("llama")
    trees, weights = random_trees()
    acts = [capture_tree(model, t, heads=RAW_LOGPROB) for t in trees]
    _, g_self = grads_of(model, replay_backward, trees, weights)
    _, g_cached = grads_of(model, replay_backward, trees, weights,
                           prefix_kv=lambda i, node: acts[i].prefix_kv[node.id])
    assert all(torch.equal(g_self[n], g_cached[n]) for n in g_self)


def test_per_rollout_logprob_pass_matches_the_tree_pass():
    model = tiny_model("qwen2")
    trees, _ = random_trees(seed=4)
    for tree in trees:
        per_rollout = capture_rollouts(model, tree, batch=3, heads=RAW_LOGPROB)
        tree_pass = capture_tree(model, tree, heads=RAW_LOGPROB)
        assert not per_rollout.prefix_kv and not per_rollout.hidden
        assert torch.allclose(per_rollout.entry_logprobs, tree_pass.entry_logprobs, rtol=0, atol=1e-10)


def test_caching_pass_logprobs_match_per_rollout_forward():
    model = tiny_model("qwen2")
    trees, weights = random_trees()
    for tree in trees:
        acts = capture_tree(model, tree, heads=RAW_LOGPROB)
        per_completion = tree.completion_values(acts.entry_logprobs)
        for j, comp in enumerate(tree.completions):
            with torch.no_grad():
                logits = model(torch.tensor([tree.prompt_ids + comp])).logits[0].double()
            lp = logits.log_softmax(-1)[tree.prompt_len - 1 : -1].gather(-1, torch.tensor(comp)[:, None])[:, 0]
            assert torch.allclose(lp, per_completion[j], atol=1e-9)


def test_stored_prefix_kv_corrupt_or_missing_is_recomputed(tmp_path, caplog):
    """The pipeline's store-backed source: sha256 checked; bad entries recomputed with a warning."""
    from lsreplay.core.config import load_config
    from lsreplay.core.run import Run
    from lsreplay.stages.prefixes import StoredPrefixKV, kv_key, kv_tensors

    model = fallback_model()
    trees, weights = random_trees()
    run = Run(load_config(None, [f"run_dir={tmp_path}"]))
    acts = [capture_tree(model, t, heads=RAW_LOGPROB) for t in trees]
    entries = [{str(n): run.store.write_tensors(kv_key(run, 0, i, n), kv_tensors(kv))
                for n, kv in a.prefix_kv.items()} for i, a in enumerate(acts)]
    # A budget of a byte keeps no graph: every branching node's K/V is read from the source.
    _, g_reference = grads_of(model, replay_backward, trees, weights, budget_bytes=1)

    corrupt, missing = entries[0]["0"], entries[1]["0"]
    path = tmp_path / corrupt["key"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    (tmp_path / missing["key"]).unlink()

    source = StoredPrefixKV(run, {"prefix_kv": entries})
    served = []
    with caplog.at_level(logging.WARNING):
        _, g = grads_of(model, replay_backward, trees, weights, budget_bytes=1,
                        prefix_kv=lambda i, n: served.append((i, n.id)) or source(i, n))
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "tree 0 node 0" in messages and "sha256" in messages.lower()
    assert "tree 1 node 0" in messages and "recomputing" in messages
    assert "recomputed 2 prefix K/V" in messages
    assert max_rel_diff(g_reference, g) <= 1e-12


def test_host_offloaded_prefix_kv_is_served_from_memory(tmp_path):
    from lsreplay.core.config import load_config
    from lsreplay.core.run import Run
    from lsreplay.stages.prefixes import HOST_KV, StoredPrefixKV, kv_key, kv_tensors

    model = fallback_model()
    trees, weights = random_trees()
    run = Run(load_config(None, [f"run_dir={tmp_path}", "replay.kv_offload=host"]))
    acts = [capture_tree(model, t, heads=RAW_LOGPROB) for t in trees]
    entries = []
    for i, a in enumerate(acts):
        entries.append({})
        for n, kv in a.prefix_kv.items():
            entry = run.store.write_tensors(kv_key(run, 0, i, n), kv_tensors(kv))
            entries[i][str(n)] = entry
            HOST_KV[entry["sha256"]] = kv
            (tmp_path / entry["key"]).unlink()  # only host memory has them now
    _, g_reference = grads_of(model, replay_backward, trees, weights, budget_bytes=1)  # no graph kept: K/V read
    _, g = grads_of(model, replay_backward, trees, weights, budget_bytes=1,
                    prefix_kv=StoredPrefixKV(run, {"prefix_kv": entries}))
    assert all(torch.equal(g_reference[n], g[n]) for n in g) and not HOST_KV
