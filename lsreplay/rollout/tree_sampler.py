"""Sample one prompt's rollouts as a tree, forking the KV cache at branch points.

Each prompt is encoded once; at each branch point every live sequence is forked by
repeating its rows of the cache (and of its next-token logits) along the batch
dimension, so no shared prefix is ever re-encoded. Many trees decode together: prompts
are left-padded, and all live sequences have generated the same number of tokens at
every step, so one forward per token serves them all. A sequence that emits EOS leaves
the batch (its cache rows are dropped) and becomes a leaf; it is never forked again.
Forking it could only have copied it, so such a leaf stands for every continuation it
would have been forked into: its `count` is the product of the fan-outs below it, and
the counts of a tree always sum to prod(branching), the G samples its weights stand for.

One copy of each prompt (rollout.shared_prompt). Where the model allows it (`shares_prompt`:
plain attention with a cascade kernel for its device and dtype), each tree's prompt K/V is
held once and the cache holds only the rows' own positions, their completions: a fork
repeats those, not the prompt, and every decode step attends to the tree's one copy. The
prompt is encoded in chunks (a long one logs its progress). Other models keep every row's
prompt in its cache rows, the prompts left-padded. Both layouts give the same tokens and
logprobs up to floating-point rounding (tests/test_shared_prompt.py compares them).

The adaptive engine (`Speculation`). Most sequences finish early; a few long ones keep
the batch decoding one token per forward. Once no fork is pending and at most
`threshold` sequences are live, they finish by speculative decoding (rollout.speculative):
the sampler hands its KV cache, attention mask and the target features it recorded to
a `Speculator` as they are, and a draft-length policy (rollout.bandit) picks each
round's draft length. The logits come from the decoder plus the family's LM head
(models/logits.py) on the last position, which yields those features at no extra cost.
"""

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from lsreplay.models.distribution import SamplingParams
from lsreplay.models.hf_compat import decoder, full_cache, with_cache
from lsreplay.models.logits import float_logits
from lsreplay.rollout.sampling import sample_next
from lsreplay.rollout.shared_prompt import (PREFILL_CHUNK, SharedPrompts, attending, attention_inputs, encode_prompt,
                                            prefill_logger, shares_prompt)
from lsreplay.rollout.speculative import (
    DEFAULT_DRAFT_LEN,
    DraftLengthPolicy,
    HeldPrompts,
    SpecStats,
    Speculator,
    check_draft_len,
    decode_rounds,
    evaluating,
    host_lists,
)

log = logging.getLogger(__name__)


@dataclass
class TreeRollout:
    """The leaves of one prompt's tree, in depth-first order (siblings adjacent)."""

    prompt_ids: list[int]
    completions: list[list[int]]  # one per leaf, prompt excluded, EOS included if emitted
    logprobs: list[list[float]]  # raw-policy logprob of each completion token (see sampling.py)
    finished: list[bool]  # True if the completion ended with EOS
    forward_positions: int  # token positions the model was run on (prefill, decode, verify blocks)
    # The child index taken at each branch point the leaf passed; paths[j][0] is its
    # first-level subtree (leaves of different ones share no sampled token).
    paths: list[list[int]]
    # Independent samples each leaf stands for: the product of the fan-outs of the branch
    # points it ended before (1 for a leaf that reached the last level).
    counts: list[int]


@dataclass(frozen=True)
class Speculation:
    """Finish the tail by speculative decoding: once no fork is pending and at most
    `threshold` sequences are live, they continue with `drafter` (an EAGLE-style
    drafter.model.Drafter of this model) until they end.

    `draft_len`: tokens drafted per round (>= 1), or a policy (rollout.bandit.DraftLengthBandit)
    asked each round with the live count and rewarded with tokens emitted per second; a
    policy may answer 0, a round without drafts (one token per sequence), where drafting
    does not pay. `draft_vocab`: token ids the drafter may propose (see rollout.speculative)."""

    drafter: torch.nn.Module
    threshold: int
    draft_len: DraftLengthPolicy | int = DEFAULT_DRAFT_LEN
    draft_vocab: torch.LongTensor | list[int] | None = None

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(f"speculation threshold must be >= 1 live sequence, got {self.threshold}")
        check_draft_len(self.draft_len)


DECISION_KEYS = ("mode", "draft_len", "live", "tokens", "seconds", "finished")


@dataclass
class DecodeTrace:
    """What the long tail costs and what the adaptive engine decided, per decode step.

    A step is one plain forward (mode "plain": one token per live sequence, draft_len 0)
    or one speculative round (mode "spec": draft_len tokens drafted per live sequence,
    one verify forward; draft_len 0 when the policy chose not to draft). `tokens`: tokens
    the step emitted; `finished`: leaves finished after it. `spec` holds the speculative
    rounds' counters (drafted, accepted, seconds). `kv_bytes_peak`: the most K/V bytes the
    plain decode steps held (prompts and completions; the speculative tail holds fewer rows)."""

    mode: list[str] = field(default_factory=list)
    draft_len: list[int] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    spec: SpecStats = field(default_factory=SpecStats)
    kv_bytes_peak: int = 0

    def record(self, mode: str, draft_len: int, live: int, tokens: int, seconds: float, finished: int) -> None:
        for key, value in zip(DECISION_KEYS, (mode, draft_len, live, tokens, seconds, finished)):
            getattr(self, key).append(value)

    def decisions(self) -> list[dict]:
        """One JSON-able dict per decode step: step, mode, draft_len, live, tokens, seconds, finished."""
        columns = zip(*(getattr(self, key) for key in DECISION_KEYS))
        return [{"step": step, **dict(zip(DECISION_KEYS, values))} for step, values in enumerate(columns)]

    def summary(self, lengths: list[int]) -> dict:
        """Length distribution, the share of decode time spent after 90% had finished, and the
        speculative tail: rounds, tokens, accept_len (tokens emitted per sequence per verify
        forward; 0 when no round ran) and its share of decode time; the K/V bytes held at the peak."""
        if not lengths:
            return {}
        total = sum(self.seconds) or 1e-9
        tail = sum(s for s, f in zip(self.seconds, self.finished) if f >= 0.9 * len(lengths))
        spec = [i for i, mode in enumerate(self.mode) if mode == "spec"]
        spec_tokens, verify_rows = sum(self.tokens[i] for i in spec), sum(self.live[i] for i in spec)
        return {**length_summary(lengths), "decode_seconds": total, "tail_time_share": tail / total, "decode_steps": len(self.seconds),
                "spec_rounds": len(spec), "spec_tokens": spec_tokens,
                "accept_len": spec_tokens / verify_rows if verify_rows else 0.0,
                "spec_time_share": sum(self.seconds[i] for i in spec) / total, "kv_bytes_peak": self.kv_bytes_peak}


def length_summary(lengths: list[int]) -> dict:
    """p50, p90 and max of rollout lengths (nearest rank)."""
    ordered = sorted(lengths)
    p50, p90 = (ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9))
    return {"length_p50": p50, "length_p90": p90, "length_max": ordered[-1]}


@dataclass
class _Branch:
    """One live or finished sequence: its tree, and its child index at each branch point."""

    tree: int
    path: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def child(self, index: int) -> "_Branch":
        return _Branch(self.tree, self.path + (index,), list(self.tokens), list(self.logprobs))


class _Batch:
    """Live branches of many trees and the cache rows they own: row i is branches[i].

    With the prompts shared (`shared`), the cache holds the rows' own columns only, as many
    for every row (all live rows have encoded as many tokens), and a row's next position is
    its prompt's length plus that count. Otherwise prompts are left-padded in the cache rows;
    `mask` marks each row's real positions, so a row's next position is its count of real
    tokens. With speculation on, `features` keeps the model's final-norm features of every
    cache column (the drafter's catch-up input; with the prompts shared, `prompt_features`
    holds each prompt's once): a list of (rows, columns, d) chunks, one per forward, joined
    only where rows change (a fork, rows that finished) or speculation starts, so a decode
    step copies none of it."""

    def __init__(self, model, prompts: list[list[int]], params: list[SamplingParams], eos: set[int], generators,
                 progress, max_new_tokens: int, speculation: Speculation | None, share_prompt: bool):
        self.model, self.prompts, self.params, self.eos_ids, self.generators = model, prompts, params, eos, generators
        self.progress, self.max_new_tokens, self.speculation = progress, max_new_tokens, speculation
        self.share_prompt = share_prompt
        # Speculation crops the cache it takes over: every position kept (hf_compat.full_cache).
        self.cache = DynamicCache(config=model.config) if speculation is None else full_cache(model)
        self.shared: SharedPrompts | None = None
        self.mask: torch.Tensor | None = None
        self.branches = [_Branch(tree=i, path=()) for i in range(len(prompts))]
        self.leaves: list[tuple[_Branch, bool]] = []
        self.positions = [0] * len(prompts)
        self.trace = DecodeTrace()
        self.features: list[torch.Tensor] | None = [] if speculation is not None else None
        self.prompt_features: list[torch.Tensor] = []
        self.forks_done = False  # set at the last level: only then may speculation start

    def prefill(self) -> None:
        for i, p in enumerate(self.prompts):
            self.positions[i] += len(p)
        if self.share_prompt:
            self._prefill_shared()
        else:
            self._prefill_padded()
        self._count_kv()

    def _prefill_shared(self) -> None:
        """Each prompt encoded on its own, its K/V kept once (rollout.shared_prompt)."""
        keep = self.features is not None
        kvs, last = [], []
        for tree, prompt in enumerate(self.prompts):
            kv, hidden = encode_prompt(self.model, prompt, keep, prefill_logger(tree, len(self.prompts), len(prompt)))
            kvs.append(kv)
            last.append(hidden[:, -1])
            if keep:
                self.prompt_features.append(hidden)
        self.shared = SharedPrompts(kvs, list(range(len(self.prompts))))
        self.logits = float_logits(self.model, torch.cat(last))

    def _prefill_padded(self) -> None:
        """The prompts left-padded into one batch, encoded PREFILL_CHUNK columns a forward."""
        device = self.model.device
        width = max(map(len, self.prompts))
        ids = torch.zeros(len(self.prompts), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(self.prompts), width, dtype=torch.long, device=device)
        for i, p in enumerate(self.prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        progress = prefill_logger(0, 1, width)
        for start in range(0, width, PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, width)
            self.mask = mask[:, :end]
            self._forward(ids[:, start:end], positions[:, start:end])
            if progress is not None:
                progress(end)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        with attending(self.model.config, self.shared):
            hidden = decoder(self.model)(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                                         **attention_inputs(self.shared, self.mask),
                                         **with_cache(self.cache)).last_hidden_state
        self.logits = float_logits(self.model, hidden[:, -1])
        if self.features is not None:
            self.features.append(hidden)

    def _count_kv(self) -> None:
        """The K/V bytes the batch holds now, into the trace's peak."""
        held = sum(t.numel() * t.element_size() for layer in self.cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
        if self.shared is not None:
            held += self.shared.nbytes()
        self.trace.kv_bytes_peak = max(self.trace.kv_bytes_peak, held)

    def _joined_features(self) -> torch.Tensor:
        """The features of every cache column as one tensor (the chunks go as they are joined)."""
        chunks, self.features = self.features, None
        if not chunks:  # the prompts shared, no completion token encoded yet
            first = self.prompt_features[0]
            return first.new_empty(len(self.branches), 0, first.shape[-1])
        joined = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
        del chunks
        return joined

    def _select(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.logits.device)
        self.cache.reorder_cache(index)
        self.logits = self.logits[index]
        if self.mask is not None:
            self.mask = self.mask[index]
        if self.shared is not None:
            self.shared.select(rows)
        if self.features:
            self.features = [self._joined_features()[index]]
        self.branches = [self.branches[i] for i in rows]

    def fork(self, fan_out: int) -> None:
        """Give every live branch `fan_out` children sharing its cache rows and next-token logits."""
        branches = self.branches
        self._select([i for i in range(len(branches)) for _ in range(fan_out)])
        self.branches = [b.child(j) for b in branches for j in range(fan_out)]

    def sample(self) -> torch.Tensor:
        """One token per live row, drawn tree by tree with each tree's own generator and
        parameters, so a tree's draws do not depend on which other trees share the batch."""
        tokens = torch.empty(len(self.branches), dtype=torch.long, device=self.logits.device)
        logprobs = torch.empty(len(self.branches), device=self.logits.device)
        by_tree: dict[int, list[int]] = {}
        for row, b in enumerate(self.branches):
            by_tree.setdefault(b.tree, []).append(row)
        for tree, rows in by_tree.items():
            t, lp = sample_next(self.logits[rows], self.params[tree], self.generators[tree])
            tokens[rows], logprobs[rows] = t, lp
        return tokens, logprobs

    def step(self) -> None:
        """Sample one token for every live branch, retire the finished ones, encode the rest,
        or, once speculation may start and few are left, hand them over to it."""
        start = time.perf_counter()
        live = len(self.branches)
        tokens, logprobs = self.sample()
        token_list, logprob_list = host_lists(tokens, logprobs)  # the step's one wait for the device
        ended = [token in self.eos_ids for token in token_list]
        for branch, token, logprob in zip(self.branches, token_list, logprob_list):
            branch.tokens.append(token)
            branch.logprobs.append(logprob)
        if self.progress is not None:
            self.progress(live)
        at_cap = len(self.branches[0].tokens) == self.max_new_tokens
        keep = [i for i, done in enumerate(ended) if not done and not at_cap]
        self.leaves += [(b, done) for b, done in zip(self.branches, ended) if done or at_cap]
        handoff = bool(keep) and self._speculation_due(len(keep))
        if keep:
            tokens = tokens[keep]
            if len(keep) < live:
                self._select(keep)
            if not handoff:
                self._encode(tokens)
        else:
            self.branches = []
        self.trace.record("plain", 0, live, live, time.perf_counter() - start, len(self.leaves))
        if handoff:
            self._speculate(tokens)

    def _speculation_due(self, live: int) -> bool:
        """Whether `live` sequences go over to speculation: no fork pending, and few enough left."""
        return self.forks_done and self.speculation is not None and live <= self.speculation.threshold

    def _encode(self, tokens: torch.Tensor) -> None:
        if self.shared is None:
            positions = self.mask.sum(-1, keepdim=True)
            self.mask = torch.cat([self.mask, torch.ones_like(positions)], dim=-1)
        else:
            positions = (self.shared.lengths + self.cache.get_seq_length())[:, None]
        for b in self.branches:
            self.positions[b.tree] += 1
        self._forward(tokens[:, None], positions)
        self._count_kv()

    def _speculate(self, last: torch.Tensor) -> None:
        """Finish the live branches by speculative rounds; `last` holds their newest tokens,
        sampled but not encoded. The cache, mask and features go over as they are."""
        spec, branches = self.speculation, self.branches
        log.info("adaptive rollout engine: speculative decoding on at %d live sequences (threshold %d), "
                 "%d tokens into the completions", len(branches), spec.threshold, len(branches[0].tokens))
        eos_ids = self.eos_ids
        speculator = Speculator(self.model, spec.drafter, self.params[branches[0].tree], self._spec_generator(),
                                spec.draft_vocab, self.trace.spec)
        ids = self._encoded_ids()
        if self.shared is None:
            speculator.resume(self.cache, ids, self.mask.bool(), self._joined_features(), last)
        else:
            speculator.resume(self.cache, ids, torch.ones_like(ids, dtype=torch.bool), self._joined_features(), last,
                              HeldPrompts(self.shared, self.prompts, self.prompt_features))
        self.cache = self.shared = None  # the speculator owns them and the features now

        def on_round(rows: list[int], draft_len: int, tokens: int, seconds: float, ended: list[int]) -> None:
            for row in rows:
                self.positions[branches[row].tree] += draft_len + 1  # the verify block
            self.leaves += [(branches[row], branches[row].tokens[-1] in eos_ids) for row in ended]
            if self.progress is not None:
                self.progress(tokens)
            self.trace.record("spec", draft_len, len(rows), tokens, seconds, len(self.leaves))

        decode_rounds(speculator, [b.tokens for b in branches], self.max_new_tokens, eos_ids, spec.draft_len,
                      [b.logprobs for b in branches], on_round)
        self.branches = []

    def _spec_generator(self) -> torch.Generator:
        """The generator of the speculative phase: seeded by one draw from each live tree's
        generator (XOR of the draws), deterministic given the trees' generators.

        All live rows, of several trees, share this one generator, so a tree's draws in the
        spec phase depend on which trees share the batch and on the draft lengths chosen
        (each round's draws depend on k). With a bandit rewarded by measured time the
        rollouts are exact in distribution but not bitwise reproducible; with a fixed int
        draft_len and the same batch they are."""
        seed = 0
        for tree in sorted({b.tree for b in self.branches}):
            g = self.generators[tree]
            seed ^= int(torch.randint(2**62, (1,), generator=g, device=g.device))
        return torch.Generator(device=self.model.device).manual_seed(seed)

    def _encoded_ids(self) -> torch.LongTensor:
        """The token of every cache column: each row's encoded tokens after its prompt (unless
        the prompts are shared), right-aligned."""
        width = self.cache.get_seq_length()
        ids = torch.zeros(len(self.branches), width, dtype=torch.long, device=self.logits.device)
        for row, b in enumerate(self.branches):
            encoded = ([] if self.shared is not None else self.prompts[b.tree]) + b.tokens[:-1]
            if encoded:
                ids[row, width - len(encoded):] = torch.tensor(encoded)
        return ids

    def rollouts(self, branching: list[int]) -> list[TreeRollout]:
        """Per tree, leaves sorted by path: a tuple sorts before its extensions (depth-first).
        A leaf whose path is shorter than `branching` ended before the forks it missed."""
        out = []
        for i, prompt in enumerate(self.prompts):
            leaves = sorted((x for x in self.leaves if x[0].tree == i), key=lambda leaf: leaf[0].path)
            out.append(TreeRollout(
                prompt_ids=list(prompt), completions=[b.tokens for b, _ in leaves],
                logprobs=[b.logprobs for b, _ in leaves], finished=[done for _, done in leaves],
                forward_positions=self.positions[i], paths=[list(b.path) for b, _ in leaves],
                counts=[math.prod(branching[len(b.path):]) for b, _ in leaves]))
        return out


@torch.inference_mode()
def sample_trees(
    model,
    prompts: list[list[int]],
    branching: list[int],
    segment_tokens: list[int],
    max_new_tokens: int,
    params: SamplingParams | list[SamplingParams],
    eos_token_id: int | list[int],
    generators: list[torch.Generator],
    progress: Callable[[int], None] | None = None,
    speculation: Speculation | None = None,
    share_prompt: bool | None = None,
) -> tuple[list[TreeRollout], DecodeTrace]:
    """Sample the rollout trees of several prompts together, in one batch.

    Level i forks every live sequence into `branching[i]` children, which then generate
    `segment_tokens[i]` tokens before the next branch point (the last level runs to EOS or
    `max_new_tokens` completion tokens in all). Sequences leave the batch as they finish.
    `params` and `generators` are per prompt (one `params` serves all); `progress`, if
    given, is called with the number of tokens sampled at each decode step (plain or
    speculative). `speculation`: finish the tail speculatively (see `Speculation`); it
    needs one SamplingParams for all prompts. Sampling stays exact in distribution and
    greedy decoding gives the plain tokens; every token's logprob is the raw policy's.
    `share_prompt`: hold each prompt's K/V once (see the module docstring); None = wherever
    the model allows it (`shares_prompt`), False = every row its own copy."""
    for p in prompts:
        _validate(p, branching, segment_tokens, max_new_tokens)
    params = params if isinstance(params, list) else [params] * len(prompts)
    if speculation is not None and any(p != params[0] for p in params):
        raise ValueError("speculation needs the same SamplingParams for every prompt: the speculative "
                         "phase verifies rows of several trees in one batch under one sampling rule")
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    with evaluating(model, *([speculation.drafter] if speculation is not None else [])):
        if share_prompt is None:
            share_prompt = shares_prompt(model)
        elif share_prompt and not shares_prompt(model):
            raise ValueError(f"share_prompt=True, but {type(model).__name__} cannot attend to a shared prompt here "
                             "(rollout.shared_prompt.shares_prompt); leave share_prompt unset")
        batch = _Batch(model, prompts, params, eos, generators, progress, max_new_tokens, speculation, share_prompt)
        batch.prefill()
        ends = _level_ends(segment_tokens, max_new_tokens)
        for level, (fan_out, end) in enumerate(zip(branching, ends)):
            batch.fork(fan_out)
            batch.forks_done = level == len(branching) - 1
            while batch.branches and len(batch.branches[0].tokens) < end:
                batch.step()
            if not batch.branches:
                break
    return batch.rollouts(branching), batch.trace


def sample_tree(model, prompt_ids: list[int], branching: list[int], segment_tokens: list[int],
                max_new_tokens: int, params: SamplingParams, eos_token_id: int | list[int],
                generator: torch.Generator, progress: Callable[[int], None] | None = None,
                speculation: Speculation | None = None) -> TreeRollout:
    """One prompt's tree (see `sample_trees`)."""
    trees, _ = sample_trees(model, [prompt_ids], branching, segment_tokens, max_new_tokens, params,
                            eos_token_id, [generator], progress, speculation)
    return trees[0]


def _level_ends(segment_tokens: list[int], max_new_tokens: int) -> list[int]:
    """Completion length at which each level stops: its branch point, or the cap for the last."""
    ends, total = [], 0
    for tokens in segment_tokens:
        total += tokens
        ends.append(min(total, max_new_tokens))
    return ends + [max_new_tokens]


def _validate(prompt_ids, branching, segment_tokens, max_new_tokens) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if len(segment_tokens) != len(branching) - 1:
        raise ValueError(f"need {len(branching) - 1} segment lengths, got {len(segment_tokens)}")
    if min(branching, default=0) < 1 or min(segment_tokens, default=1) < 1 or max_new_tokens < 1:
        raise ValueError("branching, segment_tokens and max_new_tokens must be positive")
