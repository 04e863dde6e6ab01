"""The policy as an HF model folder: what transformers' `from_pretrained`, vLLM and other
trainers load.

A folder holds `config.json` (its `dtype` the run's compute dtype), `generation_config.json`,
the tokenizer's files with its chat template, and the weights as safetensors in the
compute dtype: `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json` once they pass `checkpoint.hf_shard_gb`. Every complete
policy checkpoint has one under `hf/` (written by the background checkpoint writer,
lsreplay.state.checkpointing), and `lsreplay export` writes one from any complete checkpoint.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from transformers import GenerationConfig

from lsreplay.core.config import ModelConfig
from lsreplay.core.storage import Store
from lsreplay.models.loading import hf_config, load_tokenizer, resolve_model_dir

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def write_hf_folder(store: Store, prefix: str, weights: dict[str, torch.Tensor], model: ModelConfig,
                    shard_bytes: int, same_bytes_as: dict | None = None) -> dict[str, dict]:
    """Write the HF folder of `weights` (by the model's parameter names) under `prefix`, in
    the dtype `model.dtype`; returns {file name: store entry}. `same_bytes_as`: the entry of
    a safetensors file already holding exactly these weights in that dtype (the masters of
    a float32 run): linked instead of written again when one shard suffices."""
    dtype = getattr(torch, model.dtype)
    files = {name: store.write_bytes(f"{prefix}/{name}", data) for name, data in _metadata_files(model).items()}
    cast = {name: t.to(dtype) for name, t in weights.items()}
    shards = _shards(cast, shard_bytes)
    if len(shards) == 1:
        if same_bytes_as is not None and all(t.dtype == dtype for t in weights.values()):
            files[WEIGHTS] = store.link(same_bytes_as, f"{prefix}/{WEIGHTS}")
        else:
            files[WEIGHTS] = store.write_tensors(f"{prefix}/{WEIGHTS}", cast, metadata={"format": "pt"})
        return files
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        files[name] = store.write_tensors(f"{prefix}/{name}", shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.nbytes for t in cast.values())
    files[INDEX] = store.write_json(f"{prefix}/{INDEX}", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return files


def _shards(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors (in name order) of at most `shard_bytes` each (a bigger
    tensor alone in its shard), as save_pretrained splits them."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    return shards


_METADATA: dict[tuple, dict[str, bytes]] = {}


def _metadata_files(model: ModelConfig) -> dict[str, bytes]:
    """config.json, generation_config.json and the tokenizer's files, as save_pretrained
    writes them (computed once per process and model config)."""
    key = (model.path, model.cache_dir, model.dtype, json.dumps([model.arch, model.rope_scaling], sort_keys=True))
    if key not in _METADATA:
        config = hf_config(model)  # with model.rope_scaling: the exported model runs as it trained
        if model.arch:
            generation = GenerationConfig.from_model_config(config)
        else:
            generation = _generation_config(resolve_model_dir(model), config)
        config.dtype = model.dtype
        with tempfile.TemporaryDirectory() as tmp:
            config.save_pretrained(tmp)
            generation.save_pretrained(tmp)
            load_tokenizer(model).save_pretrained(tmp)
            _METADATA[key] = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
    return _METADATA[key]


def _generation_config(folder: Path, config) -> GenerationConfig:
    try:
        return GenerationConfig.from_pretrained(folder, local_files_only=True)
    except OSError:  # a folder without one: derived from the model's config, as transformers does
        return GenerationConfig.from_model_config(config)
