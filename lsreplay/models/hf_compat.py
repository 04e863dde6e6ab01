"""The keyword transformers takes a KV cache by, in every version pyproject.toml admits.

transformers 5.24 renamed the cache argument of model forwards, decoder layers and mask
builders from `past_key_values` to `cache` (the old name warns until its removal in 5.40).
Before 5.24 a model forward swallows `cache=` into its **kwargs and runs without it: the
cache stays empty and decoding recomputes nothing it should reuse, with no error. So every
call that hands transformers a cache names it through `with_cache`.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

CACHE_KEYWORD = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def with_cache(cache) -> dict:
    """Keyword arguments that hand `cache` to a transformers forward, decoder layer or mask builder."""
    return {CACHE_KEYWORD: cache}
