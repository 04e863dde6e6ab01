"""LoRA adapters on the policy (`model.lora`), with PEFT as the adapter library.

The adapters are injected into the HF model in place (`peft.inject_adapter_in_model`), not
wrapped in a PeftModel: the policy stays the transformers model it was, `model.base_model`
its decoder, every attention module the same class calling the AttentionInterface, so the
caching pass, the replay backward and its cascade attention run it unchanged; each target
projection becomes PEFT's `lora.Linear`, whose forward is base(x) + B(A(x)) * alpha / rank.
PEFT freezes everything else, so gradients, float32 masters and AdamW moments
(lsreplay.models.train_state) exist for the adapters (and a critic's value head) alone.

The reference (KL, DPO) is the same model with its adapters off (`adapters_off`): no second
copy of the base. A checkpoint keeps the adapters as a PEFT folder (`write_adapter_folder`:
adapter_config.json, adapter_model.safetensors), which `peft.PeftModel.from_pretrained`
loads onto the base; `merged_weights` folds them into the base for an HF model folder.

The adapters' initial A is random (B starts at zero, so the policy starts as the base): it
is drawn from the CPU generator seeded by the run's seed and put back after (loading.seeded;
no accelerator's generator is touched), so every copy of a run's policy (each device's, the
float32 masters of a bfloat16 one, a resumed process's) starts the same and later draws do
not depend on whether this process built it.

Targets are named as PEFT takes them (`model.lora.target_modules`): a name matches every
module whose dotted path is it or ends with "." + it (q_proj, self_attn.q_proj), and
"all-linear" is every linear layer of the decoder layers (PEFT's all-linear on a causal LM:
its linear layers but the output layer).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import peft
import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM, PreTrainedModel

from lsreplay.core.config import ALL_LINEAR, LoraConfig, ModelConfig
from lsreplay.core.storage import Store
from lsreplay.models.hf_compat import decoder
from lsreplay.models.loading import ModelError, building_models, hf_config, hub_reference, load_model, seeded
from lsreplay.models.train_state import master_dtype

ADAPTER = "default"  # PEFT's name of the one adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What PeftModel puts before the HF model's own parameter names in an adapter file.
PEFT_PREFIX = "base_model.model."


def peft_config(lora: LoraConfig, targets: list[str], base: str | None = None,
                revision: str | None = None) -> peft.LoraConfig:
    """PEFT's LoraConfig of `model.lora` on `targets` (check_targets' names), `base` and
    `revision` the base model as PEFT records it (hub_reference)."""
    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                           task_type="CAUSAL_LM", base_model_name_or_path=base, revision=revision)


def add_adapters(model: PreTrainedModel, lora: LoraConfig, seed: int) -> PreTrainedModel:
    """Inject `lora`'s adapters into `model` in place, in its dtype and on its device; only
    they stay trainable. ModelError where a target is not a linear layer of the decoder
    layers, or PEFT cannot wrap the model."""
    targets = check_targets(model, lora.target_modules)
    with building_models, seeded(seed):
        try:
            peft.inject_adapter_in_model(peft_config(lora, targets), model, adapter_name=ADAPTER)
        except (ValueError, TypeError, NotImplementedError) as e:
            raise ModelError(f"PEFT cannot wrap {type(model).__name__} for model.lora ({e}); train the full weights "
                             "(model.lora.enabled=false) or pick other model.lora.target_modules") from e
    return model


def check_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The names PEFT gets for `targets` (model.lora.target_modules): all-linear as the names
    of the decoder layers' linear layers, the others as given. ModelError unless every name
    matches (as PEFT matches: the module's dotted path is it or ends with "." + it) linear
    layers inside the decoder layers only: the LM head and the embedding are shared with the
    drafter and read as weights (logits.py)."""
    layers = getattr(decoder(model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ModelError(f"model.lora needs a decoder with layers (every family of models.families has them); "
                         f"{type(model).__name__} has none: train it with model.lora.enabled=false")
    prefix = next(name for name, m in model.named_modules() if m is layers) + "."
    modules = dict(model.named_modules())
    linear = sorted({n.rpartition(".")[2] for n, m in modules.items()
                     if n.startswith(prefix) and isinstance(m, torch.nn.Linear)})
    if list(targets) == [ALL_LINEAR]:
        return linear
    for target in targets:
        matched = [n for n in modules if n == target or n.endswith("." + target)]
        if not matched:
            raise ModelError(f"model.lora.target_modules names {target!r}, which {type(model).__name__} does not "
                             f"have; its decoder layers' linear layers are {linear}: list some of those (a name "
                             "may end a module's dotted path, e.g. self_attn.q_proj), or all-linear")
        if outside := [n for n in matched if not n.startswith(prefix)]:
            raise ModelError(f"model.lora.target_modules names {target!r}, which is outside the decoder layers "
                             f"({outside[0]}: the LM head and embedding stay as they are); adapt the layers' linear "
                             f"layers: {linear}")
        if other := [modules[n] for n in matched if not isinstance(modules[n], torch.nn.Linear)]:
            raise ModelError(f"model.lora.target_modules names {target!r}, a {type(other[0]).__name__}, which PEFT "
                             f"cannot wrap with LoRA here (linear layers only): list some of {linear}")
    return list(targets)


def check_lora(cfg: ModelConfig) -> None:
    """The preflight's check of model.lora: the adapters go into a model of this config
    built on the meta device (no weights read, nothing allocated)."""
    if not cfg.lora.enabled:
        return
    with building_models, torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg))
    add_adapters(model, cfg.lora, seed=0)


def has_adapters(model: torch.nn.Module) -> bool:
    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """`model` runs as its base inside the block (the reference); a model without adapters
    as it is. Like the attention switch of replay (lsreplay.replay.cascade), this assumes
    nothing else runs this model meanwhile: the caching pass owns its copy."""
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    trainable = {p: p.requires_grad for m in layers for p in m.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, grad in trainable.items():  # enable_adapters sets requires_grad: put it back
            param.requires_grad_(grad)


def checkpointed_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The part of `model`'s state dict a policy checkpoint holds: all of it, or with
    adapters all but the frozen base (which is the base model's folder)."""
    state = model.state_dict()
    if not has_adapters(model):
        return state
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {n: t for n, t in state.items() if n not in frozen}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of `weights` (by the policy's parameter names) under the names PEFT's
    save_pretrained gives them: base_model.model.<module>.lora_A.weight."""
    return {PEFT_PREFIX + n.replace(f".{ADAPTER}.", "."): t for n, t in weights.items() if is_adapter(n)}


def write_adapter_folder(store: Store, prefix: str, weights: dict[str, torch.Tensor],
                         model: ModelConfig) -> dict[str, dict]:
    """Write the adapters of `weights` as a PEFT folder under `prefix` (in their dtype: the
    float32 masters); returns {file name: store entry}. Its base is named as PEFT names it
    (hub_reference: the hub id where the run knows it, else the local folder), its targets
    by the adapted modules' names where model.lora.target_modules is all-linear (as PEFT
    writes them)."""
    targets = list(model.lora.target_modules)
    if targets == [ALL_LINEAR]:
        targets = sorted({n.partition(".lora_A.")[0].rpartition(".")[2] for n in weights if ".lora_A." in n})
    with tempfile.TemporaryDirectory() as tmp:
        peft_config(model.lora, targets, *hub_reference(model)).save_pretrained(tmp)
        config = (Path(tmp) / ADAPTER_CONFIG).read_bytes()
    tensors = {n: t.contiguous() for n, t in peft_tensors(weights).items()}
    return {ADAPTER_CONFIG: store.write_bytes(f"{prefix}/{ADAPTER_CONFIG}", config),
            ADAPTER_WEIGHTS: store.write_tensors(f"{prefix}/{ADAPTER_WEIGHTS}", tensors, metadata={"format": "pt"})}


@torch.no_grad()
def merged_weights(cfg: ModelConfig, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF model's weights (by its own parameter names) of the base `cfg` names with
    `adapters` (by the policy's names) merged in by PEFT, in the masters' dtype (float32
    under bfloat16)."""
    model = add_adapters(load_model(cfg, trainable=False, dtype=master_dtype(cfg.dtype)), cfg.lora, seed=0)
    model.load_state_dict(adapters, strict=False)
    for layer in model.modules():
        if isinstance(layer, LoraLayer):
            layer.merge(adapter_names=[ADAPTER])
    state = model.state_dict()
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return {n.replace(".base_layer.", "."): state[n] for n in names if n in state and not is_adapter(n)}
