"""Synthetic inputs of real shapes for the GPU benchmarks: Qwen2.5-shaped models with random
init, and random per-token weights (trees of a given shape: TreeShape.random_tree)."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lsreplay.tree import RolloutTree

QWEN = {
    # Qwen2.5-0.5B, -1.5B and -7B dimensions (config.json of the released models)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # a tiny Qwen2 for the CPU smoke runs
    "smoke": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
}


def qwen_model(name: str, device: torch.device, dtype: torch.dtype, max_positions: int,
               seed: int = 0) -> Qwen2ForCausalLM:
    """A Qwen2.5-`name`-shaped model with random init, built directly on `device` in `dtype`."""
    torch.manual_seed(seed)
    config = Qwen2Config(**QWEN[name], max_position_embeddings=max_positions, rope_theta=1e6,
                         attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise directly in bf16 on the device: no fp32 copy
    try:
        with device:
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    # Not cast again: the rotary inverse frequencies stay float32, as from_pretrained keeps them.
    return model.eval()  # eval: replay differentiates exactly the cached pass


def random_weights(tree: RolloutTree, seed: int, scale: float = 1e-3) -> list:
    """Per-token weights of one tree's completions (replay_backward's `weights` for [tree]);
    small, so that gradients summed over many tokens stay far from bf16's range limits."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(len(c), generator=g, dtype=torch.float64) * scale for c in tree.completions]]
