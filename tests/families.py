"""Tiny random models of every family replay supports (lsreplay.models.families), built from
transformers' own config classes, with what makes each family differ set so that it
matters on short sequences: windows of 4 positions (the test trees run to 17), chunks of 4,
softcaps low enough to bend the logits, scales away from 1."""

from __future__ import annotations

import functools

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 64
WINDOW = 4
# pad/bos/eos inside the tiny vocabulary: some configs default them to ids beyond it.
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            initializer_range=0.1, max_position_embeddings=512, attention_dropout=0.0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

# model_type -> the config keys that make the family differ from Llama, set so that they matter.
MATRIX = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "ministral": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=16, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=2),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "qwen3_moe": dict(MOE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    "phi3": dict(head_dim=None),
    "olmo2": {},
    "olmo3": dict(sliding_window=WINDOW),
    "granite": dict(logits_scaling=2.0, embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.3),
    "glm4": {},
    "smollm3": {},
    "gemma": {},
    "gemma2": dict(sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   query_pre_attn_scalar=8),
    "gemma3_text": dict(sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=8,
                        final_logit_softcapping=3.0),
    "gemma4_text": dict(sliding_window=WINDOW, global_head_dim=16, final_logit_softcapping=3.0,
                        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                        layer_types=["sliding_attention", "full_attention"] * 2),
    "gpt_oss": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "cohere": dict(logit_scale=0.5),
    "cohere2": dict(sliding_window=WINDOW, logit_scale=0.5),
    "starcoder2": dict(sliding_window=WINDOW),
    "exaone4": dict(sliding_window=WINDOW),
    "llama4_text": dict(attention_chunk_size=WINDOW, num_local_experts=4, num_experts_per_tok=1,
                        intermediate_size_mlp=64, interleave_moe_layer_step=1, no_rope_layer_interval=2),
    "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
                        first_k_dense_replace=1, num_key_value_heads=4, head_dim=None),
}

# Families refused at the preflight, each with a config transformers builds.
HYBRIDS = {
    "qwen3_next": dict(MOE, layer_types=["linear_attention", "full_attention"] * 2, shared_expert_intermediate_size=16,
                       linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                       linear_num_value_heads=4),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"] * 2, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
    "lfm2": dict(layer_types=["conv", "full_attention"] * 2, head_dim=None),
}


def hf_config(model_type: str, **overrides) -> transformers.PreTrainedConfig:
    spec = {**BASE, **MATRIX.get(model_type, HYBRIDS.get(model_type, {})), **overrides}
    return AutoConfig.for_model(model_type, **{k: v for k, v in spec.items() if v is not None})


def arch(model_type: str, **overrides) -> dict:
    """The family's tiny shape as `model.arch` takes it (HF config kwargs with a model_type)."""
    spec = {**BASE, **MATRIX.get(model_type, HYBRIDS.get(model_type, {})), **overrides}
    return {"model_type": model_type, **{k: v for k, v in spec.items() if v is not None}}


@functools.lru_cache(maxsize=None)
def tiny(model_type: str, dtype: torch.dtype = torch.float64) -> transformers.PreTrainedModel:
    """The family's tiny model, its embeddings peaked as in a trained LM. Cached: copy it
    before training it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(model_type))
    if hasattr(model, "set_experts_implementation"):  # the grouped-mm experts have no float64 kernel
        model.set_experts_implementation("eager")
    model = model.to(dtype).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=1.0)
    return model
