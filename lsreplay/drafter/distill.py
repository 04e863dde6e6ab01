"""Distil a drafter on the target's own features: EAGLE's feature regression plus soft token loss.

Training data are root-to-leaf paths of rollouts: tokens x_0..x_{T-1} with the target's
features h_0..h_{T-1} (h_t = base-model output at position t, the LM head's input). Pair
t feeds (x_{t+1}, h_t) at position t and asks for h_{t+1}.
"""

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lsreplay.core.config import OptimConfig
from lsreplay.drafter.model import Drafter
from lsreplay.models.train_state import TrainState

log = logging.getLogger(__name__)

Sequence = tuple[torch.LongTensor, torch.Tensor]

# distill() reports averages over this many final steps: one batch is too noisy to judge.
STATS_WINDOW = 20


@dataclass
class DistillStats:
    """Position-weighted averages; top1_accept = share of positions where the draft argmax equals the target's."""

    steps: int
    loss: float
    feature_loss: float
    token_loss: float
    top1_accept: float


def distillation_loss(
    drafter: Drafter,
    input_ids: torch.LongTensor,
    hidden_states: torch.Tensor,
    position_ids: torch.LongTensor,
    target_hidden_next: torch.Tensor,
    mask: torch.BoolTensor,
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SmoothL1 on features plus soft cross-entropy against the target's next-token distribution.

    Both are means over the positions where `mask` is true. The token loss compares the
    two distributions at the rollouts' `temperature`, the ones speculative sampling draws
    from and accepts by (rollout.speculative: q against p, both tempered); the cut of top-k
    and top-p is left out (a cross-entropy over -inf entries), and the acceptance bound
    depends on the tempered distributions either way. `parts` holds the detached
    feature_loss, token_loss, top1_accept and the number of positions.
    """
    predicted = drafter(input_ids, hidden_states, position_ids)[mask]
    target = target_hidden_next[mask].to(predicted.dtype)
    # Softmax and losses in float32 whatever the model dtype: bf16 log-softmax over a large vocabulary is coarse.
    feature_loss = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1).mean()
    draft_logp = F.log_softmax(_tempered(drafter.logits(predicted).float(), temperature), dim=-1)
    with torch.no_grad():
        target_logits = drafter.logits(target).float()
    token_loss = -(F.softmax(_tempered(target_logits, temperature), dim=-1) * draft_logp).sum(-1).mean()
    loss = feature_weight * feature_loss + token_weight * token_loss
    accept = (draft_logp.argmax(-1) == target_logits.argmax(-1)).float().mean()
    parts = {
        "feature_loss": feature_loss.detach(),
        "token_loss": token_loss.detach(),
        "top1_accept": accept,
        "positions": mask.sum(),
    }
    return loss, parts


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature`; at 1 the logits themselves (the same numbers): a division over
    positions x vocabulary was a fifth of a distillation step on the tests' 49k-token vocabulary."""
    return logits if temperature == 1.0 else logits / temperature


def sequences_to_batch(sequences: list[Sequence], max_len: int) -> dict[str, torch.Tensor]:
    """Right-padded training pairs for `distillation_loss(drafter, **batch)`.

    Row i holds the last n_i = min(T_i - 1, max_len) pairs of sequence i, t = T_i - 1 - n_i ..
    T_i - 2: input_ids x_{t+1}, hidden_states h_t, target_hidden_next h_{t+1}, position_ids t
    (the real positions). The end, not the start: a rollout's path is its prompt then its
    completion, and with a prompt longer than max_len the first pairs would be prompt only.
    """
    counts = [min(len(tokens) - 1, max_len) for tokens, _ in sequences]
    width, hidden0 = max(counts), sequences[0][1]
    shape = (len(sequences), width)
    device = hidden0.device
    input_ids = torch.zeros(shape, dtype=torch.long, device=device)
    hidden = hidden0.new_zeros(*shape, hidden0.shape[-1])
    target = torch.zeros_like(hidden)
    mask = torch.zeros(shape, dtype=torch.bool, device=device)
    position_ids = torch.zeros(shape, dtype=torch.long, device=device)
    for row, ((tokens, features), n) in enumerate(zip(sequences, counts)):
        first = len(tokens) - 1 - n
        input_ids[row, :n] = tokens[first + 1 : first + n + 1]
        hidden[row, :n] = features[first : first + n]
        target[row, :n] = features[first + 1 : first + n + 1]
        mask[row, :n] = True
        # Padding gets positions too (continuing the count); causal attention keeps it out of valid rows.
        position_ids[row] = torch.arange(first, first + width, device=device)
    return {
        "input_ids": input_ids,
        "hidden_states": hidden,
        "position_ids": position_ids,
        "target_hidden_next": target,
        "mask": mask,
    }


def _usable(sequences: list[Sequence]) -> list[Sequence]:
    """Sequences with at least one training pair; a one-token path teaches nothing."""
    usable = [s for s in sequences if len(s[0]) >= 2]
    if not usable:
        raise ValueError("no sequence has two or more tokens to distil on")
    return usable


def _to_drafter(batch: dict[str, torch.Tensor], drafter: Drafter) -> dict[str, torch.Tensor]:
    """Move a batch to the drafter's device; features take its dtype."""
    weight = drafter.fc.weight
    return {
        key: value.to(weight.device, weight.dtype if value.is_floating_point() else value.dtype)
        for key, value in batch.items()
    }


def _row(loss: torch.Tensor, parts: dict[str, torch.Tensor]) -> tuple[float, ...]:
    """(positions, loss, feature_loss, token_loss, top1_accept) as Python numbers."""
    keys = ("feature_loss", "token_loss", "top1_accept")
    return (parts["positions"].item(), loss.item(), *(parts[k].item() for k in keys))


def _summarise(rows: list[tuple[float, ...]], steps: int) -> DistillStats:
    """Position-weighted means of per-batch rows from `_row`."""
    total = sum(r[0] for r in rows)
    means = [sum(r[0] * r[i] for r in rows) / total for i in range(1, 5)]
    return DistillStats(steps, *means)


# EAGLE's clip: early feature-regression steps can spike on outlier features.
MAX_GRAD_NORM = 0.5


def drafter_train_state(drafter: Drafter, lr: float, max_grad_norm: float = MAX_GRAD_NORM) -> TrainState:
    """The drafter's trainable state, as the policy's (lsreplay.models.train_state): AdamW (torch's
    defaults: betas 0.9/0.999, weight decay 0.01) on float32 masters of a bf16 drafter's
    weights, gradients accumulated in float32, the compute weights refreshed after each
    step; a float32 drafter is its own master. In pure bf16 an update below half an ulp
    vanishes: at lr 1e-3 the fc's identity diagonal (1.0, ulp 7.8e-3) never moved."""
    return TrainState(drafter, OptimConfig(lr=lr, weight_decay=0.01, beta1=0.9, beta2=0.999, grad_clip=max_grad_norm))


def distill(
    drafter: Drafter,
    sequences: list[Sequence],
    steps: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    train: TrainState | None = None,
    progress: bool = True,
    max_len: int = 2048,
    max_grad_norm: float = MAX_GRAD_NORM,
    stop: Callable[[], bool] | None = None,
    temperature: float = 1.0,
) -> DistillStats:
    """Train the drafter for `steps` AdamW steps on batches drawn with `generator`, its
    token loss at the rollouts' `temperature` (distillation_loss).

    `lr` and `max_grad_norm` build its trainable state (`drafter_train_state`) when none is
    given; pass one back in to keep its masters and moments across spot-training sessions.
    `stop`, asked before each step, ends training early (the stats' `steps` says how many
    ran). Averages cover the last STATS_WINDOW steps.
    """
    usable = _usable(sequences)
    if train is None:
        train = drafter_train_state(drafter, lr, max_grad_norm)
    was_training = drafter.training
    drafter.train()
    window = deque(maxlen=STATS_WINDOW)
    bar = tqdm(range(steps), desc="drafter distill", disable=not progress)
    done = 0
    for done in bar:
        if stop is not None and stop():
            break
        picks = torch.randint(len(usable), (batch_size,), generator=generator, device=generator.device)
        batch = sequences_to_batch([usable[i] for i in picks.tolist()], max_len)
        loss, parts = distillation_loss(drafter, **_to_drafter(batch, drafter), temperature=temperature)
        train.zero_grad()
        loss.backward()
        train.clip_grad_norm()
        train.step()
        window.append(_row(loss, parts))
        bar.set_postfix(loss=f"{window[-1][1]:.4f}", top1=f"{window[-1][4]:.3f}", refresh=False)
    else:
        done = steps
    bar.close()
    drafter.train(was_training)
    stats = _summarise(list(window), done) if window else DistillStats(0, *(4 * [float("nan")]))
    log.debug("drafter distill: %s", stats)  # the caller reports them (a stage: in its manifest and progress bar)
    return stats


@torch.no_grad()
def evaluate(
    drafter: Drafter, sequences: list[Sequence], batch_size: int = 8, max_len: int = 2048, temperature: float = 1.0
) -> DistillStats:
    """The same metrics as `distill`, over every pair of `sequences`, without training (steps=0)."""
    usable = _usable(sequences)
    was_training = drafter.training
    drafter.eval()
    rows = []
    for start in range(0, len(usable), batch_size):
        batch = sequences_to_batch(usable[start : start + batch_size], max_len)
        rows.append(_row(*distillation_loss(drafter, **_to_drafter(batch, drafter), temperature=temperature)))
    drafter.train(was_training)
    return _summarise(rows, 0)
