"""Sample one prompt's rollouts as a tree, forking the KV cache at branch points.

The prompt is encoded once; at each branch point every live sequence is forked by
repeating its rows of the cache (and of its next-token logits) along the batch
dimension, so no shared prefix is ever re-encoded. All live sequences of a tree have
the same length at every step, so they decode together in one forward per token with
no padding and no attention mask. A sequence that emits EOS leaves the batch (its
cache rows are dropped) and becomes a leaf; it is never forked again.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from lsreplay.rollout.sampling import SamplingParams, sample_next

log = logging.getLogger(__name__)


@dataclass
class TreeRollout:
    """The leaves of one prompt's tree, in depth-first order (siblings adjacent)."""

    prompt_ids: list[int]
    completions: list[list[int]]  # one per leaf, prompt excluded, EOS included if emitted
    logprobs: list[list[float]]  # raw-policy logprob of each completion token (see sampling.py)
    finished: list[bool]  # True if the completion ended with EOS
    forward_positions: int  # token positions the model was run on (prefill + decode)


@dataclass
class _Branch:
    """One live or finished sequence; `path` holds its child index at each branch point."""

    path: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def child(self, index: int) -> "_Branch":
        return _Branch(self.path + (index,), list(self.tokens), list(self.logprobs))


class _Tree:
    """Live branches and the cache rows they own: row i of cache and logits is branches[i]."""

    def __init__(self, model, params, eos: torch.Tensor, generator, progress, max_new_tokens: int):
        self.model, self.params, self.eos, self.generator = model, params, eos, generator
        self.progress, self.max_new_tokens = progress, max_new_tokens
        self.cache = DynamicCache(config=model.config)
        self.branches = [_Branch(path=())]
        self.leaves: list[tuple[_Branch, bool]] = []
        self.positions = 0
        self.logits: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> None:
        """Run (B, T) new tokens through the model, extending the cache; keep last-position logits."""
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.positions += input_ids.numel()
        self.logits = out.logits[:, -1]

    def fork(self, fan_out: int) -> None:
        """Give every live branch `fan_out` children sharing its cache rows and next-token logits."""
        rows = torch.arange(len(self.branches), device=self.logits.device).repeat_interleave(fan_out)
        self.cache.reorder_cache(rows)
        self.logits = self.logits[rows]
        self.branches = [b.child(j) for b in self.branches for j in range(fan_out)]

    def step(self) -> None:
        """Sample one token for every live branch, retire the finished ones, encode the rest."""
        tokens, logprobs = sample_next(self.logits, self.params, self.generator)
        ended = torch.isin(tokens, self.eos).tolist()
        for branch, token, logprob in zip(self.branches, tokens.tolist(), logprobs.tolist()):
            branch.tokens.append(token)
            branch.logprobs.append(logprob)
        if self.progress is not None:
            self.progress(len(self.branches))
        at_cap = len(self.branches[0].tokens) == self.max_new_tokens
        keep = [i for i, done in enumerate(ended) if not done and not at_cap]
        self.leaves += [(b, done) for b, done in zip(self.branches, ended) if done or at_cap]
        if len(keep) < len(self.branches):
            self.branches = [self.branches[i] for i in keep]
            if not keep:
                return
            rows = torch.tensor(keep, device=tokens.device)
            self.cache.reorder_cache(rows)
            tokens = tokens[rows]
        self.forward(tokens[:, None])

    def rollout(self, prompt_ids: list[int]) -> TreeRollout:
        """Leaves sorted by path: a tuple sorts before its extensions, so this is depth-first order."""
        leaves = sorted(self.leaves, key=lambda leaf: leaf[0].path)
        return TreeRollout(
            prompt_ids=list(prompt_ids),
            completions=[b.tokens for b, _ in leaves],
            logprobs=[b.logprobs for b, _ in leaves],
            finished=[done for _, done in leaves],
            forward_positions=self.positions,
        )


@torch.inference_mode()
def sample_tree(
    model,
    prompt_ids: list[int],
    branching: list[int],
    segment_tokens: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_id: int | list[int],
    generator: torch.Generator,
    progress: Callable[[int], None] | None = None,
) -> TreeRollout:
    """Sample `prod(branching)` rollouts (fewer if some end early) of one prompt as a tree.

    Level i forks every live sequence into `branching[i]` children, which then generate
    `segment_tokens[i]` tokens before the next branch point (the last level runs to EOS or
    `max_new_tokens` completion tokens in all). `generator` (on the model's device) makes
    the tree reproducible; `progress`, if given, is called with the number of tokens
    sampled at each decode step (e.g. a tqdm bar's `update`).
    """
    _validate(prompt_ids, branching, segment_tokens, max_new_tokens)
    device = model.device
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id, device=device)
    tree = _Tree(model, params, eos, generator, progress, max_new_tokens)
    was_training = model.training
    model.eval()
    try:
        tree.forward(torch.tensor([prompt_ids], device=device))
        for fan_out, end in zip(branching, _level_ends(segment_tokens, max_new_tokens)):
            tree.fork(fan_out)
            while tree.branches and len(tree.branches[0].tokens) < end:
                tree.step()
            if not tree.branches:
                break
    finally:
        model.train(was_training)
    log.debug("tree of %d leaves, %d forward positions", len(tree.leaves), tree.positions)
    return tree.rollout(prompt_ids)


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
