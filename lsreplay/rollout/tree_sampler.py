"""Sample one prompt's rollouts as a tree, forking the KV cache at branch points.

Each prompt is encoded once; at each branch point every live sequence is forked by
repeating its rows of the cache (and of its next-token logits) along the batch
dimension, so no shared prefix is ever re-encoded. Many trees decode together: prompts
are left-padded, and all live sequences have generated the same number of tokens at
every step, so one forward per token serves them all. A sequence that emits EOS leaves
the batch (its cache rows are dropped) and becomes a leaf; it is never forked again.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from lsreplay.rollout.sampling import SamplingParams, sample_next

@dataclass
class TreeRollout:
    """The leaves of one prompt's tree, in depth-first order (siblings adjacent)."""

    prompt_ids: list[int]
    completions: list[list[int]]  # one per leaf, prompt excluded, EOS included if emitted
    logprobs: list[list[float]]  # raw-policy logprob of each completion token (see sampling.py)
    finished: list[bool]  # True if the completion ended with EOS
    forward_positions: int  # token positions the model was run on (prefill + decode)


@dataclass
class DecodeTrace:
    """What the long tail costs: per decode step, live sequences and seconds."""

    live: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # leaves finished after each step

    def summary(self, lengths: list[int]) -> dict:
        """Length distribution and the share of decode time spent after 90% had finished."""
        if not lengths:
            return {}
        ordered = sorted(lengths)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        total = sum(self.seconds) or 1e-9
        tail = sum(s for s, f in zip(self.seconds, self.finished) if f >= 0.9 * len(lengths))
        return {"length_p50": pick(0.5), "length_p90": pick(0.9), "length_max": ordered[-1],
                "decode_seconds": total, "tail_time_share": tail / total, "decode_steps": len(self.seconds)}


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

    Prompts are left-padded; `mask` marks each row's real positions, so a row's next
    position is its count of real tokens."""

    def __init__(self, model, params: list[SamplingParams], eos, generators, progress, max_new_tokens: int):
        self.model, self.params, self.eos, self.generators = model, params, eos, generators
        self.progress, self.max_new_tokens = progress, max_new_tokens
        self.cache = DynamicCache(config=model.config)
        self.branches = [_Branch(tree=i, path=()) for i in range(len(params))]
        self.leaves: list[tuple[_Branch, bool]] = []
        self.positions = [0] * len(params)
        self.trace = DecodeTrace()

    def prefill(self, prompts: list[list[int]]) -> None:
        device = self.model.device
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        self.mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            self.mask[i, width - len(p):] = 1
            self.positions[i] += len(p)
        self._forward(ids, (self.mask.cumsum(-1) - 1).clamp(min=0))

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        out = self.model(input_ids=input_ids, attention_mask=self.mask, position_ids=position_ids,
                         cache=self.cache, use_cache=True, logits_to_keep=1)
        self.logits = out.logits[:, -1]

    def _select(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.logits.device)
        self.cache.reorder_cache(index)
        self.logits, self.mask = self.logits[index], self.mask[index]
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
        """Sample one token for every live branch, retire the finished ones, encode the rest."""
        start = time.perf_counter()
        live = len(self.branches)
        tokens, logprobs = self.sample()
        ended = torch.isin(tokens, self.eos).tolist()
        for branch, token, logprob in zip(self.branches, tokens.tolist(), logprobs.tolist()):
            branch.tokens.append(token)
            branch.logprobs.append(logprob)
        if self.progress is not None:
            self.progress(live)
        at_cap = len(self.branches[0].tokens) == self.max_new_tokens
        keep = [i for i, done in enumerate(ended) if not done and not at_cap]
        self.leaves += [(b, done) for b, done in zip(self.branches, ended) if done or at_cap]
        if keep:
            tokens = tokens[keep]
            if len(keep) < live:
                self._select(keep)
            positions = self.mask.sum(-1, keepdim=True)
            self.mask = torch.cat([self.mask, torch.ones_like(positions)], dim=-1)
            for b in self.branches:
                self.positions[b.tree] += 1
            self._forward(tokens[:, None], positions)
        else:
            self.branches = []
        self.trace.live.append(live)
        self.trace.seconds.append(time.perf_counter() - start)
        self.trace.finished.append(len(self.leaves))

    def rollouts(self, prompts: list[list[int]]) -> list[TreeRollout]:
        """Per tree, leaves sorted by path: a tuple sorts before its extensions (depth-first)."""
        out = []
        for i, prompt in enumerate(prompts):
            leaves = sorted((x for x in self.leaves if x[0].tree == i), key=lambda leaf: leaf[0].path)
            out.append(TreeRollout(
                prompt_ids=list(prompt), completions=[b.tokens for b, _ in leaves],
                logprobs=[b.logprobs for b, _ in leaves], finished=[done for _, done in leaves],
                forward_positions=self.positions[i]))
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
) -> tuple[list[TreeRollout], DecodeTrace]:
    """Sample the rollout trees of several prompts together, in one batch.

    Level i forks every live sequence into `branching[i]` children, which then generate
    `segment_tokens[i]` tokens before the next branch point (the last level runs to EOS or
    `max_new_tokens` completion tokens in all). Sequences leave the batch as they finish.
    `params` and `generators` are per prompt (one `params` serves all); `progress`, if
    given, is called with the number of tokens sampled at each decode step."""
    for p in prompts:
        _validate(p, branching, segment_tokens, max_new_tokens)
    params = params if isinstance(params, list) else [params] * len(prompts)
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id, device=model.device)
    batch = _Batch(model, params, eos, generators, progress, max_new_tokens)
    was_training = model.training
    model.eval()
    try:
        batch.prefill(prompts)
        for fan_out, end in zip(branching, _level_ends(segment_tokens, max_new_tokens)):
            batch.fork(fan_out)
            while batch.branches and len(batch.branches[0].tokens) < end:
                batch.step()
            if not batch.branches:
                break
    finally:
        model.train(was_training)
    return batch.rollouts(prompts), batch.trace


def sample_tree(model, prompt_ids: list[int], branching: list[int], segment_tokens: list[int],
                max_new_tokens: int, params: SamplingParams, eos_token_id: int | list[int],
                generator: torch.Generator, progress: Callable[[int], None] | None = None) -> TreeRollout:
    """One prompt's tree (see `sample_trees`)."""
    trees, _ = sample_trees(model, [prompt_ids], branching, segment_tokens, max_new_tokens, params,
                            eos_token_id, [generator], progress)
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
