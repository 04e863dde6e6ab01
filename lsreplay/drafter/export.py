"""The drafter as a standalone product: an EAGLE-1 draft folder that vLLM speculates with.

The layout is the EAGLE-1 convention vLLM loads as `EagleLlamaForCausalLM`
(`speculative_config={"method": "eagle", "model": <this folder>}`): `config.json` is a
one-layer Llama config (architectures `LlamaForCausalLM`; vLLM renames it), and
`model.safetensors` holds `fc.weight` and `layers.0.*` only. vLLM's draft has exactly these
parameters (no fc bias, no input norm on layer 0, which lsreplay's drafter lacks too), and
takes the embedding and LM head from the target, as lsreplay's drafter does. So every
trained tensor is used and nothing is left at its initialisation. `config.json` also
carries `lsreplay_drafter`, the shape `Drafter.config_dict` identifies, for `load_hf`.
"""

from __future__ import annotations

import json

from safetensors.torch import load as load_safetensors
from transformers import PreTrainedModel

from lsreplay.core.storage import Store
from lsreplay.drafter.model import Drafter

CONFIG, WEIGHTS = "config.json", "model.safetensors"
KEY = "lsreplay_drafter"


def hf_config(drafter: Drafter) -> dict:
    d = drafter.config.to_dict()
    d.update(architectures=["LlamaForCausalLM"], dtype=str(drafter.fc.weight.dtype).removeprefix("torch."))
    d.pop("_attn_implementation_autoset", None)
    d[KEY] = {**drafter.config_dict(),
              "input": "fc(concat(embed(x[t+1]), h[t])) -> layers.0 (no input norm) -> target lm_head",
              "feature": "h[t]: the target's last hidden state, after its final norm"}
    return d


def hf_tensors(drafter: Drafter) -> dict:
    """The drafter's weights under the names vLLM's EAGLE-1 Llama draft loads."""
    return {"fc.weight": drafter.fc.weight, **{f"layers.0.{k}": v for k, v in drafter.layer.state_dict().items()}}


def save_hf(store: Store, prefix: str, drafter: Drafter) -> dict:
    """Write `prefix`/config.json and `prefix`/model.safetensors; returns their entries."""
    return {CONFIG: store.write_bytes(f"{prefix}/{CONFIG}", json.dumps(hf_config(drafter), indent=1).encode()),
            WEIGHTS: store.write_tensors(f"{prefix}/{WEIGHTS}", hf_tensors(drafter), metadata={"format": "pt"})}


def exported_format(store: Store, prefix: str) -> str | None:
    """The drafter format of the export under `prefix` (None: not an lsreplay export)."""
    return json.loads(store.read_bytes(f"{prefix}/{CONFIG}")).get(KEY, {}).get("format")


def load_hf(store: Store, prefix: str, target: PreTrainedModel) -> Drafter:
    """A drafter for `target` from an exported folder; ValueError naming the difference if it
    was exported for another target."""
    config = json.loads(store.read_bytes(f"{prefix}/{CONFIG}"))
    if KEY not in config:
        raise ValueError(f"{store.url(prefix)} is not a drafter exported by lsreplay (its config.json has no "
                         f"{KEY!r} entry); export one from a run's checkpoints/drafter/step_N/hf")
    shape = {k: v for k, v in config[KEY].items() if k not in ("input", "feature")}
    drafter = Drafter.from_config_dict(target, shape)
    tensors = load_safetensors(store.read_bytes(f"{prefix}/{WEIGHTS}"))
    drafter.fc.load_state_dict({"weight": tensors["fc.weight"]})
    drafter.layer.load_state_dict({k[9:]: v for k, v in tensors.items() if k.startswith("layers.0.")})
    return drafter
