"""model.lora: a real one-step GRPO run with LoRA adapters and a KL term trains the adapters
alone; its checkpoint's PEFT folder loads with PEFT itself; `lsreplay export` writes the
merged HF model folder or the adapters; the reference is the base with the adapters off.
(Exact gradients with adapters: test_replay_equivalence.py; resume: test_resume.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from flowrun import tiny

from lsreplay import cli
from lsreplay.core.config import load_config
from lsreplay.models.lora import adapters_off, is_adapter
from lsreplay.state.checkpoint import load_module
from lsreplay.state.resident import policy_model
from lsreplay.core.run import Run

LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "algo.kl_coef=0.1",
        "reward.function=tests.varied_rewards:code_parity",
        "drafter.enabled=false"]
IDS = torch.tensor([[1, 5, 9, 200, 17, 3000, 42, 7]])


@pytest.fixture(scope="module")
def lora_run(prefect_server, tiny_model_dir, tmp_path_factory):
    from flows.train import train

    run_dir = tmp_path_factory.mktemp("lora") / "run"
    overrides = [*tiny(run_dir, tiny_model_dir, steps=1), *LORA]
    train(overrides=overrides)
    return run_dir, load_config(None, overrides)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def base(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_only_the_adapters_train(lora_run):
    run_dir, cfg = lora_run
    ckpt = run_dir / "checkpoints/policy/step_0000"
    weights = load_file(ckpt / "model.safetensors")
    adapters = {n for n, _ in policy_model(cfg, "cpu").named_parameters() if is_adapter(n)}
    assert set(weights) == adapters  # masters of the adapters alone, no base weights
    assert all(weights[n].abs().max() > 0 for n in adapters if ".lora_B." in n)  # B left zero: it trained
    moments = [k for k in load_file(ckpt / "optimizer.safetensors") if k.endswith(".exp_avg")]
    assert len(moments) == len(adapters)  # AdamW state for them alone
    assert not (ckpt / "hf").exists()  # no copy of the base per checkpoint


def test_the_checkpoints_adapter_folder_loads_with_peft(lora_run, tiny_model_dir):
    run_dir, cfg = lora_run
    folder = run_dir / "checkpoints/policy/step_0000/adapter"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert sorted(config["target_modules"]) == sorted(cfg.model.lora.target_modules)
    peft_model = PeftModel.from_pretrained(base(tiny_model_dir), folder).eval()
    ours = policy_model(cfg, "cpu")
    run = Run(cfg)
    load_module(run.store, "checkpoints/policy/step_0000", ours)
    assert torch.allclose(logits(peft_model), logits(ours), atol=1e-6, rtol=0)
    assert (logits(peft_model) - logits(base(tiny_model_dir))).abs().max() > 1e-4  # the adapters do something


def test_export_writes_the_merged_model_or_the_adapters(lora_run, tiny_model_dir, tmp_path):
    run_dir, _ = lora_run
    assert cli.main(["export", str(run_dir), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert not any("lora" in n or "base_layer" in n for n in merged.state_dict())
    assert cli.main(["export", str(run_dir), str(tmp_path / "adapters"), "--adapters"]) == 0
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    peft_model = PeftModel.from_pretrained(base(tiny_model_dir), tmp_path / "adapters").eval()
    assert torch.allclose(logits(merged), logits(peft_model), atol=1e-5, rtol=0)


def test_the_reference_is_the_base_with_the_adapters_off(lora_run, tiny_model_dir):
    run_dir, cfg = lora_run
    policy = policy_model(cfg, "cpu")
    load_module(Run(cfg).store, "checkpoints/policy/step_0000", policy)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    with adapters_off(policy):
        off = logits(policy)
    assert torch.equal(off, logits(base(tiny_model_dir)))
    assert not torch.equal(logits(policy), off)  # on again after the block
    assert [n for n, p in policy.named_parameters() if p.requires_grad] == trainable


def test_bfloat16_adapters_train_on_float32_masters_of_their_own(tiny_model_dir):
    """Mixed precision with LoRA: bf16 adapters on the bf16 base, float32 masters and AdamW for
    the adapters alone, started from the same seeded values as a float32 copy's."""
    from lsreplay.state.resident import policy_train_state

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "model.dtype=bfloat16", *LORA[:3]])
    model = policy_model(cfg, "cpu")
    train = policy_train_state(cfg, model)
    assert train.mixed and train.names and all(is_adapter(n) for n in train.names)
    assert {m.dtype for m in train.masters} == {torch.float32}
    float32 = dict(policy_model(cfg, "cpu", dtype="float32").named_parameters())
    assert all(torch.equal(p, float32[n].to(torch.bfloat16)) for n, p in model.named_parameters() if is_adapter(n))
