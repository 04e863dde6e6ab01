"""The exported drafter folder has vLLM's EAGLE-1 layout and round-trips into lsreplay
(tests/test_vllm.py serves it in vLLM)."""

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file
from transformers import AutoConfig

from lsreplay.core.storage import Store
from lsreplay.drafter import Drafter
from lsreplay.drafter.export import load_hf, save_hf

# Every parameter of vLLM's EagleLlamaForCausalLM that is not shared with the target.
VLLM_EAGLE_NAMES = {"fc.weight", *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
                    "layers.0.post_attention_layernorm.weight"}


def _trained_looking(target) -> Drafter:
    drafter = Drafter.from_target(target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return drafter


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_export_has_vllm_eagle_layout_and_round_trips(tmp_path, arch):
    target = tiny_model(arch, dtype=torch.float32)
    drafter = _trained_looking(target)
    save_hf(Store(str(tmp_path)), "drafter", drafter)

    config = AutoConfig.from_pretrained(tmp_path / "drafter")
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 1 and config.hidden_size == target.config.hidden_size
    assert config.rope_parameters == target.config.rope_parameters
    tensors = load_file(tmp_path / "drafter" / "model.safetensors")
    assert set(tensors) == VLLM_EAGLE_NAMES
    assert torch.equal(tensors["fc.weight"], drafter.fc.weight)

    again = load_hf(Store(str(tmp_path)), "drafter", target)
    ids, hidden = torch.randint(0, 64, (1, 5)), torch.randn(1, 5, 32)
    pos = torch.arange(5)[None]
    assert torch.equal(again(ids, hidden, pos), drafter(ids, hidden, pos))


def test_drafter_of_another_target_is_refused(tmp_path):
    save_hf(Store(str(tmp_path)), "drafter", Drafter.from_target(tiny_model("llama", dtype=torch.float32)))
    other = tiny_model("llama", dtype=torch.float32, hidden_size=48, intermediate_size=96)
    with pytest.raises(ValueError, match="another target"):
        load_hf(Store(str(tmp_path)), "drafter", other)
