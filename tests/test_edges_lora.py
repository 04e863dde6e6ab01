"""Edges of model.lora, against PEFT itself:

- `target_modules` as PEFT takes them: "all-linear" (a YAML string or an override) and
  dotted names (self_attn.q_proj) adapt exactly the modules PEFT's own `get_peft_model`
  adapts with them, on Llama and Qwen2; what they cannot mean is refused with the fix.
- An adapter folder's `base_model_name_or_path` names the base as the run knows it: the
  hub id of a model taken from the local Hugging Face cache (with its snapshot's commit as
  `revision`; PEFT's AutoPeftModelForCausalLM then loads the folder with no path of this
  machine), the shipped SmolLM2's hub id, or the local folder otherwise.
- Building the adapters seeds and restores the CPU generator and leaves every accelerator's
  generators as they were (torch.manual_seed reseeded them and nothing put them back, so a
  process that built the policy drew other numbers than one that did not). No GPU is
  lent here: the accelerator is a stand-in backend (torch's privateuse1, which
  torch.manual_seed reaches as it reaches CUDA) whose generators are real torch.Generators,
  in a process of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import peft
import pytest
import torch
from conftest import tiny_model

from lsreplay.core.config import ConfigError, LoraConfig, ModelConfig, load_config
from lsreplay.core.storage import Store
from lsreplay.models.loading import SMOLLM2_HUB_ID, ModelError
from lsreplay.models.lora import add_adapters, checkpointed_state, write_adapter_folder

REPO = Path(__file__).resolve().parents[1]


def adapted(model) -> set[str]:
    """The names of the modules that carry a LoRA adapter, without PEFT's wrapper prefix."""
    return {name.removeprefix("base_model.model.") for name, m in model.named_modules()
            if isinstance(m, peft.tuners.lora.LoraLayer)}


def by_peft(arch: str, targets) -> set[str]:
    return adapted(peft.get_peft_model(tiny_model(arch), peft.LoraConfig(r=2, target_modules=targets)))


def ours(arch: str, targets: list[str]) -> set[str]:
    return adapted(add_adapters(tiny_model(arch), LoraConfig(enabled=True, rank=2, target_modules=targets), seed=0))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_all_linear_adapts_what_peft_adapts(arch, tmp_path):
    config = tmp_path / "lora.yaml"
    config.write_text("model:\n  lora:\n    enabled: true\n    target_modules: all-linear\n")
    assert load_config(config).model.lora.target_modules == ["all-linear"]
    assert load_config(None, ["model.lora.target_modules=all-linear"]).model.lora.target_modules == ["all-linear"]
    got = ours(arch, ["all-linear"])
    assert got == by_peft(arch, "all-linear") and len(got) == 7 * 2  # seven projections, two layers


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dotted_names_adapt_what_peft_adapts(arch):
    targets = ["self_attn.q_proj", "mlp.down_proj", "layers.1.self_attn.v_proj"]
    got = ours(arch, targets)
    assert got == by_peft(arch, targets)
    assert sorted(got) == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj",
                           "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                           "model.layers.1.self_attn.v_proj"]


@pytest.mark.parametrize("targets, message", [
    (["attn.q_proj"], "does not have.*self_attn.q_proj"),  # a dotted path's end matches whole names only
    (["model.embed_tokens"], "outside the decoder layers"),
    (["self_attn"], "a LlamaAttention, which PEFT cannot wrap"),
])
def test_targets_that_cannot_mean_a_decoder_linear_are_refused(targets, message):
    with pytest.raises(ModelError, match=message):
        ours("llama", targets)


def test_all_linear_goes_alone():
    with pytest.raises(ConfigError, match="all-linear alone"):
        load_config(None, ["model.lora.enabled=true", "model.lora.target_modules=[all-linear,q_proj]"])


def adapter_config(tmp_path, model: ModelConfig) -> dict:
    policy = add_adapters(tiny_model("llama", dtype=torch.float32), model.lora, seed=0)
    write_adapter_folder(Store(str(tmp_path / "store")), "adapter", checkpointed_state(policy), model)
    return json.loads((tmp_path / "store" / "adapter" / "adapter_config.json").read_text())


def test_the_adapter_folder_names_the_hub_id_where_the_run_knows_it(tiny_model_dir, tmp_path, monkeypatch):
    import huggingface_hub
    from peft import AutoPeftModelForCausalLM

    lora = LoraConfig(enabled=True, rank=2, target_modules=["all-linear"])
    folder = adapter_config(tmp_path / "folder", ModelConfig(path=str(tiny_model_dir), lora=lora))
    assert folder["base_model_name_or_path"] == str(tiny_model_dir) and folder["revision"] is None
    assert sorted(folder["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])  # as PEFT writes all-linear
    assert adapter_config(tmp_path / "smol", ModelConfig(lora=lora))["base_model_name_or_path"] == SMOLLM2_HUB_ID

    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model_dir, cache / "models--someone--tiny-llama" / "snapshots" / commit)
    (cache / "models--someone--tiny-llama" / "refs").mkdir()
    (cache / "models--someone--tiny-llama" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cached = adapter_config(tmp_path / "cached", ModelConfig(path="someone/tiny-llama", lora=lora))
    assert (cached["base_model_name_or_path"], cached["revision"]) == ("someone/tiny-llama", commit)
    # PEFT finds the base by that name alone (no path of this machine), offline, from the cache.
    model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "cached" / "store" / "adapter", cache_dir=str(cache))
    assert len(adapted(model)) == 14


STAND_IN = textwrap.dedent("""
    import json, sys, types
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # An accelerator backend with two devices whose generators are real torch.Generators: torch's
    # privateuse1 under a name, which torch.manual_seed reseeds as it reseeds CUDA's.
    torch.utils.rename_privateuse1_backend("standin")
    generators = [torch.Generator().manual_seed(100 + i) for i in range(2)]
    module = types.ModuleType("standin")
    module._is_in_bad_fork = lambda: False
    module.manual_seed_all = lambda seed: [g.manual_seed(seed) for g in generators]
    module.device_count = lambda: len(generators)
    module.is_available = lambda: True
    module.get_rng_state = lambda index=0: generators[index].get_state()
    module.set_rng_state = lambda state, index=0: generators[index].set_state(state)
    torch._register_device_module("standin", module)

    from lsreplay.core.config import LoraConfig
    from lsreplay.models.lora import add_adapters

    def states():
        return [torch.get_rng_state()] + [g.get_state() for g in generators]

    def tiny():
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))

    for g in generators:
        torch.rand(3, generator=g)  # mid-run
    model = tiny()
    before = states()
    add_adapters(model, LoraConfig(enabled=True, rank=2), seed=7)
    after = states()
    again = add_adapters(tiny(), LoraConfig(enabled=True, rank=2), seed=7)
    a = model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    b = again.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    torch.manual_seed(0)  # the stand-in is what torch's seeding reaches
    print(json.dumps({"kept": [torch.equal(x, y) for x, y in zip(before, after)], "same_init": torch.equal(a, b),
                      "reached": not torch.equal(after[1], generators[0].get_state())}))
""")


def test_building_the_adapters_leaves_every_accelerator_generator_as_it_was():
    out = subprocess.run([sys.executable, "-c", STAND_IN], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["reached"]  # torch.manual_seed reseeds the stand-in, as it reseeds CUDA
    assert result["kept"] == [True, True, True]  # the CPU generator put back, the stand-in's untouched
    assert result["same_init"]  # the seed still decides the adapters' initial A
