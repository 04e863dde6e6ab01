"""EAGLE-style drafter (EAGLE-1 / TLT): one decoder layer over [token embedding ; target feature].

The architecture is vLLM's EAGLE-1 draft (`EagleLlamaForCausalLM`), so that an exported
drafter is served by vLLM computing exactly what was trained (lsreplay.drafter.export):
`fc` (2d -> d) without bias, then one Llama decoder layer whose input norm is the identity
(the fc output goes straight into attention, as in EAGLE's cnets.py), the layer built from
the target's dimensions whatever the target's own family (vLLM has a Llama draft class
only), and no norm after it.

At position t the drafter sees the target's feature h_t (the base model's last hidden
state, after the final norm: the input of the LM head) and the embedding of token
x_{t+1}, the token sampled from h_t. It predicts h_{t+1}; draft logits are the target's
own LM head applied to that prediction.

The target's embedding and LM head are shared, not copied: the drafter keeps plain
references to them outside its module tree, so they are not in `parameters()` or
`state_dict()`, and it uses their weights detached, so no gradient reaches the target
and the target's own `requires_grad` flags stay untouched (the policy keeps training
its embedding while the drafter reads it).
"""

import copy
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lsreplay.models.hf_compat import with_cache
from lsreplay.models.loading import building_models

log = logging.getLogger(__name__)

# v2: vLLM's EAGLE-1 layout (no fc bias, no input norm, always a Llama layer); v1 drafters do not load.
FORMAT = "eagle1-v2"


@dataclass(frozen=True)
class _SharedHeads:
    """The target's embedding and LM head; a plain holder so nn.Module does not register them."""

    embed: torch.nn.Embedding
    lm_head: torch.nn.Linear


def _drafter_config(target: transformers.PreTrainedConfig) -> transformers.LlamaConfig:
    """One full-attention Llama decoder layer of the target's dimensions (its first layer's,
    where they differ per layer), rotary encoding (its full-attention layers', where layer
    types have their own) and norm epsilon (a Qwen2 target's drafter has no attention
    biases: it is a Llama layer)."""
    first = target.per_layer_config[0]
    heads = target.num_attention_heads
    config = transformers.LlamaConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(first, "num_key_value_heads", None) or heads,
        head_dim=getattr(first, "head_dim", None) or target.hidden_size // heads,
        hidden_act=_first_of(target, ("hidden_act", "hidden_activation"), "silu"),
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=_first_of(target, ("rms_norm_eps", "layer_norm_eps", "norm_eps"), 1e-6),
        rope_parameters=_full_attention_rope(target), initializer_range=target.initializer_range,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=getattr(target, "bos_token_id", None), eos_token_id=getattr(target, "eos_token_id", None))
    config._attn_implementation = "sdpa"
    return config


def _first_of(config, names: tuple[str, ...], default):
    """The first of `names` the config has (families name the same thing differently)."""
    return next((value for name in names if (value := getattr(config, name, None)) is not None), default)


def _full_attention_rope(target) -> dict:
    """The target's rotary parameters, its full-attention layers' where each layer type has its own (Gemma 3/4)."""
    rope = copy.deepcopy(target.rope_parameters)
    if isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))
    return rope


class Drafter(torch.nn.Module):
    """fc(2d -> d) then one Llama decoder layer; the output goes straight to the LM head.

    No norm after the layer, as in EAGLE-1: the regression target h_{t+1} is already the
    target's normalised feature, so the layer learns its scale directly, and a norm would
    add parameters that the feature loss and the LM head then have to agree on. On the
    tiny test targets an output RMSNorm (initialised from the target's final norm) gave
    no better held-out acceptance or feature loss after 200 steps.
    """

    def __init__(self, config: transformers.LlamaConfig, shared: _SharedHeads):
        super().__init__()
        self.config = config
        self._shared = shared
        d = config.hidden_size
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.layer.input_layernorm = torch.nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self._reset_weights()

    def _reset_weights(self) -> None:
        """Target-style normal init for the layer; fc starts as a pass-through of h_t.

        Passing h_t through makes the untrained drafter propose roughly what the target
        would propose at t, a better start than noise, and the fc's embedding half still
        receives gradient from step one.
        """
        std = self.config.initializer_range
        for module in self.layer.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
        d = self.config.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, d:].copy_(torch.eye(d))

    @classmethod
    def from_target(cls, target: transformers.PreTrainedModel) -> "Drafter":
        """A fresh drafter for a target of any supported family (models.families), on the
        target's device and dtype."""
        shared = _SharedHeads(target.get_input_embeddings(), target.get_output_embeddings())
        with building_models:  # its layers' initialisation uses torch.nn.init (see lsreplay/models/loading.py)
            drafter = cls(_drafter_config(target.config), shared)
        weight = shared.embed.weight
        drafter.fc.to(device=weight.device, dtype=weight.dtype)
        drafter.layer.to(device=weight.device, dtype=weight.dtype)
        # Only moved, not cast: the rotary inverse frequencies stay float32 as in the target.
        drafter.rotary_emb.to(device=weight.device)
        count = sum(p.numel() for p in drafter.parameters())
        log.info("drafter for %s: %.2fM parameters", type(target).__name__, count / 1e6)
        return drafter

    @classmethod
    def from_config_dict(cls, target: transformers.PreTrainedModel, config: dict) -> "Drafter":
        """Rebuild a drafter saved with `config_dict` for this target (weights loaded separately)."""
        drafter = cls.from_target(target)
        if drafter.config_dict() != config:
            raise ValueError(f"the drafter was made for another target or by an older lsreplay: its config {config} "
                             f"differs from what this target's drafter is ({drafter.config_dict()}); train a drafter "
                             "for this model (or use the target it was trained for)")
        return drafter

    def config_dict(self) -> dict:
        """What identifies this drafter's shape given its target (json-serialisable)."""
        return {
            "format": FORMAT,
            "hidden_size": self.config.hidden_size,
            "intermediate_size": self.config.intermediate_size,
            "num_attention_heads": self.config.num_attention_heads,
            "num_key_value_heads": self.config.num_key_value_heads,
            "head_dim": self.config.head_dim,
            "vocab_size": self._shared.embed.num_embeddings,
        }

    def forward(
        self,
        input_ids: torch.LongTensor,
        hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        cache: transformers.DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
        **attention,
    ) -> torch.Tensor:
        """Predicted features (B, T, d) from tokens x_{t+1} (B, T) and features h_t (B, T, d).

        `position_ids` (B, T) hold t, the position of h_t. Causal over T and over whatever `cache` already holds, which this call appends to.
        `attention`: keywords for the attention function the config names (rollout.shared_prompt's prompts held once).
        """
        embeds = F.embedding(input_ids, self._shared.embed.weight.detach())
        x = self.fc(torch.cat([embeds, hidden_states.to(embeds.dtype)], dim=-1))
        # Without a 2D `attention_mask` (cache + new columns), position_ids stay out of the
        # mask: it is causal in cache order, so drafting schemes may reuse or skip positions
        # without HF reading them as packed sequences. A batch whose cache rows hold holes
        # (speculative decoding) passes the mask that hides them.
        mask = create_causal_mask(
            config=self.config, inputs_embeds=x, attention_mask=attention_mask,
            position_ids=None if attention_mask is None else position_ids, **with_cache(cache),
        )
        return self.layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=cache is not None,
            position_embeddings=self.rotary_emb(x, position_ids),
            **with_cache(cache),
            **attention,
        )

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's LM head over (predicted or real) features, without gradient to its weights."""
        head = self._shared.lm_head
        bias = None if head.bias is None else head.bias.detach()
        return F.linear(features, head.weight.detach(), bias)
