"""The drafter as a standalone product: an EAGLE-convention HF folder.

`config.json` is the target's config with one hidden layer (so `AutoConfig` and
`AutoModel.from_pretrained` read it; the layer loads as `layers.0.*` of a one-layer
base model), plus an `eagle` entry saying how the drafter is wired. `model.safetensors`
holds `fc.*` and `layers.0.*`, the names EAGLE serving stacks expect. The embedding and
LM head are the target's and are not duplicated here.
"""

from __future__ import annotations

import copy
import json

from safetensors.torch import load as load_safetensors
from transformers import PreTrainedModel

from lsreplay.drafter.model import Drafter
from lsreplay.storage import Store

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def hf_config(drafter: Drafter) -> dict:
    config = copy.deepcopy(drafter.config)
    config.architectures = [f"{type(drafter.layer).__name__.replace('DecoderLayer', '')}ForCausalLMEagle"]
    d = config.to_dict()
    d["eagle"] = {"drafter": drafter.config_dict(),
                  "input": "concat(embed(x[t+1]), h[t]) -> fc -> layers.0 -> target lm_head",
                  "feature": "target last_hidden_state (after the final norm)"}
    return d


def save_hf(store: Store, prefix: str, drafter: Drafter) -> dict:
    """Write `prefix`/config.json and `prefix`/model.safetensors; returns their entries."""
    tensors = {f"fc.{k}": v for k, v in drafter.fc.state_dict().items()}
    tensors.update({f"layers.0.{k}": v for k, v in drafter.layer.state_dict().items()})
    return {CONFIG: store.write_bytes(f"{prefix}/{CONFIG}", json.dumps(hf_config(drafter), indent=1).encode()),
            WEIGHTS: store.write_tensors(f"{prefix}/{WEIGHTS}", tensors, metadata={"format": "pt"})}


def load_hf(store: Store, prefix: str, target: PreTrainedModel) -> Drafter:
    """A drafter for `target` from an exported folder (checked against the target's shape)."""
    config = json.loads(store.read_bytes(f"{prefix}/{CONFIG}"))
    drafter = Drafter.from_config_dict(target, config["eagle"]["drafter"])
    tensors = load_safetensors(store.read_bytes(f"{prefix}/{WEIGHTS}"))
    drafter.fc.load_state_dict({k[3:]: v for k, v in tensors.items() if k.startswith("fc.")})
    drafter.layer.load_state_dict({k[9:]: v for k, v in tensors.items() if k.startswith("layers.0.")})
    return drafter
