"""The exported drafter folder loads in plain transformers and round-trips into lsreplay."""

import torch
from conftest import tiny_model
from transformers import AutoConfig, AutoModel

from lsreplay.drafter import Drafter
from lsreplay.drafter.export import load_hf, save_hf
from lsreplay.storage import Store


def test_export_loads_with_transformers_and_back(tmp_path):
    target = tiny_model("llama", dtype=torch.float32)
    drafter = Drafter.from_target(target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_hf(Store(str(tmp_path)), "drafter", drafter)

    config = AutoConfig.from_pretrained(tmp_path / "drafter")
    assert config.num_hidden_layers == 1 and config.architectures == ["LlamaForCausalLMEagle"]
    layer_only = AutoModel.from_pretrained(tmp_path / "drafter")  # a one-layer LlamaModel
    for name, value in drafter.layer.state_dict().items():
        assert torch.equal(layer_only.layers[0].state_dict()[name], value)

    again = load_hf(Store(str(tmp_path)), "drafter", target)
    ids, hidden = torch.randint(0, 64, (1, 5)), torch.randn(1, 5, 32)
    pos = torch.arange(5)[None]
    assert torch.equal(again(ids, hidden, pos), drafter(ids, hidden, pos))
