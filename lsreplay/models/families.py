"""The model families replay is exact on, and what differs between them.

Replay recomputes a family's hidden states in pieces (a prefix once, each branch on the
prefix's keys/values) and its logits from the last hidden states; it is exact only where
every piece computes what the family's own forward computes. The family matrix
(tests/test_families.py) checks that per family, in float64, against the family's own HF
forward and backward, with windows, chunks and softcaps set so that they matter. So this
is an allow-list: a family transformers adds is refused until the matrix covers it, never
trained on a silently wrong gradient.

What a family may differ in, and where replay handles it:
- the logits after the LM head (a final softcap, a scale): `lm_logits`, used by
  models/logits.py for every logprob lsreplay computes;
- attention (sliding windows, chunks, softcaps, sinks, latent attention): replay/attention/;
- how replay reaches the decoder stack (`decoder`): `model.model` where the causal LM holds
  it there (Llama 4's base_model_prefix names an attribute it does not have).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from lsreplay.models.loading import ModelError

Logits = Callable[[object, torch.Tensor], torch.Tensor]  # (text config, logits) -> logits


def _raw(config, logits: torch.Tensor) -> torch.Tensor:
    return logits


def _final_softcap(config, logits: torch.Tensor) -> torch.Tensor:
    cap = config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _logit_scale(config, logits: torch.Tensor) -> torch.Tensor:
    return logits * config.logit_scale


def _logits_scaling(config, logits: torch.Tensor) -> torch.Tensor:
    return logits / config.logits_scaling


def _no_kv_sharing(config) -> str | None:
    if getattr(config, "num_kv_shared_layers", 0):
        return (f"its last {config.num_kv_shared_layers} layers reuse earlier layers' keys and values "
                "(num_kv_shared_layers); replay does not yet hand shared keys and values across branch points "
                "(docs/models.md)")
    return None


def _nothing_refused(config) -> str | None:
    return None


@dataclass(frozen=True)
class Family:
    """One model_type replay is tested exact on.

    cascade: replay's runs may attend to their prefix through cascade attention
    (replay/cascade.py); False where the family's attention module reads the cache for more
    than its keys and values (Llama 4's temperature tuning takes positions from the cache's
    length, which cascade's cache does not hold), so replay runs it on HF's own attention.
    logits: what the family's causal LM does to the LM head's output.
    refuses: why a config of the family is refused all the same (None: it is not)."""

    model_type: str
    name: str
    cascade: bool = True
    logits: Logits = _raw
    note: str = ""
    refuses: Callable[[object], str | None] = _nothing_refused


FAMILIES = {f.model_type: f for f in (
    Family("llama", "Llama"),
    Family("mistral", "Mistral", note="sliding window (sliding_window)"),
    Family("ministral", "Ministral", note="sliding window on the layers layer_types names"),
    Family("qwen2", "Qwen2 / Qwen2.5", note="sliding window with use_sliding_window (above max_window_layers)"),
    Family("qwen2_moe", "Qwen2-MoE", note="mixture of experts with a shared expert"),
    Family("qwen3", "Qwen3", note="query/key norms; sliding window with use_sliding_window"),
    Family("qwen3_moe", "Qwen3-MoE", note="mixture of experts"),
    Family("mixtral", "Mixtral", note="mixture of experts; sliding window"),
    Family("phi3", "Phi-3", note="fused qkv and gate/up projections"),
    Family("olmo2", "OLMo 2"),
    Family("olmo3", "OLMo 3", note="sliding window on three of four layers"),
    Family("granite", "Granite", logits=_logits_scaling, note="logits divided by logits_scaling"),
    Family("glm4", "GLM-4"),
    Family("smollm3", "SmolLM3", note="no rotary embedding on every fourth layer"),
    Family("gemma", "Gemma"),
    Family("gemma2", "Gemma 2", logits=_final_softcap,
           note="attention and final logit softcapping; sliding window on alternate layers"),
    Family("gemma3_text", "Gemma 3 (text)", logits=_final_softcap,
           note="sliding window on five of six layers, their own rotary base; query/key norms"),
    Family("gemma4_text", "Gemma 4 (text)", logits=_final_softcap,
           note="sliding window on five of six layers; wider heads on the global layers; per-layer inputs",
           refuses=_no_kv_sharing),
    Family("gpt_oss", "GPT-OSS", note="attention sinks; sliding window on alternate layers; mixture of experts"),
    Family("cohere", "Cohere (Command R)", logits=_logit_scale, note="logits times logit_scale"),
    Family("cohere2", "Cohere 2 (Command R7B)", logits=_logit_scale,
           note="sliding window on three of four layers; logits times logit_scale"),
    Family("starcoder2", "StarCoder2", note="sliding window; layer norms with biases"),
    Family("exaone4", "EXAONE 4", note="sliding window on three of four layers"),
    Family("llama4_text", "Llama 4 (text)", cascade=False,
           note="chunked attention; no rotary embedding and attention temperature tuning on every fourth layer; "
                "mixture of experts"),
    Family("deepseek_v3", "DeepSeek-V3", note="multi-head latent attention (value heads narrower than "
                                              "query/key heads); mixture of experts with grouped routing"),
)}

# Families whose rollouts the vLLM engine (rollout.engine=vllm) is tested to serve as the policy
# computes them, weights synced after each update: a Llama (tests/test_vllm.py, the flow), a
# tied Qwen3 with its query/key norms (test_vllm_engine.py), a Qwen2 with its biases and LoRA
# adapters (test_vllm_lora.py). The others run on the HF engine until a test covers them.
VLLM_TESTED = ("llama", "qwen2", "qwen3")

# Families transformers ships that replay refuses, with why (the others: not yet in the matrix).
HYBRID = ("their linear-attention or state-space layers carry a fixed-size state from one position to the next; "
          "replay would have to hand that state (and its gradient) across each branch point as it hands keys "
          "and values, which it does not yet (docs/models.md)")
REFUSED = {
    "qwen3_next": f"Qwen3-Next: {HYBRID}",
    "qwen3_5": f"Qwen3.5: {HYBRID}",
    "qwen3_5_text": f"Qwen3.5: {HYBRID}",
    "qwen3_5_moe": f"Qwen3.5-MoE: {HYBRID}",
    "qwen3_5_moe_text": f"Qwen3.5-MoE: {HYBRID}",
    "lfm2": f"LFM2: {HYBRID} (its short convolutions)",
    "lfm2_moe": f"LFM2-MoE: {HYBRID} (its short convolutions)",
    "falcon_h1": f"Falcon-H1: {HYBRID}",
    "jamba": f"Jamba: {HYBRID}",
    "bamba": f"Bamba: {HYBRID}",
    "nemotron_h": f"Nemotron-H: {HYBRID}",
    "granitemoehybrid": f"Granite 4 hybrid: {HYBRID}",
    "zamba": f"Zamba: {HYBRID}",
    "zamba2": f"Zamba2: {HYBRID}",
    "mamba": f"Mamba: {HYBRID}",
    "mamba2": f"Mamba2: {HYBRID}",
    "olmo_hybrid": f"OLMo hybrid: {HYBRID}",
    "kimi_linear": f"Kimi Linear: {HYBRID}",
    "minimax": f"MiniMax: {HYBRID}",
    "recurrent_gemma": f"RecurrentGemma: {HYBRID}",
    "gemma3": "Gemma 3's multimodal model: load its text model (Gemma3ForCausalLM, model_type gemma3_text)",
    "llama4": "Llama 4's multimodal model: load its text model (Llama4ForCausalLM, model_type llama4_text)",
    "gemma4": "Gemma 4's multimodal model: load its text model (model_type gemma4_text)",
}


def family(config) -> Family:
    """The Family of a model config; ModelError naming the family and why where replay would
    not be exact on it."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        known = FAMILIES[model_type]
        if (why := known.refuses(config)) is None:
            return known
        raise ModelError(f"{known.name} is supported, but not this model of it: {why}")
    why = REFUSED.get(model_type) or (
        f"{model_type!r} is not among the families replay is tested exact on (tests/test_families.py), so it is "
        "refused rather than trained on a gradient nobody checked")
    raise ModelError(f"model family {model_type!r} is not supported: {why}. Supported: "
                     f"{', '.join(f.name for f in FAMILIES.values())} (docs/models.md)")


def lm_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """What the family's causal LM makes of the LM head's output `logits`."""
    f = FAMILIES.get(getattr(config, "model_type", None))
    return logits if f is None else f.logits(config, logits)


def windowed_layers(config) -> list[int]:
    """The decoder layers that see only a window or a chunk of the earlier positions."""
    layer_types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return [i for i, (kind, kw) in enumerate(zip(layer_types, kwargs))
            if kind in ("sliding_attention", "chunked_attention") and kw.get("sliding_window")]

