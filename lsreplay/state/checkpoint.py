"""Checkpoints of training state: policy and drafter weights, optimizer state, RNG states.

Everything is written through a Store as safetensors (tensors) and JSON (everything else),
never pickle, so a checkpoint can be read without trusting who wrote it. Each save returns a
manifest {"prefix", "files": {name: entry}}; passing it back to the matching load makes the
load verify the sha256 of what it reads.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

import torch

from lsreplay.core.layout import MODEL_FILE, CheckpointError
from lsreplay.core.storage import CorruptEntry, MissingEntry, Store
from lsreplay.models.lora import checkpointed_state
from lsreplay.models.train_state import keep_implementation

log = logging.getLogger(__name__)

# A policy's critic (its value head, lsreplay.algos.critic): beside the model file, which
# stays exactly the HF model's weights.
CRITIC_FILE = "critic.safetensors"
META_FILE = "meta.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
RNG_FILE = "rng.safetensors"


def save_module(
    store: Store, prefix: str, module: torch.nn.Module, meta: dict | None = None
) -> dict:
    """Save parameters and persistent buffers; a tied weight is written once, under the name
    named_parameters() gives it."""
    return save_weights(store, prefix, _module_tensors(module), meta)


def save_weights(store: Store, prefix: str, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> dict:
    """Save named weights (a module's, or an optimizer's float32 masters under the module's
    names) as the model file that `load_module` reads."""
    files = {
        # "format": what transformers writes; the file then doubles as an HF weights file.
        MODEL_FILE: store.write_tensors(f"{prefix}/{MODEL_FILE}", tensors, metadata={"format": "pt"}),
        META_FILE: store.write_json(f"{prefix}/{META_FILE}", meta or {}),
    }
    return {"prefix": prefix, "files": files}


def load_weights(store: Store, prefix: str, manifest: dict | None = None) -> dict[str, torch.Tensor]:
    """The named weights of a checkpoint, as saved (verified against `manifest` if given),
    its critic's too where the manifest lists one."""
    tensors = _read(store, prefix, MODEL_FILE, manifest, store.read_tensors)
    if manifest is not None and CRITIC_FILE in manifest.get("files", {}):
        tensors.update(_read(store, prefix, CRITIC_FILE, manifest, store.read_tensors))
    return tensors


def load_module(
    store: Store, prefix: str, module: torch.nn.Module, manifest: dict | None = None
) -> None:
    tensors = load_weights(store, prefix, manifest)
    check_fits(store, prefix, module, tensors)  # before loading: a misfit leaves the module untouched
    module.load_state_dict(tensors, strict=False)
    log.info("loaded %d tensors from %s", len(tensors), store.url(f"{prefix}/{MODEL_FILE}"))


def check_fits(store: Store, prefix: str, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """CheckpointError unless the model file's `tensors` load into `module` (names and shapes)."""
    problems = _mismatches(checkpointed_state(module), tensors)
    if problems:
        raise CheckpointError(
            f"checkpoint {store.url(f'{prefix}/{MODEL_FILE}')} does not fit {type(module).__name__}: {problems}; "
            "load it into the architecture and config it was saved from"
        )


def save_optimizer(store: Store, prefix: str, optimizer: torch.optim.Optimizer | dict) -> dict:
    """Tensors go to optimizer.safetensors as "state.{param_index}.{name}" (or
    "param_groups.{group_index}.{name}"); every other value, with its place, to optimizer.json.
    `optimizer`: a live optimizer, or a state_dict() of one taken earlier (a snapshot)."""
    state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    name = "optimizer state" if isinstance(optimizer, dict) else type(optimizer).__name__
    tensors: dict[str, torch.Tensor] = {}
    plain_state = {
        str(index): _split(values, f"state.{index}", tensors)
        for index, values in state["state"].items()
    }
    groups = [
        _split(group, f"param_groups.{i}", tensors) for i, group in enumerate(state["param_groups"])
    ]
    json_key = f"{prefix}/{OPTIMIZER_JSON}"
    try:
        json_entry = store.write_json(json_key, {"state": plain_state, "param_groups": groups})
    except TypeError as e:
        raise CheckpointError(
            f"{name} holds a value JSON cannot store ({e}), "
            f"so {store.url(json_key)} was not written; make that state a tensor or a plain value"
        ) from e
    files = {
        OPTIMIZER_TENSORS: store.write_tensors(f"{prefix}/{OPTIMIZER_TENSORS}", tensors),
        OPTIMIZER_JSON: json_entry,
    }
    return {"prefix": prefix, "files": files}


def load_optimizer(
    store: Store, prefix: str, optimizer: torch.optim.Optimizer, manifest: dict | None = None
) -> None:
    plain = _read(store, prefix, OPTIMIZER_JSON, manifest, store.read_json)
    tensors = _read(store, prefix, OPTIMIZER_TENSORS, manifest, store.read_tensors)
    state: dict[int, dict] = defaultdict(dict)
    for index, values in plain["state"].items():
        state[int(index)].update(values)
    groups = plain["param_groups"]
    for key, tensor in tensors.items():
        part, index, name = key.split(".", 2)
        target = state[int(index)] if part == "state" else groups[int(index)]
        target[name] = tensor
    _restore_tuples(groups, optimizer.param_groups)
    keep_implementation(groups, optimizer.param_groups)
    try:
        optimizer.load_state_dict({"state": dict(state), "param_groups": groups})
    except (ValueError, KeyError) as e:
        raise CheckpointError(
            f"optimizer checkpoint {store.url(prefix)} does not fit this "
            f"{type(optimizer).__name__} ({e}); build the optimizer over the same parameter "
            "groups as when it was saved"
        ) from e


def save_rng(store: Store, prefix: str, generators: dict[str, torch.Generator]) -> dict:
    states = {name: g.get_state() for name, g in generators.items()}
    entry = store.write_tensors(f"{prefix}/{RNG_FILE}", states)
    return {"prefix": prefix, "files": {RNG_FILE: entry}}


def load_rng(store: Store, prefix: str, manifest: dict | None = None) -> dict[str, torch.Tensor]:
    """Generator states by name (uint8 tensors), for torch.Generator.set_state."""
    return _read(store, prefix, RNG_FILE, manifest, store.read_tensors)


def _module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # state_dict() drops non-persistent buffers; the named_* iterators drop tied duplicates.
    state = module.state_dict()
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    return {n: state[n] for n in names if n in state}


def _mismatches(current: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> str:
    """Describe keys that would not load; a key absent from the checkpoint is fine when its
    tensor shares storage with one that is loaded (a tied weight, saved once)."""
    loaded_storages = {_storage(current[k]) for k in loaded if k in current}
    missing = [
        k for k in current if k not in loaded and _storage(current[k]) not in loaded_storages
    ]
    unexpected = [k for k in loaded if k not in current]
    reshaped = [k for k in loaded if k in current and loaded[k].shape != current[k].shape]
    parts = [("missing keys", missing), ("unexpected keys", unexpected), ("shapes differ", reshaped)]
    return "; ".join(
        f"{label} {keys[:10]}" + (" ..." if len(keys) > 10 else "") for label, keys in parts if keys
    )


def _storage(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


def _split(values: dict, place: str, tensors: dict[str, torch.Tensor]) -> dict:
    """Move the tensor values of one state or group dict into tensors (keyed by place) and
    return the rest."""
    plain = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            tensors[f"{place}.{name}"] = value
        else:
            plain[name] = value
    return plain


def _restore_tuples(groups: list[dict], live_groups: list[dict]) -> None:
    """JSON turns tuples (AdamW's betas) into lists; give them back the live optimizer's type."""
    for group, live in zip(groups, live_groups):
        for name, value in group.items():
            if isinstance(live.get(name), tuple) and isinstance(value, list):
                group[name] = tuple(value)


def _read(store: Store, prefix: str, name: str, manifest: dict | None, reader: Callable):
    """Read one checkpoint file, verifying it against the manifest when there is one."""
    key = f"{prefix}/{name}"
    sha256 = None
    if manifest is not None:
        entry = manifest.get("files", {}).get(name)
        if entry is None or entry.get("key") != key:
            raise CheckpointError(
                f"the manifest passed for {store.url(key)} does not describe that file "
                f"(manifest prefix {manifest.get('prefix')!r}); "
                "pass the manifest that this checkpoint's save returned"
            )
        sha256 = entry["sha256"]
    # An unreachable store stays a StorageError: the checkpoint itself may be fine.
    try:
        return reader(key, sha256)
    except (MissingEntry, CorruptEntry) as e:
        raise CheckpointError(f"unusable checkpoint file: {e}") from e
