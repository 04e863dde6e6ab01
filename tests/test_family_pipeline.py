"""The rest of the pipeline on every family replay supports (tests/families.py): the HF tree
sampler and speculative decoding give the family's own greedy tokens (windows shorter
than what is decoded, prompts of different lengths left-padded in one batch), the drafter
builds for it, and `lsreplay plan` reads a model folder of it.

In float32, the dtype rollouts run in: transformers' eager attention (Gemma 2, GPT-OSS)
gives a left-padded row NaN in float64 (its masks' lowest float64 value becomes -inf in its
float32 softmax), which is transformers' business, not the plain decoding these compare with.
"""

import pytest
import torch
from families import MATRIX, tiny

from lsreplay.commands import plan
from lsreplay.drafter import Drafter
from lsreplay.models.distribution import SamplingParams
from lsreplay.rollout.position_masks import PositionMasks
from lsreplay.rollout.speculative import SpecStats, greedy_generate, speculative_generate
from lsreplay.rollout.tree_sampler import sample_trees

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
NEW = 16  # tokens decoded: four windows' worth
NO_EOS = 10_000  # beyond the vocabulary: every sequence runs to NEW tokens


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture(params=sorted(MATRIX))
def model(request):
    return tiny(request.param, torch.float32)


def plain_greedy(model, prompt: list[int]) -> list[int]:
    return greedy_generate(model, [prompt], NEW, eos_token_id=NO_EOS)[0].tolist()


def test_tree_sampler_greedy_equals_plain_decoding(model):
    trees, _ = sample_trees(model, PROMPTS, [2, 1], [5], NEW, SamplingParams(temperature=0.0), NO_EOS,
                            [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))])
    for prompt, tree in zip(PROMPTS, trees):
        assert tree.completions == [plain_greedy(model, prompt)] * 2


def test_speculative_decoding_greedy_equals_plain_decoding(model):
    """An untrained drafter, whose drafts are rejected where the model does not repeat itself,
    a different number per row: holes in the rows' caches (position_masks.py)."""
    ids, mask = left_padded(PROMPTS)
    stats = SpecStats()
    out = speculative_generate(model, Drafter.from_target(model), ids, NEW, draft_len=3, eos_token_id=NO_EOS,
                               attention_mask=mask, stats=stats)
    assert [row.tolist() for row in out] == [plain_greedy(model, p) for p in PROMPTS]
    assert stats.drafted > 0


def test_position_masks_follow_positions_across_holes():
    """A row with a hole (a rejected draft) and left padding: a window of 2 positions sees the
    last two visible columns, not the last two columns."""
    masks = PositionMasks(tiny("mistral", torch.float32).config)  # every layer: a window of 4
    columns = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = masks(columns, 2, torch.float32)  # the last two columns are the queries
    seen = mask[:, 0] == 0
    # row 0: visible columns 1, 2, 3, 6, 7 hold positions 0..4; the query at position 4 sees 1..4
    assert seen[0, 1].tolist() == [False, False, True, True, False, False, True, True]
    assert seen[0, 0].tolist() == [False, True, True, True, False, False, True, False]
    assert seen[1, 1].tolist() == [False, False, False, False, True, True, True, True]


def test_plan_reads_a_model_folder_of_the_family(model, tmp_path, capsys):
    """Its weights counted as the model has them (every expert's), its layers named."""
    model.save_pretrained(tmp_path / "model")
    cfg, values = plan.load_plan_config("configs/default.yaml", [f"model.path={tmp_path / 'model'}",
                                                                 "data.max_prompt_tokens=64"])
    made = plan.make_plan(cfg, values)
    assert made.dims.params() == sum(p.numel() for p in model.parameters())
    assert plan.main(["configs/default.yaml", f"model.path={tmp_path / 'model'}", "data.max_prompt_tokens=64"]) == 0
    assert f"{model.config.num_hidden_layers} layers" in capsys.readouterr().out
