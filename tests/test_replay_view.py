"""The replay view (replay/view.py): short branching nodes joined into their children.
Every entry is scored exactly once whatever is joined, replay on a joined view gives the
per-rollout gradient, it runs fewer forward+backward passes, and `lsreplay plan`'s peak
follows the joined shape."""

import pytest
import torch
from conftest import RAW_LOGPROB, tiny_model
from test_replay import fallback_model, grads_of, max_rel_diff, random_trees

from lsreplay.planning.shape import TreeShape
from lsreplay.planning.update import joined_levels, replay_peak
from lsreplay.replay import ActivationMeter, naive_backward, replay_backward
from lsreplay.replay.capture import capture_tree
from lsreplay.replay.memory import ModelDims
from lsreplay.replay.view import read_kv_nodes, replay_view
from lsreplay.tree import RolloutTree


def branchy_tree() -> RolloutTree:
    """A prompt, two 2-token middle nodes of which one branches again after 3 more tokens."""
    a, b = [11, 12], [21, 22]
    comps = [a + [1, 2, 3] + [4, 5], a + [1, 2, 3] + [6], a + [7, 8], b + [9], b + [10, 11, 12]]
    return RolloutTree.from_sequences([50, 51, 52, 53], comps)


def scored_entries(tree: RolloutTree, spans) -> list[tuple[int, int, int]]:
    """(entry id, absolute predicting position, target) of every span entry, checking that
    the span's own tokens sit where the tree has them."""
    out = []
    for span in spans:
        for e, pos, target in zip(span.entry_ids, span.entry_pos, span.entry_targets):
            assert 0 <= pos < len(span.tokens)
            out.append((e, span.start + pos, target))
    return sorted(out)


@pytest.mark.parametrize("join_below", [0, 3, 5, 100])
def test_every_entry_is_scored_once_at_its_position(join_below):
    tree = branchy_tree()
    reference = scored_entries(tree, replay_view(tree, 0))
    spans = replay_view(tree, join_below)
    assert scored_entries(tree, spans) == reference
    assert [e for e, _, _ in reference] == list(range(tree.num_entries))
    for span in spans:  # a span's tokens are its sources' tokens, back to back
        assert span.tokens == [t for s in span.sources for t in tree.nodes[s].tokens]
        assert span.start == tree.nodes[span.sources[0]].start
        for c in span.children:
            assert spans[c].start == span.end and spans[c].parent == span.id


def test_which_nodes_are_joined():
    tree = branchy_tree()
    # branching nodes: 0 the prompt, 1 = a (2 tokens, 2 children), 2 = [1, 2, 3] (3, 2), 6 = b (2, 2)
    assert len(replay_view(tree, 0)) == len(tree.nodes)
    view = replay_view(tree, 3)  # (2 - 1) x 2 < 3: the 2-token nodes join, the 3-token one stays
    assert [len(view[c].tokens) for c in view[0].children] == [5, 4, 3, 5]  # a+[1,2,3], a+[7,8], b+..
    middle = view[view[0].children[0]]
    assert not middle.is_leaf and len(middle.sources) == 2
    assert read_kv_nodes(view) == {0, *middle.sources}
    everything = replay_view(tree, 100)  # all but the root joined: the root's children are the rollouts
    assert all(everything[c].is_leaf for c in everything[0].children)
    assert sorted(everything[c].tokens for c in everything[0].children) == sorted(tree.completions)
    assert read_kv_nodes(everything) == {0}


@pytest.mark.parametrize("join_below", [3, 100])
def test_replay_on_a_joined_view_equals_naive_float64(join_below):
    model = tiny_model("llama")
    trees, weights = random_trees()
    trees.append(branchy_tree())
    weights.append([torch.randn(len(c), dtype=torch.float64) for c in trees[-1].completions])
    naive, g_naive = grads_of(model, naive_backward, trees, weights)
    plain, _ = grads_of(model, replay_backward, trees, weights, budget_bytes=1 << 30)
    joined, g_joined = grads_of(model, replay_backward, trees, weights, budget_bytes=1 << 30,
                                join_below=join_below)
    assert max_rel_diff(g_naive, g_joined) <= 1e-6
    assert joined.objective == pytest.approx(naive.objective, rel=1e-9)
    assert plain.positions < joined.positions < naive.positions


def test_joined_view_reads_the_cached_kv_of_its_sources():
    model = fallback_model("qwen2")
    tree = branchy_tree()
    weights = [[torch.randn(len(c), dtype=torch.float64) for c in tree.completions]]
    acts = capture_tree(model, tree, heads=RAW_LOGPROB)
    asked = []

    def source(index, node):
        asked.append(node.id)
        return acts.prefix_kv[node.id]

    # A budget of one byte keeps no graph: every branching span reads its K/V.
    _, g_self = grads_of(model, replay_backward, [tree], weights, join_below=3, budget_bytes=1)
    _, g_cached = grads_of(model, replay_backward, [tree], weights, prefix_kv=source, join_below=3, budget_bytes=1)
    assert sorted(asked) == sorted(read_kv_nodes(replay_view(tree, 3)))
    # A span's K/V computed in one piece or per node: float16 may round them apart.
    assert max_rel_diff(g_self, g_cached) <= 1e-2


def test_the_caching_pass_forwards_only_the_nodes_whose_kv_the_joined_view_reads():
    """Without scores or hidden states to keep, the pass visits the nodes whose K/V replay
    reads and their ancestors, and keeps only theirs, bit for bit those of a full pass."""
    model = tiny_model("qwen2")
    tree = branchy_tree()
    read = read_kv_nodes(replay_view(tree, 3))
    full = capture_tree(model, tree, keep_hidden=False, heads={})
    calls = count_forwards(model)
    acts = capture_tree(model, tree, keep_hidden=False, heads={}, kv_nodes=read)
    assert set(acts.prefix_kv) == read and len(calls) == len(set().union(*(tree.path(n) for n in read)))
    assert len(calls) < len(full.prefix_kv)  # a joined middle node is not forwarded
    for node in read:
        assert all(torch.equal(a, b) for a, b in zip(acts.prefix_kv[node][0], full.prefix_kv[node][0]))


def count_forwards(model) -> list[int]:
    calls = []
    model.model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_joining_saves_runs():
    model = tiny_model("llama")
    tree = branchy_tree()
    weights = [[torch.randn(len(c), dtype=torch.float64) for c in tree.completions]]
    calls = count_forwards(model)
    replay_backward(model, [tree], weights, budget_bytes=1 << 30, heads=RAW_LOGPROB)
    plain = len(calls)
    calls.clear()
    replay_backward(model, [tree], weights, budget_bytes=1 << 30, join_below=100, heads=RAW_LOGPROB)
    # The budget keeps every branching node's graph, so each runs forward once. plain: 4
    # branching nodes, 3 leaf batches; joined: the root, one batch of all 5 rollouts' answers.
    # (Without kept graphs, each branching node also ran once more for its K/V: 11 and 3.)
    assert (plain, len(calls)) == (7, 2)


def test_plan_follows_the_joined_shape():
    shape = TreeShape.from_rollout(40, [4, 2], [16], 48)
    _, levels = shape.radix()
    assert joined_levels(levels, 0) == ((4, 16), (2, 32))
    assert joined_levels(levels, 64) == ((8, 48),)  # (2 - 1) x 16 < 64
    assert joined_levels(levels, 16) == ((4, 16), (2, 32))
    dims = ModelDims(vocab=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, head_dim=8)
    peak = replay_peak(dims, torch.float64, shape, budget_bytes=1 << 30, join_below=64)
    assert peak.rows == 8 and peak.width == 48 and peak.past == 40


def test_joined_replay_peak_is_what_the_plan_predicts():
    model = tiny_model("llama")
    shape = TreeShape(12, ((3, 4), (2, 6)))
    tree = shape.random_tree(model.config.vocab_size)
    weights = [[torch.randn(len(c), dtype=torch.float64) for c in tree.completions]]
    stats = replay_backward(model, [tree], weights, budget_bytes=1 << 30, meter=ActivationMeter(model),
                            join_below=64, heads=RAW_LOGPROB)
    planned = replay_peak(ModelDims.from_hf(model.config), torch.float64, shape, 1 << 30, join_below=64)
    assert planned.rows == 6
    # within 2%: the shape model spreads the joined nodes' entries evenly over the rows
    assert planned.total == pytest.approx(stats.peak_activation_bytes, rel=0.02)
