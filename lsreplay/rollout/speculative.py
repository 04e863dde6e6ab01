"""Lossless speculative decoding with an EAGLE-style drafter (EAGLE-1 chain drafting).

One round, for every live sequence whose committed tokens are x_0..x_N (the target's KV
cache holds positions 0..N-1, x_N is not yet encoded):

1. The drafter catches up on the pairs (x_{t+1}, h_t) it has not seen, with the target's
   real features h_t, which predicts h^_N; then it drafts k tokens autoregressively,
   feeding its own predicted features back: (d_j, h^_{N+j-1}) -> h^_{N+j} -> d_{j+1}.
2. The target encodes [x_N, d_1..d_k] in ONE forward and returns p at N..N+k.
3. Acceptance (Leviathan et al. 2023; Chen et al. 2023): accept d_j with probability
   min(1, p(d_j)/q(d_j)); at the first rejection sample from norm(max(0, p - q)); if all k
   are accepted sample a bonus token from p. Greedy: accept while d_j == argmax p, then
   take argmax p. So a round emits a+1 tokens (a = accepted drafts), at least one.
4. The target cache keeps x_N..x_{N+a}; the drafter cache drops every drafted entry (it
   was built on predicted features) and next round re-reads those positions with the
   target's real features, as EAGLE does.

Batches. Rows accept different numbers of drafts, so their caches stop lining up. Both
caches stay one shared tensor per layer: the columns a row rejected become holes that an
attention mask (kept per row, per cache column) hides, and position ids are tracked per
row, so a row sees exactly its own tokens at its own positions. The cache is cropped to
the longest row after each round; finished rows leave the batch (their cache rows are
dropped); a lone remaining row has its holes compacted away so decoding goes on without
any mask. Inputs are either a (B, T) left-padded tensor with its attention_mask, or a
list of variable-length prompts (left-padded here).

Taking over. `Speculator.resume` starts from a target cache another decoder filled (the
tree sampler's, when few sequences are left: rollout.tree_sampler.Speculation), with the
features h_t that decoder recorded, so nothing is re-encoded; `decode_rounds` runs the
rounds for both entry points and can record each emitted token's logprob (under the
distribution sampled from, as the tree sampler records it). Where the tree sampler holds
each prompt's K/V once (rollout.shared_prompt), the rows keep attending to that one copy:
the caches hold the rows' own columns, and the drafter encodes each prompt once too
(`HeldPrompts`).

Draft vocabulary. `draft_vocab` (token ids) restricts the drafter's output layer to those
rows of the LM head: on a 49k-vocabulary model that layer is most of a one-layer
drafter's cost. q is then a proper distribution over that subset (zero elsewhere), so the
acceptance rule stays exact; the target always scores the full vocabulary.

Exactness. Greedy output equals plain greedy decoding of the target up to floating point:
the verify forward scores k+1 positions in one matmul, which may round differently from
one-at-a-time decoding, so a near-tie in the argmax could in principle flip.
Models: every family replay supports (models/families.py: the decoder's last hidden states
are the features, the family's logits come from models/logits.py). The target's cache keeps
every position (hf_compat.full_cache), so that rejected drafts can be cropped, and a model
with sliding-window or chunked layers attends by masks built from positions
(position_masks.py): the holes rejected drafts leave in a row's cache would shift
transformers' own windows.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from lsreplay.models.distribution import SamplingParams, processed_logits, token_logprobs
from lsreplay.models.families import windowed_layers
from lsreplay.models.hf_compat import decoder, full_cache, with_cache
from lsreplay.models.logits import float_logits
from lsreplay.replay.segments import PrefixKV, new_kv
from lsreplay.rollout.position_masks import PositionMasks
from lsreplay.rollout.sampling import draw
from lsreplay.rollout.shared_prompt import PREFILL_CHUNK, SharedPrompts, attending, attention_inputs

log = logging.getLogger(__name__)

DEFAULT_DRAFT_LEN = 4


class DraftLengthPolicy(Protocol):
    """What `decode_rounds` asks of a draft-length chooser (see rollout.bandit)."""

    def choose(self, batch_size: int) -> int: ...

    def update(self, batch_size: int, draft_len: int, tokens: int, seconds: float) -> None: ...


@dataclass
class SpecStats:
    """Counters one or more `speculative_generate` calls add to.

    A row-verification is one live sequence in one verify forward; it emits its accepted
    drafts plus one token, so accept_len = tokens emitted per target forward per sequence.
    """

    target_forwards: int = 0  # target forward calls: prefill + one per round
    verify_rows: int = 0  # row-verifications (sum over rounds of live sequences)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    drafter_forwards: int = 0
    draft_seconds: float = 0.0  # drafter catch-up + drafting
    verify_seconds: float = 0.0  # target verify forwards and acceptance
    draft_lens: list[int] = field(default_factory=list)  # k used in each round

    @property
    def accept_len(self) -> float:
        return (self.accepted + self.verify_rows) / self.verify_rows if self.verify_rows else float("nan")

    @property
    def acceptance(self) -> float:
        """Share of drafted tokens accepted."""
        return self.accepted / self.drafted if self.drafted else float("nan")


# ---------------------------------------------------------------- acceptance rules


def _accept_greedy(logits: torch.Tensor, drafts: torch.LongTensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Accepted count a (A,) and the next token (A,) from target logits (A, k+1, V) and drafts (A, k)."""
    best = logits.argmax(-1)
    accepted = (drafts == best[:, :-1]).long().cumprod(1).sum(1)
    return accepted, best.gather(1, accepted[:, None])[:, 0]


def _accept_sampled(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.LongTensor, generator: torch.Generator | None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The speculative-sampling rule over target probs p (A, k+1, V) and draft probs q (A, k, V).

    Draft j is kept with probability min(1, p/q); the first rejected position samples from
    norm(max(0, p - q)), and a row that keeps all k samples its bonus token from p[k].
    """
    rows = torch.arange(p.shape[0], device=p.device)
    index = drafts[..., None]
    p_draft, q_draft = p[:, :-1].gather(2, index)[..., 0], q.gather(2, index)[..., 0]
    u = torch.rand(p_draft.shape, generator=generator, device=p.device, dtype=p.dtype)
    # u < p/q, written without the division; q(d) > 0 because d was drawn from q.
    accepted = (u * q_draft < p_draft).long().cumprod(1).sum(1)
    p_at = p[rows, accepted]
    q_at = torch.cat([q, q.new_zeros(q.shape[0], 1, q.shape[2])], dim=1)[rows, accepted]  # q = 0 at the bonus position
    residual = (p_at - q_at).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # total is 0 only when p == q, where rejection has probability 0; fall back to p for rounding.
    residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p_at)
    return accepted, draw(residual, generator)


# ---------------------------------------------------------------- inputs and outputs


def _as_batch(input_ids, attention_mask) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """(B, T) ids and bool mask, left-padded; a list of prompts is padded here."""
    if isinstance(input_ids, (list, tuple)):
        rows = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in input_ids]
        if not rows or min(len(r) for r in rows) == 0:
            raise ValueError("every prompt needs at least one token")
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=rows[0].device)
        mask = torch.zeros(len(rows), width, dtype=torch.bool, device=rows[0].device)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = r
            mask[i, width - len(r) :] = True
        return ids, mask
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (B, T) or a list of prompts, got shape {tuple(input_ids.shape)}")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    if not mask[:, -1].all() or (mask[:, 1:].long() < mask[:, :-1].long()).any():
        raise ValueError("input_ids must be left-padded: each row's attention_mask a run of 0s then 1s, ending in 1")
    return input_ids, mask


def _eos_tensor(eos_token_id, device) -> torch.LongTensor:
    if eos_token_id is None:
        return torch.empty(0, dtype=torch.long, device=device)
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


def _pad_value(pad_token_id, eos_token_id) -> int:
    if pad_token_id is not None:
        return pad_token_id
    if eos_token_id is None:
        return 0
    return eos_token_id if isinstance(eos_token_id, int) else next(iter(eos_token_id))


def _stack(outputs: list[list[int]], pad: int, device) -> torch.LongTensor:
    width = max(len(o) for o in outputs)
    result = torch.full((len(outputs), width), pad, dtype=torch.long, device=device)
    for i, o in enumerate(outputs):
        result[i, : len(o)] = torch.tensor(o, dtype=torch.long, device=device)
    return result


def host_lists(*tensors: torch.Tensor) -> list[list]:
    """`.tolist()` of each tensor with one wait for the device, not one each: the copies off a
    GPU go into page-locked memory without waiting, then the stream is waited for once."""
    if any(t.is_cuda for t in tensors):
        copies = [t.to("cpu", non_blocking=True) for t in tensors]
        torch.cuda.current_stream(tensors[0].device).synchronize()
        tensors = tuple(copies)
    return [t.tolist() for t in tensors]


def _positions(mask: torch.BoolTensor) -> torch.LongTensor:
    """HF's convention for left padding: count of real tokens before, padding at 0."""
    return (mask.long().cumsum(1) - 1).clamp(min=0)


# ---------------------------------------------------------------- caches with holes


def _crop_to(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _compact(cache: DynamicCache, keep: torch.LongTensor) -> None:
    """Keep only cache columns `keep` (one row's holes removed); every layer is a plain DynamicLayer."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)


def _no_positions(config, like: torch.Tensor) -> PrefixKV:
    """The K/V of no position (a prompt of one token has no pair of its own for the drafter)."""
    empty = like.new_zeros(1, config.num_key_value_heads, 0, config.head_dim)
    return [empty] * config.num_hidden_layers, [empty] * config.num_hidden_layers


class _MaskedCache:
    """A DynamicCache plus a per-row visibility mask over its columns (holes = False), and the
    prompts its rows attend to besides, where those are held once (`shared`; None: the
    cache's rows hold their prompts)."""

    def __init__(self, cache: DynamicCache, mask: torch.BoolTensor, shared: SharedPrompts | None = None):
        self.cache, self.shared = cache, shared
        self.mask = mask  # (A, columns the cache holds)
        self.holes = not bool(mask.all())

    # `visible`: whether every entry of `new` is true, where the caller knows it on the host;
    # asking the device instead waits for it (twice per drafted token).
    def attend(self, new: torch.BoolTensor, visible: bool | None = None) -> torch.BoolTensor | None:
        """The 2D mask for a forward adding columns `new` (A, n); None when nothing is hidden."""
        if not self.holes and (bool(new.all()) if visible is None else visible):
            return None
        return torch.cat([self.mask, new], dim=1)

    def extend(self, new: torch.BoolTensor, visible: bool | None = None) -> None:
        self.mask = torch.cat([self.mask, new], dim=1)
        self.holes = self.holes or not (bool(new.all()) if visible is None else visible)

    def crop(self, length: int) -> None:
        _crop_to(self.cache, length)
        self.mask = self.mask[:, :length]

    def select(self, rows: torch.LongTensor) -> None:
        self.cache.reorder_cache(rows)
        self.mask = self.mask[rows]
        if self.shared is not None:
            self.shared.select(rows.tolist())
        if self.holes and self.mask.shape[0] == 1:
            keep = self.mask[0].nonzero()[:, 0]
            _compact(self.cache, keep)
            self.mask = self.mask[:, keep]
        self.holes = not bool(self.mask.all())


@dataclass
class HeldPrompts:
    """Rows whose prompts the tree sampler holds once (rollout.shared_prompt): the target's K/V
    of each prompt and each row's tree (`shared`), and per tree its prompt's ids and the
    target's features at its positions (1, positions, d)."""

    shared: SharedPrompts
    ids: list[list[int]]
    features: list[torch.Tensor]

    def last(self) -> tuple[torch.LongTensor, torch.Tensor]:
        """Each row's prompt's last token (A, 1) and the feature there (A, 1, d)."""
        trees = self.shared.trees
        tokens = torch.tensor([[self.ids[t][-1]] for t in trees], device=self.features[0].device)
        return tokens, torch.cat([self.features[t][:, -1:] for t in trees])


# ---------------------------------------------------------------- the decoder


class Speculator:
    """Draft-and-verify state over a batch of sequences; row i is the i-th sequence still decoding.

    Start it with `prefill` (encode prompts) or `resume` (take over a target cache that
    another decoder filled), then call `round` until done (`decode_rounds` does that).
    """

    def __init__(self, target, drafter, params: SamplingParams, generator, draft_vocab, stats: SpecStats):
        self.position_masks = PositionMasks(target.config) if windowed_layers(target.config) else None
        self.target, self.drafter, self.params, self.generator, self.stats = target, drafter, params, generator, stats
        head = target.get_output_embeddings()
        self.vocab_size = head.weight.shape[0]
        if draft_vocab is None:
            self.vocab, self.draft_weight, self.draft_bias = None, None, None
        else:
            self.vocab = torch.as_tensor(draft_vocab, dtype=torch.long, device=head.weight.device).unique()
            self.draft_weight = head.weight.detach()[self.vocab].contiguous()
            self.draft_bias = None if head.bias is None else head.bias.detach()[self.vocab]

    # -- distributions

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution over the last dim, in float32: temperature, then top-k and
        top-p, exactly as sampling.sample_next draws (so the tokens follow what plain sampling would)."""
        return processed_logits(logits.float(), self.params).softmax(-1)

    def _pick(self, logits: torch.Tensor) -> torch.LongTensor:
        if self.params.temperature == 0:
            return logits.argmax(-1)
        return draw(self._probs(logits), self.generator)

    def _draft_token(self, features: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """One draft token per row (full-vocabulary ids) and q over the full vocabulary (None if greedy)."""
        if self.vocab is None:
            logits = self.drafter.logits(features)
        else:
            logits = F.linear(features, self.draft_weight, self.draft_bias)
        if self.params.temperature == 0:
            token, q = logits.argmax(-1), None
        else:
            q = self._probs(logits)
            token = draw(q, self.generator)
        if self.vocab is not None:
            token = self.vocab[token]
            if q is not None:
                full = q.new_zeros(q.shape[0], self.vocab_size)
                q = full.index_copy_(1, self.vocab, q)
        return token, q

    # -- the target

    def _target(self, ids, position_ids, attention_mask, cache, shared: SharedPrompts | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Features (A, n, d) and logits (A, n, V) of n new positions."""
        if attention_mask is not None and self.position_masks is not None:  # see position_masks.py
            attention_mask = self.position_masks(attention_mask.bool(), ids.shape[1], self.target.dtype)
        with attending(self.target.config, shared):
            hidden = decoder(self.target)(
                input_ids=ids, position_ids=position_ids, use_cache=True, **attention_inputs(shared, attention_mask),
                **with_cache(cache)).last_hidden_state
        self.stats.target_forwards += 1
        return hidden, float_logits(self.target, hidden)

    def _drafter(self, ids, features, position_ids, attention_mask) -> torch.Tensor:
        """The drafter's predicted features (A, n, d) of n new pairs, appended to its cache."""
        with attending(self.drafter.config, self.d.shared):
            return self.drafter(ids, features, position_ids, cache=self.d.cache,
                                **attention_inputs(self.d.shared, attention_mask))

    def prefill(self, ids: torch.LongTensor, mask: torch.BoolTensor) -> torch.LongTensor:
        """Encode left-padded prompts (A, T) and pick each row's first token."""
        cache = full_cache(self.target)
        hidden, logits = self._target(ids, _positions(mask), None if bool(mask.all()) else mask, cache)
        first = self._pick(logits[:, -1])
        self.resume(cache, ids, mask, hidden, first)
        return first

    def resume(self, cache: DynamicCache, ids: torch.LongTensor, mask: torch.BoolTensor, features: torch.Tensor,
               last: torch.LongTensor, prompts: HeldPrompts | None = None) -> None:
        """Take over a target cache as it is, with nothing re-encoded.

        Row i's cache columns hold tokens ids[i] (A, C) where mask[i] is true, one run of
        padding then real positions 0.., ending at the last column (left padding; a
        decoder appending a column per token keeps this); `features` (A, C, d) are the
        target's final-norm features at those columns, and `last` (A,) is each row's
        newest token, committed but not yet encoded. The drafter's first round catches up
        on every pair (x_{t+1}, h_t) of these rows. With `prompts`, the cache columns are the
        rows' own, after their prompts, whose K/V the rows attend to once per tree; the
        drafter encodes each prompt's pairs once per tree here and catches up on the rest.
        """
        offset, own_mask = torch.zeros_like(last), mask  # offset: the position of each row's first column
        if prompts is not None:
            # The prompt's last column opens each row's catch-up: its pair (x_P, h_{P-1}) is the row's own.
            tokens, feature = prompts.last()
            ids, features = torch.cat([tokens, ids], dim=1), torch.cat([feature, features], dim=1)
            mask = torch.cat([mask.new_ones(len(mask), 1), mask], dim=1)
            offset = prompts.shared.lengths - 1
        self.t = _MaskedCache(cache, own_mask, None if prompts is None else prompts.shared)
        drafter_prompts = None if prompts is None else SharedPrompts(self._drafter_prompts(prompts),
                                                                     prompts.shared.trees)
        self.d = _MaskedCache(DynamicCache(config=self.drafter.config), mask[:, :0], drafter_prompts)
        self.pos = offset + mask.sum(1)  # position of `last`
        self.last = last
        # Pair t = (x_{t+1}, h_t): tokens shift left by one, `last` closes the row.
        self.cu_tok = torch.cat([ids[:, 1:], last[:, None]], dim=1)
        self.cu_h = torch.where(mask[..., None], features, torch.zeros((), dtype=features.dtype, device=ids.device))
        self.cu_pos, self.cu_valid = offset[:, None] + _positions(mask), mask
        self.cu_last = torch.full_like(last, ids.shape[1] - 1)
        # On the host: each row's cu_last, and whether cu_valid still holds the padding.
        self.cu_ends, self.cu_padded = [ids.shape[1] - 1] * len(last), not bool(mask.all())

    def _drafter_prompts(self, prompts: HeldPrompts) -> list[PrefixKV]:
        """The drafter's K/V of each prompt's own pairs (x_{t+1}, h_t), t < positions - 1, one
        copy per tree, encoded PREFILL_CHUNK pairs a forward."""
        kvs = []
        for ids, features in zip(prompts.ids, prompts.features):
            cache, pairs = DynamicCache(config=self.drafter.config), len(ids) - 1
            tokens = torch.tensor([ids[1:]], device=features.device)
            for start in range(0, pairs, PREFILL_CHUNK):
                end = min(start + PREFILL_CHUNK, pairs)
                positions = torch.arange(start, end, device=features.device)[None]
                self.drafter(tokens[:, start:end], features[:, start:end], positions, cache=cache)
            kvs.append(new_kv(cache, 0) if pairs else _no_positions(self.drafter.config, features))
        return kvs

    def round(self, k: int) -> tuple[torch.LongTensor, torch.LongTensor, torch.Tensor]:
        """One draft + verify round (k = 0: no drafts, one token per row, as plain decoding).

        Returns the tokens (A, k+1), of which row i emits the first accepted[i] + 1, the
        accepted counts (a list of A ints), and the verify logits (A, k+1, V): position j
        scores token j.
        """
        stats, rows = self.stats, torch.arange(self.last.shape[0], device=self.last.device)
        start = time.perf_counter()
        # 1. Catch-up with the target's real features; trailing columns no row uses are skipped.
        width = max(self.cu_ends) + 1
        valid = self.cu_valid[:, :width]
        all_valid = None if self.cu_padded else min(self.cu_ends) + 1 == width  # padded: the device knows
        out = self._drafter(self.cu_tok[:, :width], self.cu_h[:, :width], self.cu_pos[:, :width],
                            self.d.attend(valid, all_valid))
        self.d.extend(valid, all_valid)
        base = self.d.mask.shape[1]
        features = out[rows, self.cu_last]  # h^ at each row's position `pos`
        # 2. Draft k tokens, feeding predicted features back.
        drafts, qs = [], []
        for j in range(k):
            token, q = self._draft_token(features)
            drafts.append(token)
            qs.append(q)
            if j + 1 < k:
                one = torch.ones_like(valid[:, :1])
                features = self._drafter(token[:, None], features[:, None], (self.pos + j)[:, None],
                                         self.d.attend(one, True))[:, 0]
                self.d.extend(one, True)
        self.d.crop(base)  # drafted entries rest on predicted features: drop them
        stats.drafter_forwards += k
        # k = 0 drafts nothing: the round verifies `last` alone, a plain decoding step.
        drafts = torch.stack(drafts, dim=1) if k else self.last.new_zeros(len(rows), 0)
        mid = time.perf_counter()
        # 3. Verify [last, d_1..d_k] in one target forward.
        block = torch.cat([self.last[:, None], drafts], dim=1)
        offsets = torch.arange(k + 1, device=block.device)
        block_pos = self.pos[:, None] + offsets
        length = self.t.mask.shape[1]
        hidden, logits = self._target(block, block_pos, self.t.attend(torch.ones_like(block, dtype=torch.bool), True),
                                      self.t.cache, self.t.shared)
        if self.params.temperature == 0:
            accepted, nxt = _accept_greedy(logits, drafts)
        else:
            q = torch.stack(qs, dim=1) if k else logits.new_zeros(len(rows), 0, self.vocab_size, dtype=torch.float)
            accepted, nxt = _accept_sampled(self._probs(logits), q, drafts, self.generator)
        # 4. Keep each row's x_N..x_{N+a}; columns past the longest row go.
        keep = offsets[None] <= accepted[:, None]
        (counts,) = host_lists(accepted)  # the round's one wait for the device
        used = max(counts) + 1
        self.t.extend(keep[:, :used], min(counts) + 1 == used)
        self.t.crop(length + used)
        # 5. The emitted tokens d_1..d_a, next; they are also next round's catch-up pairs
        # (x_{t+1}, h_t) for the positions just verified.
        tokens = torch.cat([drafts, drafts.new_zeros(len(rows), 1)], dim=1)
        tokens[rows, accepted] = nxt
        self.cu_tok, self.cu_h, self.cu_pos, self.cu_valid, self.cu_last = tokens, hidden, block_pos, keep, accepted
        self.cu_ends, self.cu_padded = counts, False
        self.pos = self.pos + accepted + 1
        self.last = nxt
        stats.draft_seconds += mid - start
        stats.verify_seconds += time.perf_counter() - mid
        stats.verify_rows += len(rows)
        stats.drafted += k * len(rows)
        stats.accepted += sum(counts)
        stats.draft_lens.append(k)
        return tokens, counts, logits

    def select(self, keep: torch.LongTensor) -> None:
        """Keep only rows `keep` (finished rows leave the batch)."""
        self.t.select(keep)
        self.d.select(keep)
        for name in ("pos", "last", "cu_tok", "cu_h", "cu_pos", "cu_valid", "cu_last"):
            setattr(self, name, getattr(self, name)[keep])
        self.cu_ends = [self.cu_ends[i] for i in keep.tolist()]


def check_draft_len(draft_len: int | DraftLengthPolicy) -> None:
    if not hasattr(draft_len, "choose") and int(draft_len) < 1:
        raise ValueError(f"draft_len must be >= 1 or a policy with choose/update, got {draft_len}")


def _kept(new: list[int], eos_ids: set[int], room: int) -> int:
    """How many of a round's new tokens a row keeps: up to its first EOS, at most `room`."""
    ends = next((i + 1 for i, token in enumerate(new) if token in eos_ids), len(new))
    return min(ends, room)


def _ended(output: list[int], eos_ids: set[int], max_new_tokens: int) -> bool:
    return output[-1] in eos_ids or len(output) >= max_new_tokens


# on_round(rows, draft_len, tokens, seconds, ended): see decode_rounds.
RoundHook = Callable[[list[int], int, int, float, list[int]], None]


def decode_rounds(spec: Speculator, outputs: list[list[int]], max_new_tokens: int, eos_ids: set[int],
                  draft_len: int | DraftLengthPolicy, logprobs: list[list[float]] | None = None,
                  on_round: RoundHook | None = None) -> None:
    """Run speculative rounds until every row has ended (EOS, or max_new_tokens tokens).

    Row i of `spec` owns outputs[i], its tokens so far (the newest is spec.last, not yet
    encoded); each round appends the tokens the row emits, cut after its first EOS or at
    the cap, and, if `logprobs` is given, their logprobs under the sampling distribution
    (sampling.sample_next's) from the verify logits. `draft_len`: tokens drafted per round, or a policy asked every
    round and rewarded with the tokens kept per second. `on_round`, after each round, gets
    the indices of the rows that took part, the draft length used, the tokens kept, the
    round's seconds (finished rows leaving the batch included) and the rows that ended.
    """
    policy = draft_len if hasattr(draft_len, "choose") else None
    live = list(range(len(outputs)))  # the output index of each batch row
    going = [i for i, out in enumerate(outputs) if not _ended(out, eos_ids, max_new_tokens)]
    while going:
        start = time.perf_counter()
        if len(going) < len(live):
            live = [live[i] for i in going]
            spec.select(torch.tensor(going, device=spec.last.device))
        k = policy.choose(len(live)) if policy is not None else draft_len
        # Never draft past what the longest live row still needs.
        k_used = min(k, max(1, max_new_tokens - min(len(outputs[r]) for r in live) - 1))
        tokens, accepted, logits = spec.round(k_used)
        if logprobs is None:
            (new_tokens,), new_logprobs = host_lists(tokens), None
        else:
            new_tokens, new_logprobs = host_lists(tokens, token_logprobs(logits.float(), tokens, spec.params))
        kept_total, going, ended = 0, [], []
        for i, (row, new, a) in enumerate(zip(live, new_tokens, accepted)):
            kept = _kept(new[:a + 1], eos_ids, max_new_tokens - len(outputs[row]))
            outputs[row] += new[:kept]
            if logprobs is not None:
                logprobs[row] += new_logprobs[i][:kept]
            kept_total += kept
            if _ended(outputs[row], eos_ids, max_new_tokens):
                ended.append(row)
            else:
                going.append(i)
        seconds = time.perf_counter() - start
        if policy is not None:
            policy.update(len(live), k, kept_total, seconds)
        if on_round is not None:
            on_round(live, k_used, kept_total, seconds, ended)


@contextlib.contextmanager
def evaluating(*modules: torch.nn.Module):
    """Put modules in eval mode for the block, then restore each one's own mode."""
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


@torch.inference_mode()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.LongTensor | list,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    draft_len: int | DraftLengthPolicy | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    stats: SpecStats | None = None,
    draft_vocab: torch.LongTensor | list[int] | None = None,
    pad_token_id: int | None = None,
    top_k: int = 0,
) -> torch.LongTensor:
    """Generate up to `max_new_tokens` per prompt with drafter proposals verified by `target`.

    `input_ids`: a (B, T) tensor, left-padded, with `attention_mask` (None = no padding),
    or a list of B prompts (lists or 1-D tensors of ids) of any lengths. Returns (B, L) new
    ids only, L = the longest completion; a completion ends after its first EOS (which it
    keeps) and is padded with `pad_token_id` (default: the first EOS id, else 0).

    temperature 0 is greedy: exactly the target's greedy tokens. Otherwise tokens follow
    the target's distribution after temperature, top-k and top-p (as sampling.sample_next),
    whatever the drafter; `generator` (on the model's device) makes the draw reproducible.
    `draft_len`: tokens drafted per round (default DEFAULT_DRAFT_LEN), or a policy with
    choose/update (e.g. rollout.bandit.DraftLengthBandit) asked every round and rewarded
    with emitted tokens per second. `draft_vocab`: restrict draft proposals to these token
    ids. `stats`, if given, accumulates counters (SpecStats.accept_len: tokens per target
    forward).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    draft_len = DEFAULT_DRAFT_LEN if draft_len is None else draft_len
    check_draft_len(draft_len)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    stats = SpecStats() if stats is None else stats
    ids, mask = _as_batch(input_ids, attention_mask)
    eos_ids = set(_eos_tensor(eos_token_id, ids.device).tolist())
    with evaluating(target, drafter):
        spec = Speculator(target, drafter, params, generator, draft_vocab, stats)
        outputs = [[token] for token in spec.prefill(ids, mask).tolist()]
        decode_rounds(spec, outputs, max_new_tokens, eos_ids, draft_len)
    log.debug("speculative decoding: %s (accept_len %.2f)", stats, stats.accept_len)
    return _stack(outputs, _pad_value(pad_token_id, eos_token_id), ids.device)


@torch.inference_mode()
def greedy_generate(
    target,
    input_ids: torch.LongTensor | list,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int | None = None,
) -> torch.LongTensor:
    """Plain greedy decoding with a KV cache, one token per forward: the reference and the baseline.

    Same inputs and output layout as `speculative_generate`.
    """
    ids, mask = _as_batch(input_ids, attention_mask)
    eos = _eos_tensor(eos_token_id, ids.device)
    pad = _pad_value(pad_token_id, eos_token_id)
    cache = DynamicCache(config=target.config)
    positions = _positions(mask)
    full_mask = None if bool(mask.all()) else mask
    out = target(input_ids=ids, attention_mask=full_mask, position_ids=positions, use_cache=True,
                 logits_to_keep=1, **with_cache(cache))
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    generated = []
    position = positions[:, -1]
    for step in range(max_new_tokens):
        token = out.logits[:, -1].argmax(-1)
        token = torch.where(done, torch.full_like(token, pad), token)
        generated.append(token)
        done = done | torch.isin(token, eos)
        if bool(done.all()) or step + 1 == max_new_tokens:
            break
        position = position + 1
        if full_mask is not None:
            full_mask = torch.cat([full_mask, torch.ones_like(full_mask[:, :1])], dim=1)
        out = target(input_ids=token[:, None], attention_mask=full_mask, position_ids=position[:, None],
                     use_cache=True, logits_to_keep=1, **with_cache(cache))
    return torch.stack(generated, dim=1)
