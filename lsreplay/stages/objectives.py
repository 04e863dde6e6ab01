"""What the policy update minimises, per algorithm (`algo.name`), over a step's trees.

Every objective is a loss over the caching pass's per-token scores (logprobs, and a
critic's values, by head: lsreplay.replay.heads) of the trees of a minibatch, which
`loss_and_weights` turns into the weights replay differentiates:

- grpo: group advantages (over each tree's leaves), the clipped surrogate at ratio 1 (one
  update per batch starts from the weights that scored it, so the old logprobs need no
  values unless a KL term, importance weights or the overlong mask read them), KL.
  Asynchronous rollouts (rollout.max_staleness > 0; docs/async.md) were sampled by an
  older policy: the ratio is then against the behaviour policy's logprobs (those the
  rollouts recorded), or with algo.decoupled against the caching pass's (the proximal
  policy), each token weighted by its capped behaviour ratio (AReaL's decoupled PPO).
- ppo: the same surrogate over `algo.epochs` x `algo.minibatches` updates against the
  caching pass's old logprobs, with group advantages or GAE from the critic's old values,
  and the critic's clipped value loss.
- dpo: each tree's best leaf against its worst (trees whose leaves all scored alike give
  no pair; an answer algo.overlong=mask leaves out takes no part), against the frozen
  reference's sequence logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lsreplay.algos.critic import (VALUE, CriticBatch, explained_variance, gae, value_clip_fraction, value_loss,
                                   whiten)
from lsreplay.algos.dpo import best_worst_pairs, dpo_loss, sequence_logprobs
from lsreplay.algos.grpo import batch_reward_std, clip_fractions, tree_advantages
from lsreplay.algos.kl import kl_loss
from lsreplay.algos.model_tokens import model_token_scores, model_tokens, on_model_tokens, sampled_flags, sampled_masks
from lsreplay.algos.ppo import PPOBatch, minibatch_orders, ppo_loss
from lsreplay.algos.weights import NestedLogprobs
from lsreplay.core.config import model_token_budget
from lsreplay.core.run import Run
from lsreplay.replay.capture import TreeActivations
from lsreplay.replay.heads import LOGPROB, Heads
from lsreplay.stages.common import (dpo_rewards, leaf_counts, leaf_subtrees, left_out, policy_heads, trains_nothing,
                                    training_rewards)
from lsreplay.stages.prefixes import load_activations
from lsreplay.stages.versions import off_policy_figures, staleness_figures


@dataclass
class Objective:
    loss_for: Callable[[list[int]], Callable]  # the loss over the scores of the trees of a minibatch
    orders: list[list[list[int]]]  # per epoch, the minibatches' tree indices
    old: dict | NestedLogprobs  # the caching pass's scores of every tree (the first minibatch's too)
    heads: Heads  # what the loss scores (heads.by_head: nested logprobs, or scores by head)
    extras: dict = field(default_factory=dict)  # figures of the batch before the update
    # Figures of one minibatch at the scores its loss saw (averaged over the update).
    figures: Callable[[list[int], dict | NestedLogprobs], dict] = lambda idx, scores: {}


def updates_per_step(cfg) -> int:
    """Optimizer updates a step makes: 1, or algo.epochs x the minibatches of PPO."""
    n = cfg.data.prompts_per_step
    return cfg.algo.epochs * len(range(0, n, math.ceil(n / cfg.algo.minibatches)))


def needs_activations(cfg) -> bool:
    """Whether the update reads the caching pass's scores (else ratio 1 needs no values)."""
    a = cfg.algo
    return a.name != "grpo" or a.kl_coef > 0 or a.tis_cap > 0 or a.decoupled or cfg.rollout.max_staleness > 0


def objective(run: Run, step: int, records: list[dict], trees, prefixes: dict) -> Objective:
    cfg = run.cfg
    acts = ([load_activations(run, step, i, prefixes) for i in range(len(trees))] if needs_activations(cfg)
            else [TreeActivations()] * len(trees))  # the drafter's hidden states are not read here
    goal = _dpo(cfg, records, trees, acts) if cfg.algo.name == "dpo" else _clipped(run, step, records, trees, acts)
    goal.extras.update(staleness_figures(cfg, records))
    return goal


def completion_values(tree, entries: torch.Tensor | None) -> list[torch.Tensor]:
    """Per completion, the caching pass's per-token scores of a tree; zeros for a tree it
    did not score (one that trains nothing: common.trains_nothing; no weight reads them)."""
    return tree.completion_values(torch.zeros(tree.num_entries, dtype=torch.float64) if entries is None else entries)


def pick(nested: list | None, idx: list[int]) -> list | None:
    """The entries `idx` of a per-tree list (None stays None)."""
    return None if nested is None else [nested[i] for i in idx]


def kept_only(mask, *nested: list[list[torch.Tensor]]) -> list[list[list[torch.Tensor]]]:
    """Each nested list (per tree, per completion) with only the completions `mask` keeps."""
    if mask is None:
        return list(nested)
    return [[[x for x, m in zip(row, keep) if m] for row, keep in zip(values, mask)] for values in nested]


def response_mask(cfg, records: list[dict]) -> list[list[bool]] | None:
    """Per tree, per completion: whether its tokens are in the loss, one mask for every term
    (policy, KL, value loss) and for GAE's whitening. Out: an answer cut at max_new_tokens
    under algo.overlong=mask, and every leaf of a tree dynamic sampling leaves out
    (common.left_out). None when every completion is in."""
    out = left_out(cfg, records)
    cut = cfg.algo.overlong == "mask"
    if not cut and not any(out):
        return None
    return [[not gone and (finished or not cut) for finished in r["finished"]] for r, gone in zip(records, out)]


def _clipped(run: Run, step: int, records: list[dict], trees, acts: list[TreeActivations]) -> Objective:
    """GRPO and PPO: the clipped surrogate, with the critic's value loss where there is one."""
    cfg, algo = run.cfg, run.cfg.algo
    # Every term below is over the model's tokens; an episode's environment tokens are out.
    sampled = sampled_masks([sampled_flags(r) for r in records])
    full_old = [completion_values(t, a.entry_logprobs) for t, a in zip(trees, acts)]
    old = model_tokens(full_old, sampled)
    counts = [leaf_counts(r) for r in records]  # every leaf counts as the samples it stands for
    rewards = [training_rewards(cfg, r) for r in records]
    # Dr. GRPO's constant normaliser: the rollout's budget of model tokens (an episode's: every turn's replies).
    mask, max_tokens = response_mask(cfg, records), model_token_budget(cfg.rollout)
    critic, extras = None, {"trees_left_out": sum(left_out(cfg, records))}
    if algo.critic:
        if any(r is None for rs in rewards for r in rs):
            raise ValueError("a completion no reward function applies to (every one returned None) has no return for "
                             "the critic to learn: algo.critic needs a reward for every completion")
        full_values = [completion_values(t, a.entry_scores.get(VALUE)) for t, a in zip(trees, acts)]
        values = model_tokens(full_values, sampled)
        returns = [[gae(v, r, algo.gamma, algo.lam)[1] for v, r in zip(vs, rs)] for vs, rs in zip(values, rewards)]
        critic = CriticBatch(old_values=values, returns=returns, clip=algo.value_clip, loss_agg=algo.loss_agg,
                             max_tokens=max_tokens, counts=counts, mask=mask)
        extras["value_explained_variance"] = explained_variance(*kept_only(mask, values, returns))
    if algo.advantage == "gae":
        advantages = whiten([[gae(v, r, algo.gamma, algo.lam)[0] for v, r in zip(vs, rs)]
                             for vs, rs in zip(critic.old_values, rewards)], counts, mask)
    else:  # TRL's scale_rewards; an unscorable leaf (reward None) is left out and gets advantage 0
        batch_std = batch_reward_std(rewards, counts) if algo.scale_rewards == "batch" else None
        advantages = [list(tree_advantages(r, algo.scale_rewards, n, leaf_subtrees(rec) if algo.tree_baseline ==
                                           "independent" else None, batch_std))
                      for r, n, rec in zip(rewards, counts, records)]
    loss_old, advantages = _off_policy(cfg, records, acts, old, advantages, mask, extras)
    ref = model_tokens([completion_values(t, a.ref_entry_logprobs) for t, a in zip(trees, acts)], sampled) \
        if algo.kl_coef > 0 else None
    batch = PPOBatch(advantages=advantages, old_logprobs=loss_old, clip_eps=algo.clip_eps, loss_agg=algo.loss_agg,
                     max_tokens=max_tokens, counts=counts, clip_eps_high=algo.clip_eps_high or None, mask=mask,
                     ref_logprobs=ref, kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
                     critic=critic, vf_coef=algo.vf_coef)
    if ref is not None:
        extras["kl"] = float(kl_loss(old, ref, algo.kl_estimator, algo.loss_agg, max_tokens, counts, batch.mask))
    n = len(trees)
    shuffle = run.generator(step, "minibatches") if algo.minibatches > 1 else None
    orders = minibatch_orders(n, algo.epochs, math.ceil(n / algo.minibatches), shuffle)

    def loss_for(idx: list[int]):
        minibatch = batch.select(idx)
        return on_model_tokens(lambda scores: ppo_loss(scores, minibatch), pick(sampled, idx))

    def figures(idx: list[int], scores) -> dict:
        sub, scores = batch.select(idx), model_token_scores(scores, pick(sampled, idx))
        logprobs = scores[LOGPROB] if critic is not None else scores
        out = clip_fractions(logprobs, sub.old_logprobs, sub.advantages, sub.clip_eps, sub.clip_eps_high, sub.mask)
        if critic is not None:
            out["value_loss"] = float(value_loss(scores[VALUE], sub.critic))
            out["value_clip_fraction"] = value_clip_fraction(scores[VALUE], sub.critic)
        return out

    old_scores = {LOGPROB: full_old, VALUE: full_values} if critic is not None else full_old
    return Objective(loss_for, orders, old_scores, policy_heads(cfg), extras, figures)


def _off_policy(cfg, records: list[dict], acts: list[TreeActivations], old, advantages, mask, extras: dict):
    """The clipped surrogate's old logprobs and advantages where the sampler's probabilities
    are not the caching pass's: truncated importance sampling (algo.tis_cap) and AReaL's
    decoupled loss (algo.decoupled) keep the caching pass's (the proximal policy) and weight
    each token's advantage by min(p_proximal / p_behaviour, cap); with asynchronous rollouts
    otherwise the ratio is to the behaviour policy itself (its logprobs as the rollouts
    recorded them). Their figures go to `extras`, per staleness with asynchronous rollouts."""
    algo, off_policy = cfg.algo, cfg.rollout.max_staleness > 0
    if not (algo.tis_cap or algo.decoupled or off_policy):
        return old, advantages
    behaviour = [[torch.tensor([lp for lp, f in zip(lps, flags) if f], dtype=torch.float64)
                  for lps, flags in zip(r["logprobs"], sampled_flags(r))] for r in records]
    cap = algo.tis_cap or algo.behaviour_cap or math.inf
    if off_policy:
        scored = [a.entry_logprobs is not None for a in acts]
        extras.update(off_policy_figures(records, old, behaviour, cap, scored, mask))
    if not (algo.tis_cap or algo.decoupled):
        return behaviour, advantages
    weights = [importance_weights(o, e, cap) for o, e in zip(old, behaviour)]
    extras.update(tis_figures(weights, cap, trained_only(cfg, records, mask)))
    return old, [[a * w for a, w in zip(advs, ws)] for advs, ws in zip(advantages, weights)]


def importance_weights(trainer: list[torch.Tensor], engine: list, cap: float) -> list[torch.Tensor]:
    """Truncated importance sampling (algo.tis_cap): per completion, each token's
    min(p_trainer / p_engine, cap), the weight on its advantage, correcting for the rollout
    engine sampling from slightly other probabilities than the trainer computes (vLLM's
    kernels, bf16), or from an older policy (algo.decoupled). Both logprobs are of the
    distribution sampled from (tempered, truncated)."""
    return [torch.exp(t - torch.as_tensor(e, dtype=torch.float64)).clamp(max=cap) for t, e in zip(trainer, engine)]


def trained_only(cfg, records: list[dict], mask) -> list[list[bool]]:
    """The response mask less every completion of a tree that trains nothing
    (common.trains_nothing): the caching pass scored none of them, so a figure of the
    trainer's logprobs (the importance weights') has nothing of theirs to read."""
    keep = mask or [[True] * len(r["completions"]) for r in records]
    return [[k and not nothing for k in row] for row, nothing in zip(keep, (trains_nothing(cfg, r) for r in records))]


def tis_figures(weights: list[list[torch.Tensor]], cap: float, mask) -> dict:
    """What truncated importance sampling did to the tokens in the loss (of the completions
    `mask` keeps: trained_only): the share whose weight the cap cut (tis_capped_fraction) and
    the mean weight after the cap (tis_weight_mean)."""
    keep = [True] * sum(map(len, weights)) if mask is None else [m for row in mask for m in row]
    tokens = [w for w, k in zip((w for row in weights for w in row), keep) if k and w.numel()]
    if not tokens:
        return {}
    flat = torch.cat(tokens)
    return {"tis_capped_fraction": float((flat >= cap).double().mean()), "tis_weight_mean": float(flat.mean())}


def _dpo(cfg, records: list[dict], trees, acts: list[TreeActivations]) -> Objective:
    """DPO over each tree's best and worst leaf (an offline record's chosen and rejected), its
    sequence logprobs over the model's tokens (an episode's environment tokens left out)."""
    sampled = sampled_masks([sampled_flags(r) for r in records])
    logprobs = [completion_values(t, a.entry_logprobs) for t, a in zip(trees, acts)]
    ref = sequence_logprobs(model_tokens([completion_values(t, a.ref_entry_logprobs) for t, a in zip(trees, acts)],
                                         sampled))
    pairs = [[] if gone else tree_pairs for tree_pairs, gone in
             zip(best_worst_pairs([dpo_rewards(cfg, r) for r in records]), left_out(cfg, records))]
    beta = cfg.algo.dpo_beta

    def loss_for(idx: list[int]):
        sub_pairs, sub_ref = [pairs[i] for i in idx], [ref[i] for i in idx]
        return on_model_tokens(lambda scores: dpo_loss(scores, sub_pairs, sub_ref, beta), pick(sampled, idx))

    def figures(idx: list[int], scores) -> dict:
        """TRL's DPO figures: the implicit reward margin beta x (policy - reference) of chosen
        over rejected, and the share of pairs where it is positive."""
        seq = sequence_logprobs(model_tokens(scores, pick(sampled, idx)))
        margins = [beta * float((seq[i][c] - ref[i][c]) - (seq[i][r] - ref[i][r])) for i in idx for c, r in pairs[i]]
        if not margins:
            return {}
        return {"dpo_reward_margin": sum(margins) / len(margins),
                "dpo_reward_accuracy": sum(m > 0 for m in margins) / len(margins)}

    extras = {"dpo_pairs": sum(map(len, pairs)), "dpo_unpaired_trees": sum(not p for p in pairs)}
    return Objective(loss_for, [[list(range(len(trees)))]], logprobs, policy_heads(cfg), extras, figures)
