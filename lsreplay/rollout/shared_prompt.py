"""Rollout rows that attend to one copy of their prompt's K/V (cascade attention without grad).

The rows of a rollout tree share their prompt. Forked by repeating cache rows, every row
would hold the prompt's K/V of its own: G copies for a group of G, most of the rollout
stage's memory once the prompt is long. Here each tree's prompt K/V is held once, (1,
kv_heads, prompt, d) per layer, beside a cache of the rows' own positions (their
completions), and every attention layer of a decode step or a verify block computes:

- each row's queries against the row's own K/V, with a mask over the own columns (holes a
  speculative round left, the causal order of a block of several new tokens);
- per tree, the queries of all its rows, with the query heads of each K/V group folded
  into the query length, against the tree's prompt K/V, unrepeated and without a mask
  (every prompt position is visible to every completion token): one call of the device's
  attention kernel, the one replay's cascade attention uses (attention.kernels.kernel_for);
- the two parts merged by their log-sum-exp, as cascade attention merges a prefix's part.

Replay's `forward_cascade` (lsreplay.replay.cascade) computes the same softmax for rows
that share a prefix, but its own part is square and causal (a run's queries against that
run's own keys) and every row attends to the same prefix; a decode step's queries are one
token against a longer own cache, a speculative cache has holes, and a batch holds the rows
of several trees, each with its prompt. That is this module's attention function; the
prompt itself is encoded with `forward_cascade`, in chunks that each attend to the chunks
before them in place (`encode_prompt`), so a long prompt's prefill holds its K/V and one
chunk's activations, and reports its progress.

The merge changes the order of the softmax's sums, not what they sum: logits and logprobs
equal those of the padded, repeated layout up to floating-point rounding (float64 tests
compare them to 1e-12), and the tokens drawn are the same.

Models: those `cascade_applies` to, whose attention is plain softmax attention (Llama,
Qwen2 without sliding windows); any other model keeps the repeated layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

from lsreplay.models.attention_switch import attention_for_thread
from lsreplay.models.hf_compat import decoder_layers
from lsreplay.replay.attention.kernels import kernel_for
from lsreplay.replay.cascade import cascade_applies, forward_cascade
from lsreplay.replay.segments import PrefixKV, kv_bytes, new_kv

log = logging.getLogger(__name__)

IMPLEMENTATION = "lsreplay_shared_prompt"
# Plain softmax attention modules: what the attention function below computes exactly.
PLAIN_ATTENTION = (LlamaAttention, Qwen2Attention)
# Prompt positions encoded per forward of the prefill: a chunk's activations are what the
# prefill holds beside the K/V; a prompt longer than one chunk reports progress per chunk.
PREFILL_CHUNK = 4096


class SharedPrompts:
    """Each tree's prompt K/V, held once, and the tree of every batch row.

    `kv[t]`: tree t's per-layer keys and values, each (1, kv_heads, positions, d), post-rotary
    as HF caches them (positions may be 0). `trees[i]`: the tree of batch row i; `select`
    follows the batch's rows as they fork and finish."""

    def __init__(self, kv: list[PrefixKV], trees: list[int]):
        self.kv = kv
        self._group(trees)

    def _group(self, trees: list[int]) -> None:
        self.trees = list(trees)
        # Runs of consecutive rows of one tree, (tree, first row, end): forks repeat a row in
        # place and finished rows leave the order as it was, so each tree's rows stay one run.
        self.runs = []
        for row, tree in enumerate(self.trees):
            if self.runs and self.runs[-1][0] == tree:
                self.runs[-1][2] = row + 1
            else:
                self.runs.append([tree, row, row + 1])
        self.lengths = torch.tensor([self.positions(t) for t in self.trees], device=self.kv[0][0][0].device)

    def positions(self, tree: int) -> int:
        return self.kv[tree][0][0].shape[-2]

    def select(self, rows: list[int]) -> None:
        """Keep batch rows `rows` (repeated where a row forks), in that order."""
        self._group([self.trees[r] for r in rows])

    def nbytes(self) -> int:
        """Bytes of the prompts' K/V held (each tree's once)."""
        return sum(kv_bytes(kv) for kv in self.kv)


def shares_prompt(model: PreTrainedModel) -> bool:
    """Whether `model`'s rollouts can attend to one copy of each prompt: cascade attention
    applies to it (a kernel for its device and dtype) and every layer's attention is plain
    softmax attention without a sliding window."""
    attention = [getattr(layer, "self_attn", None) for layer in decoder_layers(model)]
    return (cascade_applies(model)
            and all(isinstance(m, PLAIN_ATTENTION) and getattr(m, "sliding_window", None) is None for m in attention))


def _visible(own_mask: torch.Tensor | None, width: int, columns: int, device: torch.device) -> torch.Tensor | None:
    """Which own columns each new token sees, (rows or 1, width, columns): those own_mask
    (rows, columns) marks (None: all), up to the token's own column (the `width` new ones are
    the last); None when that is every column for every token."""
    if own_mask is None and width == 1:
        return None
    causal = (torch.arange(columns, device=device)[None, :]
              <= torch.arange(width, device=device)[:, None] + (columns - width))
    return causal[None] if own_mask is None else own_mask[:, None, :].bool() & causal


def _own_part(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor | None,
              width: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's grouped queries (rows, kv_heads, group * width, d) against its own keys and
    values (rows, kv_heads, columns, d), the columns `visible` hides masked: the output (the
    query's shape) and log-sum-exp, in the query's dtype or float32 where that is narrower.
    The device's kernel for a mask where there is one (a verify block, holes): the fused one
    where it takes masks, else replay's plain one (attention.kernels.kernel_for)."""
    rows, _, queries, d = query.shape
    compute = torch.promote_types(query.dtype, torch.float32)
    mask = None
    if visible is not None:  # additive, the same for each query head of a group: (rows, 1, group * width, columns)
        shown = visible.expand(rows, width, key.shape[2]).repeat(1, queries // width, 1)[:, None]
        mask = torch.zeros(shown.shape, dtype=query.dtype, device=query.device).masked_fill(~shown, float("-inf"))
    kernel = kernel_for(query.device.type, query.dtype, d, masked=mask is not None)
    out, lse = kernel.forward(query, key, value, False, scale, mask)
    return out.to(compute), lse.to(compute)


def _prompt_part(query: torch.Tensor, shared: SharedPrompts, layer: int, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped queries (rows, kv_heads, group * width, d) against their tree's prompt K/V:
    per run of a tree's rows, their queries folded into one long query sequence per K/V
    head, one kernel call. Output and log-sum-exp as `_own_part`'s; a row whose prompt holds
    no position gets a log-sum-exp of -inf (its part weighs nothing in the merge)."""
    _, kv_heads, queries, d = query.shape
    kernel = kernel_for(query.device.type, query.dtype, d)
    compute = torch.promote_types(query.dtype, torch.float32)
    outs, lses = [], []
    for tree, first, end in shared.runs:
        if not shared.positions(tree):
            outs.append(query.new_zeros(end - first, kv_heads, queries, d, dtype=compute))
            lses.append(query.new_full((end - first, kv_heads, queries), float("-inf"), dtype=compute))
            continue
        folded = query[first:end].transpose(0, 1).reshape(1, kv_heads, -1, d)
        keys, values = shared.kv[tree]
        out, lse = kernel.forward(folded, keys[layer], values[layer], False, scale)
        outs.append(out.reshape(kv_heads, end - first, queries, d).transpose(0, 1).to(compute))
        lses.append(lse.reshape(kv_heads, end - first, queries).transpose(0, 1).to(compute))
    return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))


def shared_prompt_attention(module, query, key, value, attention_mask, *, scaling: float,
                            shared_prompts: SharedPrompts, own_mask: torch.Tensor | None = None,
                            dropout: float = 0.0, sliding_window: int | None = None, **kwargs):
    """The AttentionInterface function: `query` (rows, heads, width, d) attends to the rows'
    own `key`, `value` (rows, kv_heads, columns, d: the cache's columns, the new ones last),
    where `own_mask` (rows, columns; None: all) marks them visible, and to each row's prompt
    in `shared_prompts` (see the module docstring). No gradient flows through it."""
    if dropout or sliding_window is not None or attention_mask is not None:
        raise ValueError("shared-prompt attention supports neither dropout, a sliding window nor an attention mask "
                         "(the rows' own mask comes as own_mask)")
    rows, heads, width, d = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads * width, d)
    visible = _visible(own_mask, width, key.shape[2], query.device)
    out, lse = _own_part(grouped, key, value, visible, width, scaling)
    prompt_out, prompt_lse = _prompt_part(grouped, shared_prompts, module.layer_idx, scaling)
    # The own part's share of the joint softmax, exp(lse) / (exp(lse) + exp(prompt_lse)); 1
    # where the prompt holds no position (its log-sum-exp -inf).
    out = torch.lerp(prompt_out, out, torch.sigmoid(lse - prompt_lse)[..., None])
    return out.to(query.dtype).reshape(rows, heads, width, d).transpose(1, 2), None


AttentionInterface.register(IMPLEMENTATION, shared_prompt_attention)


@contextmanager
def attending(config, shared: SharedPrompts | None) -> Iterator[None]:
    """Inside the block, this thread's forwards through the attention modules built from
    `config` (a model's or the drafter's: the modules hold that very object) use
    `shared_prompt_attention` when `shared` is given (other threads sampling or replaying
    with the same model keep theirs: models.attention_switch)."""
    if shared is None:
        yield
        return
    with attention_for_thread([config], IMPLEMENTATION):
        yield


def attention_inputs(shared: SharedPrompts | None, mask: torch.Tensor | None) -> dict:
    """A forward's attention keywords: the 2D attention mask over whole rows (prompt and
    completion, left-padded), or with `shared` the prompts and the mask over the rows' own
    columns."""
    return {"attention_mask": mask} if shared is None else {"shared_prompts": shared, "own_mask": mask}


def encode_prompt(model: PreTrainedModel, prompt_ids: list[int], keep_features: bool,
                  progress: Callable[[int], None] | None = None) -> tuple[PrefixKV, torch.Tensor]:
    """One prompt's K/V (1, kv_heads, positions, d per layer) and its final-norm features:
    (1, positions, d) if `keep_features`, else the last position's (1, 1, d). Encoded in
    chunks of PREFILL_CHUNK positions, each attending in place to the K/V of the chunks
    before it (replay's cascade attention), so nothing but the K/V grows with the prompt;
    `progress`, if given, gets the positions encoded after each chunk."""
    parts: list[PrefixKV] = []
    features = []
    for start in range(0, len(prompt_ids), PREFILL_CHUNK):
        hidden, cache = forward_cascade(model, [prompt_ids[start:start + PREFILL_CHUNK]], start, parts)
        parts.append(new_kv(cache, 0))
        features.append(hidden if keep_features else hidden[:, -1:])
        if progress is not None:
            progress(min(start + PREFILL_CHUNK, len(prompt_ids)))
    return _joined(parts), torch.cat(features, dim=1) if keep_features else features[-1]


def _joined(parts: list[PrefixKV]) -> PrefixKV:
    """The chunks' K/V as one run of positions, joined layer by layer (each layer's chunks go
    as it is joined: the prompt's K/V is held about once, not twice)."""
    if len(parts) == 1:
        return parts[0]
    keys, values = [], []
    for layer in range(len(parts[0][0])):
        keys.append(torch.cat([p[0][layer] for p in parts], dim=-2))
        values.append(torch.cat([p[1][layer] for p in parts], dim=-2))
        for p in parts:
            p[0][layer] = p[1][layer] = None
    return keys, values


def prefill_logger(tree: int, trees: int, positions: int) -> Callable[[int], None] | None:
    """A progress callback that logs a prompt's prefill chunk by chunk; None for a prompt of one chunk."""
    if positions <= PREFILL_CHUNK:
        return None
    start = time.perf_counter()

    def progress(done: int) -> None:
        log.info("prefill of prompt %d/%d: %d/%d positions (%.1f s)", tree + 1, trees, done, positions,
                 time.perf_counter() - start)

    return progress
