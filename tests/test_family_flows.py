"""A real training step (every stage, under Prefect) on tiny random models of three
families the issue names, each with what makes it differ: Qwen3 (query/key norms, a sliding
window), Gemma 3 (sliding-window layers with their own rotary base, softcapped logits,
eager attention is not needed) and GPT-OSS (attention sinks, sliding windows, a mixture of
experts, eager attention). The policy checkpoint's HF folder loads as the family's model.
One step: a second ran the same family code again (its drafter, on the one pool slot, found
the rollouts over and trained nothing), for a third of each run's time."""

import pytest
import torch
from families import BASE, MATRIX
from flowrun import tiny, unique_pool
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lsreplay.core.config import ModelConfig
from lsreplay.models.loading import resolve_model_dir


def family_model_dir(model_type: str, out) -> None:
    """The family's tiny shape at the SmolLM2 tokenizer's vocabulary, saved with that
    tokenizer; its LM head aimed at the digits, so that rewards vary and the update trains
    (as conftest's tiny_model_dir does for Llama)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()), local_files_only=True)
    spec = {**BASE, **MATRIX[model_type], "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.eos_token_id,
            "tie_word_embeddings": False}
    if model_type == "gemma3_text":
        spec.pop("final_logit_softcapping")  # a cap of 3 would keep the digits from standing out
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{k: v for k, v in spec.items()
                                                                                 if v is not None}))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    u = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(u)
        head = model.get_output_embeddings().weight
        head.mul_(0.05)
        head[digits] = u
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "gpt_oss"])
def test_a_step_trains_the_family_and_exports_it(model_type, prefect_server, tmp_path):
    from flows.train import train

    model_dir, run_dir = tmp_path / "model", tmp_path / "run"
    family_model_dir(model_type, model_dir)
    metrics = train(overrides=tiny(run_dir, model_dir, steps=1) + ["data.prompts_per_step=2", "algo.kl_coef=0.05",
                                                                   unique_pool()])
    assert [m["step"] for m in metrics] == [0] and all("loss" in m for m in metrics)
    hf = run_dir / "checkpoints/policy/step_0000/hf"
    exported = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True)
    assert exported.config.model_type == model_type
    base = load_file(str(model_dir / "model.safetensors"))
    trained = exported.state_dict()
    assert any(not torch.equal(base[name], trained[name]) for name in base)
    assert (run_dir / "checkpoints/drafter/step_0000/hf/config.json").is_file()
