"""lsreplay.models.hf_compat names the KV cache the way the installed transformers takes it
(`cache` from 5.24, `past_key_values` before): a forward given it fills it."""

import inspect

import torch
from conftest import tiny_model
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel

from lsreplay.models.hf_compat import CACHE_KEYWORD, with_cache


def test_the_keyword_is_a_parameter_of_what_takes_a_cache():
    for fn in (LlamaModel.forward, LlamaDecoderLayer.forward, create_causal_mask):
        assert CACHE_KEYWORD in inspect.signature(fn).parameters, fn.__qualname__


def test_a_forward_fills_the_cache_it_is_given():
    model = tiny_model(dtype=torch.float32)
    cache = DynamicCache(config=model.config)
    model.base_model(input_ids=torch.arange(5)[None], use_cache=True, **with_cache(cache))
    assert cache.get_seq_length() == 5
    model.base_model(input_ids=torch.arange(5, 7)[None], use_cache=True, **with_cache(cache))
    assert cache.get_seq_length() == 7
