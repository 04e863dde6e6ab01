"""Episodes' replies decoded by lsreplay's own sampler (rollout.engine=hf), each episode's KV
kept between its turns.

One batch decodes every reply in flight, whatever its turn: a request joins as soon as the
scheduler hands it over (lsreplay.rollout.episodes), a reply leaves as soon as it ends. A
request prefills only what its episode's kept KV does not hold (the prompt at its first
turn; then the reply's last token and the environment's answer), is forked into its
fan-out's rows, and joins the batch. A reply that ends at EOS leaves with its row's KV, which
the episode's next turn continues from: no turn reads the history again.

The batch's cache is left-padded: each row's positions lie at the right end of the columns,
its `mask` marks them, and joining rows pads the shorter side on the left; leading columns no
row uses are dropped as rows leave. Each request draws from its own generator
(`generator_for(*request.key)`), its rows together, so its draws do not depend on what else
shares the batch; the logits can, in their last bits, with the batch's shape, which depends
on when the environment answers (bit-reproducible under the scheduler's `barrier`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from lsreplay.models.distribution import SamplingParams
from lsreplay.models.hf_compat import decoder, full_cache, with_cache
from lsreplay.models.logits import float_logits
from lsreplay.rollout.episodes import TurnReply, TurnRequest
from lsreplay.rollout.sampling import sample_next
from lsreplay.rollout.speculative import evaluating, host_lists


@dataclass
class KeptKV:
    """One episode's keys and values after a reply, per layer (1, kv_heads, positions, d): its
    whole sequence but the reply's last token, which the next turn reads first."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]


@dataclass
class _Row:
    request: int
    path: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    level: int = 0


@dataclass
class _Request:
    turn: TurnRequest
    generator: torch.Generator
    ends: list[int]  # reply length at each level's branch point, the last level's: max_new_tokens
    rows: int = 0  # live
    positions: int = 0


class HFTurns:
    """Turn requests decoded in one continuous batch (see the module); a context manager that
    holds the model in eval mode. `figures`: prefill_positions (prompt and answer tokens read),
    decode_positions, decode_steps."""

    def __init__(self, model, max_new_tokens: int, params: SamplingParams, eos: int | list[int],
                 generator_for: Callable[[int, tuple[int, ...], int], torch.Generator],
                 progress: Callable[[int], None] | None = None):
        self.model, self.max_new_tokens, self.params = model, max_new_tokens, params
        self.eos = {eos} if isinstance(eos, int) else set(eos)
        self.generator_for, self.progress = generator_for, progress
        self.requests: dict[int, _Request] = {}
        self.pending: list[TurnRequest] = []
        self.rows: list[_Row] = []
        self.cache: DynamicCache | None = None
        self.mask = self.logits = None
        self.figures = {"prefill_positions": 0, "decode_positions": 0, "decode_steps": 0}
        self._eval = evaluating(model)

    def __enter__(self) -> HFTurns:
        self._eval.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._eval.__exit__(*exc)

    def submit(self, requests: list[TurnRequest]) -> None:
        self.pending += requests

    @torch.inference_mode()
    def poll(self, wait: float = 0.0) -> list[TurnReply]:
        """The replies that ended at the next decode step (the pending requests joined first)."""
        if self.pending:
            self._join([self._prefill(r) for r in self.pending])
            self.pending = []
        return self._step() if self.rows else []

    # -- joining -------------------------------------------------------------------------
    def _prefill(self, turn: TurnRequest) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, list[_Row]]:
        """A request's own KV after reading what its kept KV lacks, forked into its first
        level's rows: (keys, values, next-token logits, rows)."""
        kept: KeptKV | None = turn.state
        start = 0 if kept is None else kept.length
        new = turn.tokens[start:]
        cache = full_cache(self.model) if kept is None else _cache(self.model, kept.keys, kept.values)
        device = self.model.device
        ids = torch.tensor([new], device=device)
        hidden = decoder(self.model)(input_ids=ids, attention_mask=torch.ones(1, start + len(new), dtype=torch.long,
                                                                                device=device),
                                     position_ids=torch.arange(start, start + len(new), device=device)[None],
                                     use_cache=True, **with_cache(cache)).last_hidden_state
        fan = turn.fan_outs[0]
        ends = [min(sum(turn.segments[:i + 1]), self.max_new_tokens) for i in range(len(turn.segments))]
        request = _Request(turn, self.generator_for(*turn.key), ends + [self.max_new_tokens], fan, len(new))
        self.requests[turn.id] = request
        self.figures["prefill_positions"] += len(new)
        keys = [layer.keys.repeat(fan, 1, 1, 1) for layer in cache.layers]
        values = [layer.values.repeat(fan, 1, 1, 1) for layer in cache.layers]
        rows = [_Row(turn.id, (j,)) for j in range(fan)]
        return keys, values, float_logits(self.model, hidden[:, -1]).repeat(fan, 1), rows

    def _join(self, parts: list[tuple]) -> None:
        """The batch and the new requests' rows as one left-padded batch."""
        batch = [([l.keys for l in self.cache.layers], [l.values for l in self.cache.layers], self.mask)] \
            if self.rows else []
        for keys, values, _, rows in parts:
            batch.append((keys, values, torch.ones(len(rows), keys[0].shape[-2], dtype=torch.long,
                                                   device=keys[0].device)))
        width = max(mask.shape[1] for _, _, mask in batch)
        pad = [width - mask.shape[1] for _, _, mask in batch]
        def padded(part: int) -> list[torch.Tensor]:  # part 0: keys, 1: values; each layer's, left-padded
            return [torch.cat([F.pad(piece[part][i], (0, 0, p, 0)) for piece, p in zip(batch, pad)])
                    for i in range(len(batch[0][part]))]

        self.cache = _cache(self.model, padded(0), padded(1))
        self.mask = torch.cat([F.pad(m, (p, 0)) for (_, _, m), p in zip(batch, pad)])
        self.logits = torch.cat(([self.logits] if self.rows else []) + [p[2] for p in parts])
        self.rows += [row for p in parts for row in p[3]]

    # -- decoding ------------------------------------------------------------------------
    def _step(self) -> list[TurnReply]:
        """One token for every row; the rows that ended leave (with their KV where the
        episode goes on), those at a branch point fork, the others are encoded."""
        tokens, logprobs = self._sample()
        token_list, logprob_list = host_lists(tokens, logprobs)
        if self.progress is not None:
            self.progress(len(self.rows))
        self.figures["decode_steps"] += 1
        ended, keep = [], []
        for i, (row, token, logprob) in enumerate(zip(self.rows, token_list, logprob_list)):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            request = self.requests[row.request]
            if token in self.eos or len(row.tokens) == self.max_new_tokens:
                ended.append(i)
            elif len(row.tokens) == request.ends[row.level]:  # a branch point: fork
                fan = request.turn.fan_outs[row.level + 1]
                keep += [(i, j) for j in range(fan)]
                request.rows += fan - 1
            else:
                keep.append((i, None))
        replies = [self._reply(i, token_list[i] in self.eos) for i in ended]
        self._select(keep, tokens)
        return replies

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One draw per row, each request's rows together from its own generator."""
        tokens = torch.empty(len(self.rows), dtype=torch.long, device=self.logits.device)
        logprobs = torch.empty(len(self.rows), device=self.logits.device)
        by_request: dict[int, list[int]] = {}
        for i, row in enumerate(self.rows):
            by_request.setdefault(row.request, []).append(i)
        for request, rows in by_request.items():
            tokens[rows], logprobs[rows] = sample_next(self.logits[rows], self.params, self.requests[request].generator)
        return tokens, logprobs

    def _reply(self, i: int, finished: bool) -> TurnReply:
        row, request = self.rows[i], self.requests[self.rows[i].request]
        request.rows -= 1
        last = request.rows == 0
        state = None
        if finished and not request.turn.final:  # the episode may go on: its KV goes with it
            n = int(self.mask[i].sum())
            state = KeptKV([l.keys[i:i + 1, :, -n:].clone() for l in self.cache.layers],
                           [l.values[i:i + 1, :, -n:].clone() for l in self.cache.layers])
        if last:
            del self.requests[row.request]
        return TurnReply(row.request, row.path, row.tokens, row.logprobs, finished, last, state,
                         request.positions if last else 0)

    def _select(self, keep: list[tuple[int, int | None]], tokens: torch.Tensor) -> None:
        """The kept rows (forked ones repeated) encode their newest token; columns no row uses go."""
        rows = []
        for i, fork in keep:
            row = self.rows[i]
            if fork is None:
                rows.append(row)
            else:
                rows.append(_Row(row.request, row.path + (fork,), list(row.tokens), list(row.logprobs), row.level + 1))
        if not rows:
            self.rows, self.cache, self.mask, self.logits = [], None, None, None
            return
        index = torch.tensor([i for i, _ in keep], device=self.mask.device)
        if len(rows) != len(self.rows) or any(fork is not None for _, fork in keep):  # rows left or forked
            mask = self.mask[index]
            lead = int((mask.cumsum(-1) == 0).sum(-1).min())  # columns every row pads
            self.mask = mask[:, lead:]
            self.cache = _cache(self.model, [l.keys[index][:, :, lead:] for l in self.cache.layers],
                                [l.values[index][:, :, lead:] for l in self.cache.layers])
        self.rows = rows
        for row in rows:
            self.requests[row.request].positions += 1
        self.figures["decode_positions"] += len(rows)
        self._encode(tokens[index])

    def _encode(self, tokens: torch.Tensor) -> None:
        positions = self.mask.sum(-1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones_like(positions)], dim=-1)
        hidden = decoder(self.model)(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=positions,
                                     use_cache=True, **with_cache(self.cache)).last_hidden_state
        self.logits = float_logits(self.model, hidden[:, -1])


def _cache(model, keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A cache holding these tensors as its layers' keys and values (not copied); every layer
    keeps every position (hf_compat.full_cache: an episode's rows join and leave the batch
    by columns, which a sliding-window layer's cache would not keep)."""
    cache = full_cache(model)
    for layer, k, v in zip(cache.layers, keys, values):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache
