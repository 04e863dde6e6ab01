import pytest
import torch

from lsreplay.tree import RolloutTree

PROMPT = [1, 2, 3]
COMPLETIONS = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7], [4], [5, 6, 7, 8]]


def test_trie_shares_prefixes_at_any_depth():
    t = RolloutTree.from_sequences(PROMPT, COMPLETIONS)
    segments = [n.tokens for n in t.nodes]
    assert segments == [[1, 2, 3], [5, 6], [7], [8], [9], [4]]
    assert [n.start for n in t.nodes] == [0, 3, 5, 6, 5, 3]
    assert t.depth == 3
    assert t.total_positions == 5 * 3 + 4 + 3 + 3 + 1 + 4
    assert t.unique_positions == 3 + 6  # prompt + unique completion tokens 5,6,7,8,9,4
    assert t.num_entries == 6


def test_branch_first_tokens_are_predicted_by_the_parent_last_position():
    t = RolloutTree.from_sequences(PROMPT, COMPLETIONS)
    root = t.root
    assert sorted(root.entry_targets) == [4, 5] and set(root.entry_pos) == {2}
    mid = t.nodes[1]  # [5, 6]: predicts 6 at pos 0, and children 7 and 9 at pos 1
    assert list(zip(mid.entry_pos, mid.entry_targets)) == [(0, 6), (1, 7), (1, 9)]


def test_entry_weights_sum_shared_tokens_and_values_map_back():
    t = RolloutTree.from_sequences(PROMPT, COMPLETIONS)
    w = t.entry_weights([torch.ones(len(c)) for c in COMPLETIONS])
    # token 5 is shared by four completions; the duplicate completion counts twice
    assert sorted(w.tolist()) == [1, 1, 2, 3, 4, 4]
    values = torch.arange(t.num_entries, dtype=torch.float64)
    back = t.completion_values(values)
    assert back[0].tolist() == back[4].tolist() and back[2].tolist() == back[0][:3].tolist()


def test_round_trip_and_bad_input():
    t = RolloutTree.from_sequences(PROMPT, COMPLETIONS)
    assert RolloutTree.from_dict(t.to_dict()).to_dict() == t.to_dict()
    with pytest.raises(ValueError, match="non-empty prompt"):
        RolloutTree.from_sequences([], COMPLETIONS)
    with pytest.raises(ValueError, match="completion 1 has 3 tokens but 2 weights"):
        t.entry_weights([[1] * 4, [1] * 2, [1] * 3, [1], [1] * 4])
