"""PPO's critic: a value head on the policy's own trunk, GAE, the clipped value loss.

The critic is one linear layer, `value_head` (hidden -> 1), on the last hidden state the
policy's LM head reads: V(s_t) for the state before completion token t is the head at the
position that predicts token t, which is exactly a tree entry's position. So the value is
one more per-position head (lsreplay.replay.heads): the caching pass that records the
policy's K/V and old logprobs records the old values too, and one replay backward carries
the policy loss and the value loss together (their weights per head).

Why not a copy of the policy with a head, as verl and OpenRLHF ship: that copy is a second
model's weights, gradients, float32 masters and AdamW moments (about as much memory again
as the policy's training state), plus, for replay, its own caching pass and prefix K/V per
branching node stored and read back, and its own backward. On the shared trunk the critic
costs hidden + 1 parameters. The price: the value loss's gradient reaches the trunk the
policy uses, weighed by `algo.vf_coef`; the head starts at zero, so at first it adds none.

Values are float (the policy's compute dtype promoted to at least float32). A tree's
shared token has one value, whatever completion it belongs to; its advantages and returns
are per completion (they depend on the completion's future), as the loss functions take
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from lsreplay.algos.grpo import NestedCounts, NestedMask, aggregate, flat_counts, kept
from lsreplay.algos.weights import NestedLogprobs
from lsreplay.models.distribution import SamplingParams
from lsreplay.replay.heads import LOGPROB, Heads, LogprobHead
from lsreplay.replay.segments import device_index

VALUE_HEAD = "value_head"  # the module's name on the policy; its tensors are "value_head.*"
VALUE = "value"


def attach_value_head(model: PreTrainedModel) -> PreTrainedModel:
    """Give `model` a zero value head (hidden -> 1) in its dtype and on its device, once:
    trainable where anything of the model is (its LoRA adapters: then the value loss reaches
    the trunk through them)."""
    if not hasattr(model, VALUE_HEAD):
        param = next(model.parameters())
        head = torch.nn.Linear(model.config.hidden_size, 1, dtype=param.dtype, device=param.device)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        head.requires_grad_(any(p.requires_grad for p in model.parameters()))
        model.add_module(VALUE_HEAD, head)
    return model


def value_scores(model: PreTrainedModel, hidden: torch.Tensor, positions, targets) -> torch.Tensor:
    """The head `value`: V at `positions` of one row of hidden states (T, d); targets unused."""
    head = getattr(model, VALUE_HEAD)
    values = head(hidden[device_index(positions, hidden.device)]).squeeze(-1)
    return values.to(torch.promote_types(values.dtype, torch.float32))


def critic_heads(sampling: SamplingParams) -> Heads:
    """What PPO with a critic scores at every entry: the token's logprob (under the
    distribution `sampling` draws from) and the state's value."""
    return {LOGPROB: LogprobHead(sampling), VALUE: value_scores}


def is_critic(name: str) -> bool:
    """Whether a parameter name is the value head's (not part of the HF model)."""
    return name.startswith(VALUE_HEAD + ".")


def split_critic(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the HF model's tensors, the value head's)."""
    return ({n: t for n, t in tensors.items() if not is_critic(n)}, {n: t for n, t in tensors.items() if is_critic(n)})


def gae(values: torch.Tensor, reward: float, gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over one completion: (advantages, returns) per token. The reward comes at the last
    token, and the state after it is terminal (value 0): an answer cut at max_new_tokens
    ends too, its reward (and a length penalty) all it gets.
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, R_t = A_t + V_t."""
    values = values.double()
    n = values.numel()
    advantages = torch.zeros(n, dtype=torch.float64)
    running = 0.0
    for t in reversed(range(n)):
        following = float(values[t + 1]) if t + 1 < n else 0.0
        delta = (reward if t == n - 1 else 0.0) + gamma * following - float(values[t])
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + values


def whiten(advantages: list[list[torch.Tensor]], counts: NestedCounts = None, mask: NestedMask = None,
           eps: float = 1e-8) -> list[list[torch.Tensor]]:
    """Per-token advantages over the batch to mean 0, variance 1, as verl's masked_whiten:
    (A - mean) / sqrt(unbiased var + eps) over the tokens of the completions `mask` keeps,
    each counted as many times as the samples it stands for."""
    flat_n = flat_counts(counts, advantages) or [1] * sum(map(len, advantages))
    keep = [True] * len(flat_n) if mask is None else [m for row in mask for m in row]
    tokens = [(a, n) for a, n, k in zip((a for row in advantages for a in row), flat_n, keep) if k and a.numel()]
    if not tokens:
        return advantages
    values = torch.cat([a for a, _ in tokens])
    w = torch.cat([torch.full_like(a, float(n)) for a, n in tokens])
    size = w.sum()
    mean = (w * values).sum() / size
    var = (w * (values - mean) ** 2).sum() / size
    if size > 1:
        var = var * size / (size - 1)  # Bessel's correction over the samples' tokens
    return [[(a - mean) * torch.rsqrt(var + eps) for a in row] for row in advantages]


@dataclass
class CriticBatch:
    old_values: NestedLogprobs  # per tree, per completion: the caching pass's values per token
    returns: NestedLogprobs  # per tree, per completion: the value targets per token
    clip: float = 0.2  # the value's clip range around the old value (0 = no clip)
    loss_agg: str = "token-mean"
    max_tokens: int | None = None
    counts: NestedCounts = None
    mask: NestedMask = None  # per tree, per completion: in the value loss (None: all), as in the policy loss


def clipped_value_loss(values: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """Per token 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), as PPO clips it."""
    old, returns = old.to(values), returns.to(values)
    plain = (values - returns) ** 2
    if not clip:
        return 0.5 * plain
    clipped = old + (values - old).clamp(-clip, clip)
    return 0.5 * torch.maximum(plain, (clipped - returns) ** 2)


def value_loss(values: NestedLogprobs, batch: CriticBatch) -> torch.Tensor:
    """The clipped value loss of every completion token `mask` keeps, aggregated as the policy loss is."""
    losses = [clipped_value_loss(v, o, r, batch.clip)
              for vs, os, rs in zip(values, batch.old_values, batch.returns) for v, o, r in zip(vs, os, rs)]
    losses, counts = kept(losses, flat_counts(batch.counts, values), batch.mask)
    return aggregate(losses, batch.loss_agg, batch.max_tokens, counts)


def _flat(nested: NestedLogprobs) -> torch.Tensor:
    return torch.cat([x.double() for row in nested for x in row] or [torch.zeros(0, dtype=torch.float64)])


def explained_variance(values: NestedLogprobs, returns: NestedLogprobs) -> float:
    """1 - Var(R - V) / Var(R) over the tokens: 1 is perfect, 0 no better than their mean."""
    v, r = _flat(values), _flat(returns)
    var = r.var(unbiased=False) if r.numel() else torch.zeros(())
    return float(1 - (r - v).var(unbiased=False) / var) if var > 0 else 0.0


def value_clip_fraction(values: NestedLogprobs, batch: CriticBatch) -> float:
    """The share of tokens whose value moved further from the old one than the clip."""
    moved = (_flat(values) - _flat(batch.old_values)).abs()
    return float((moved > batch.clip).double().mean()) if batch.clip and moved.numel() else 0.0
