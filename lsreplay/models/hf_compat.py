"""How lsreplay reaches into a transformers model, whatever its version and class.

The cache keyword. transformers 5.24 renamed the cache argument of model forwards, decoder layers and mask
builders from `past_key_values` to `cache` (the old name warns until its removal in 5.40).
Before 5.24 a model forward swallows `cache=` into its **kwargs and runs without it: the
cache stays empty and decoding recomputes nothing it should reuse, with no error. So every
call that hands transformers a cache names it through `with_cache`.

The decoder stack (`decoder`): where a causal LM keeps it differs between families.

A cache that keeps every position (`full_cache`): transformers' own cache for a
sliding-window or chunked layer keeps only the last window's keys, enough to decode one
token after another, not to hand a branch point's keys to replay nor to crop rejected
drafts (a dropped key cannot come back).
"""

from __future__ import annotations

import transformers
from packaging.version import Version
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

CACHE_KEYWORD = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def with_cache(cache) -> dict:
    """Keyword arguments that hand `cache` to a transformers forward, decoder layer or mask builder."""
    return {CACHE_KEYWORD: cache}


def decoder(model):
    """The decoder stack of a causal LM: the module whose forward returns `last_hidden_state`
    and holds `layers`. Usually `model.base_model`, but a family's base_model_prefix may name an
    attribute the causal LM does not have (Llama 4's names `language_model`, its decoder is
    `model`), and base_model is then the causal LM itself."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return inner
    return model.base_model


def decoder_layers(model) -> list:
    """The decoder layers of a causal LM, in order (empty if it has none it names `layers`)."""
    return list(getattr(decoder(model), "layers", []))


def full_cache(model) -> DynamicCache:
    """A cache of the model's layer structure that keeps every position of every attention
    layer: sliding-window and chunked layers' too."""
    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    return cache
