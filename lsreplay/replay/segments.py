"""Running token segments of a tree through an HF decoder after a given prefix K/V.

Both the no-grad caching pass and the replay backward are built from two operations:
run sibling segments (right-padded into one batch) at their absolute positions on top
of their ancestors' keys/values, and read the logprobs of chosen targets at chosen
positions. Only those positions go through the LM head.

The keys and values a run hands on are those of every position it ran, whatever the layer:
`hf_compat.full_cache` keeps them all where transformers' own cache for a sliding-window or chunked
layer keeps only the last window's (enough to decode, not to replay a branch on). What
such a layer may see is then the family's own mask's business, as in its plain forward.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from lsreplay.models.distribution import SamplingParams, token_logprobs
from lsreplay.models.hf_compat import decoder, full_cache, with_cache
from lsreplay.models.logits import float_logits

# Per-layer keys and values of a run of positions: ([k_0, ..., k_L-1], [v_0, ..., v_L-1]),
# each (1, kv_heads, positions, head_dim), post-rotary as HF caches them (a value's head_dim
# may differ from the key's: latent attention).
PrefixKV = tuple[list[torch.Tensor], list[torch.Tensor]]


def concat_kv(parts: list[PrefixKV]) -> PrefixKV | None:
    """Join ancestors' K/V along positions (differentiably, so grads reach each part)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    layers = range(len(parts[0][0]))
    keys = [torch.cat([p[0][i] for p in parts], dim=-2) for i in layers]
    values = [torch.cat([p[1][i] for p in parts], dim=-2) for i in layers]
    return keys, values


def kv_bytes(kv: PrefixKV) -> int:
    return sum(t.numel() * t.element_size() for half in kv for t in half)


def padded_batch(model: PreTrainedModel, segments: list[list[int]], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, T) of `segments` right-padded with 0, and their positions start.. ."""
    device = next(model.parameters()).device
    width = max(len(s) for s in segments)
    ids = torch.zeros(len(segments), width, dtype=torch.long, device=device)
    for b, seg in enumerate(segments):
        ids[b, : len(seg)] = torch.as_tensor(seg, dtype=torch.long)
    positions = torch.arange(start, start + width, device=device).expand(len(segments), width)
    return ids, positions


def forward_segments(model: PreTrainedModel, segments: list[list[int]], start: int,
                     past: PrefixKV | None) -> tuple[torch.Tensor, DynamicCache]:
    """Hidden states (B, T, d) of `segments` placed at positions start.. after `past`.

    Segments are right-padded: causal attention means a real token never sees the
    padding after it, so no attention mask is needed and padded outputs are ignored.
    The past is broadcast over the batch; the returned cache holds past + new K/V."""
    ids, positions = padded_batch(model, segments, start)
    cache = full_cache(model)
    if past is not None:
        for layer, (k, v) in enumerate(zip(*past)):
            cache.update(k.expand(len(segments), *k.shape[1:]), v.expand(len(segments), *v.shape[1:]), layer)
    out = decoder(model)(input_ids=ids, position_ids=positions, use_cache=True, **with_cache(cache))
    return out.last_hidden_state, cache



def new_kv(cache: DynamicCache, past_len: int, row: int = 0) -> PrefixKV:
    """The K/V a forward appended to `cache` (positions after `past_len`) for one row."""
    keys = [layer.keys[row : row + 1, :, past_len:] for layer in cache.layers]
    values = [layer.values[row : row + 1, :, past_len:] for layer in cache.layers]
    return keys, values


def device_index(values, device: torch.device) -> torch.LongTensor:
    """`values` (ints) as a long tensor on `device`. Onto a GPU through page-locked memory,
    without waiting: a copy from pageable memory synchronises the stream, once per scored
    row (the caching pass, the replay backward) it would stall the device each time."""
    index = torch.as_tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def target_logprobs(model: PreTrainedModel, hidden: torch.Tensor, positions, targets,
                    sampling: SamplingParams) -> torch.Tensor:
    """log p(targets[i] | position positions[i]) from one row of hidden states (T, d), p the
    distribution `sampling` draws from (lsreplay.models.distribution; RAW: the policy's own)."""
    positions, targets = device_index(positions, hidden.device), device_index(targets, hidden.device)
    return token_logprobs(float_logits(model, hidden[positions]), targets, sampling)
