"""The attention a model's forward runs, chosen per thread.

transformers picks a layer's attention function, and its mask builder, from
`config._attn_implementation` at every forward. Replay (cascade attention), the shared-prompt
sampler and the recompute of checkpointed layers choose another one for the span of their own
forwards. Set on the config itself, that choice is seen by every thread that runs the model:
two rollout shards on one device, or a prefix pass while a shard samples, share the policy's
weights and config, and would switch each other's attention — a crash where a function misses
its keyword, a forward through the wrong attention where it does not.

So `attention_for_thread(configs, name)` overrides what `_attn_implementation` reads for the
calling thread only; every other thread still reads the config's own value. The override is
read through transformers' own property, so the attention function, the mask builder and
every other place transformers asks agree within a thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from transformers import PretrainedConfig

_THREAD = threading.local()
_CONFIG_PROPERTY = PretrainedConfig._attn_implementation


def _read(config: PretrainedConfig):
    overrides = getattr(_THREAD, "overrides", None)
    if overrides and (name := overrides.get(id(config))) is not None:
        return name
    return _CONFIG_PROPERTY.fget(config)


# Every config class reads through PretrainedConfig's property (no family in
# models.families defines its own); writes keep transformers' setter.
PretrainedConfig._attn_implementation = property(_read, _CONFIG_PROPERTY.fset)


def model_configs(model: torch.nn.Module) -> list[PretrainedConfig]:
    """Every config object `model`'s modules read (a multimodal model's text config is its own)."""
    found = {id(m.config): m.config for m in model.modules()
             if isinstance(getattr(m, "config", None), PretrainedConfig)}
    return list(found.values())


@contextmanager
def attention_for_thread(configs: Iterable[PretrainedConfig], name: str) -> Iterator[None]:
    """Inside the block, forwards on this thread through modules holding any of `configs` use
    the attention implementation `name`; outside it (and on every other thread) as before.
    Blocks nest: the innermost choice holds, the outer one returns at its end."""
    overrides: dict[int, str] = _THREAD.__dict__.setdefault("overrides", {})
    saved = {id(c): overrides.get(id(c)) for c in configs}
    overrides.update(dict.fromkeys(saved, name))
    try:
        yield
    finally:
        for key, previous in saved.items():
            if previous is None:
                overrides.pop(key, None)
            else:
                overrides[key] = previous
