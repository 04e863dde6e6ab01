"""The rest of the pipeline on every family replay supports (tests/families.py): the HF tree
sampler and speculative decoding give the family's own greedy tokens (windows shorter
than what is decoded, prompts of different lengths left-padded in one batch), the drafter
builds for it, `lsreplay plan` reads a model folder of it, and LoRA adapts its projections.

In float32, the dtype rollouts run in: transformers' eager attention (Gemma 2, GPT-OSS)
gives a left-padded row NaN in float64 (its masks' lowest float64 value becomes -inf in its
float32 softmax), which is transformers' business, not the plain decoding these compare with.
"""

import copy

import pytest
import torch
from conftest import RAW_LOGPROB
from families import MATRIX, tiny
from peft.tuners.lora import LoraLayer

from lsreplay.commands.plan import main as plan_main
from lsreplay.core.config import LoraConfig
from lsreplay.drafter import Drafter
from lsreplay.models.hf_compat import decoder_layers
from lsreplay.models.loading import ModelError
from lsreplay.models.lora import add_adapters
from lsreplay.models.distribution import SamplingParams
from lsreplay.planning.plan import load_plan_config, make_plan
from lsreplay.rollout.position_masks import PositionMasks
from lsreplay.rollout.speculative import SpecStats, greedy_generate, speculative_generate
from lsreplay.replay import naive_backward, replay_backward
from lsreplay.replay.memory import ModelDims, kv_bytes_per_position
from lsreplay.replay.segments import forward_segments, kv_bytes, new_kv
from lsreplay.rollout.tree_sampler import sample_trees
from lsreplay.tree import RolloutTree

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
    cfg, values = load_plan_config("configs/default.yaml", [f"model.path={tmp_path / 'model'}",
                                                            "data.max_prompt_tokens=64"])
    made = make_plan(cfg, values)
    assert made.dims.params() == sum(p.numel() for p in model.parameters())
    assert plan_main(["configs/default.yaml", f"model.path={tmp_path / 'model'}", "data.max_prompt_tokens=64"]) == 0
    assert f"{model.config.num_hidden_layers} layers" in capsys.readouterr().out


def test_lora_takes_the_default_projections_or_names_the_familys_own(model):
    """model.lora's default targets (q/k/v/o, gate/up/down projections) on the family: adapters
    on each of them, or a refusal listing the family's own linear layers (Phi-3 fuses qkv and
    gate/up; GPT-OSS's experts are no linear layers; DeepSeek-V3 compresses its queries)."""
    lora = LoraConfig(enabled=True)
    model = copy.deepcopy(model)
    linear = {name.rpartition(".")[2] for layer in decoder_layers(model) for name, m in layer.named_modules()
              if isinstance(m, torch.nn.Linear)}
    if set(lora.target_modules) <= linear:
        add_adapters(model, lora, seed=0)
        wrapped = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, LoraLayer)}
        assert wrapped == set(lora.target_modules)
    else:
        with pytest.raises(ModelError, match=r"does not have; its decoder layers' linear layers are"):
            add_adapters(model, lora, seed=0)


@pytest.mark.parametrize("model_type, targets", [
    ("gemma2", ["q_proj", "v_proj", "down_proj"]), ("gpt_oss", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("deepseek_v3", ["q_a_proj", "kv_b_proj", "o_proj"])])
def test_replay_trains_the_familys_adapters_exactly(model_type, targets):
    """LoRA adapters on family-specific projections: replay's gradient of every adapter equals
    the per-rollout backward's, in float64."""
    model = add_adapters(copy.deepcopy(tiny(model_type)), LoraConfig(enabled=True, target_modules=targets), seed=0)
    with torch.no_grad():  # adapters away from their zero start, so that their B matrices carry gradient too
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.1)
    tree = RolloutTree.from_sequences(PROMPTS[0], [[40, 41, 42, 43], [40, 41, 44, 45, 46, 47], [48, 49]])
    weights = [[torch.linspace(-1, 1, len(c), dtype=torch.float64) for c in tree.completions]]
    naive_backward(model, [tree], weights, heads=RAW_LOGPROB)
    want = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    replay_backward(model, [tree], weights, heads=RAW_LOGPROB)
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert want.keys() == got.keys() and want and all("lora_" in name for name in want)
    assert max(float((got[n] - w).abs().max() / w.abs().max()) for n, w in want.items()) <= 1e-6


def test_the_memory_model_counts_latents_experts_and_per_layer_heads():
    """What the plan's memory model reads of a family: latent attention caches kv_lora_rank +
    qk_rope_head_dim per position and layer (not the decompressed heads), a mixture of experts
    runs its active experts' MLPs (and a shared one's), Gemma 4's wider global heads count."""
    deepseek = ModelDims.from_hf(tiny("deepseek_v3").config)
    assert deepseek.cached_kv == 16 + 4 and deepseek.head_dim == 8 + 4
    qwen2_moe = ModelDims.from_hf(tiny("qwen2_moe").config)
    assert qwen2_moe.intermediate == 2 * 16 + 16
    gemma4 = ModelDims.from_hf(tiny("gemma4_text").config)  # 2 sliding layers of head_dim 8, 2 global of 16
    assert gemma4.head_dim == 12 and gemma4.cached_kv == 2 * 2 * 12
    with torch.no_grad():  # the K/V the caching pass hands on: what the memory model says, byte for byte
        _, full = forward_segments(tiny("deepseek_v3"), [list(range(10))], 0, None)
    held = kv_bytes(new_kv(full, 0))
    assert held == 10 * kv_bytes_per_position(deepseek, 8)
