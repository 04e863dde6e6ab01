"""The sections of what a step learns and how: the objective (algo), the optimizer (optim)
and the replay backward that computes its gradient (replay)."""

from __future__ import annotations

from dataclasses import dataclass

# The names algo.loss_agg and algo.kl_estimator take; lsreplay.algos.grpo and .kl implement each.
LOSS_AGGS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")
# What algo.scale_rewards divides advantages by: the group's reward std, the batch's, nothing.
SCALE_REWARDS = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
TREE_BASELINES = ("independent", "group")
ALGOS = ("grpo", "ppo", "dpo")
ADVANTAGES = ("group", "gae")
DPO_SOURCES = ("rollouts", "dataset")
OVERLONG = ("none", "mask", "penalty")
SCHEDULES = ("constant", "linear", "cosine")
# What dynamic sampling judges "alike" on (algo.dynamic_sampling_metric); NAME is a reward function's.
DYNAMIC_SAMPLING_METRICS = ("reward", "training_reward", "rewards/NAME")
# TRL's booleans for algo.scale_rewards (GRPOConfig: True is "group", False is "none").
SCALE_REWARDS_BOOLEANS = {"true": "group", "false": "none"}


@dataclass
class AlgoConfig:
    # grpo, ppo (several epochs and minibatches per batch, optionally a critic) or dpo
    # (online over each tree's best and worst leaf, or offline from a preference dataset):
    # docs/algorithms.md.
    name: str = "grpo"
    # token-mean: every completion token counts equally across the batch;
    # seq-mean: each completion's token mean, averaged over completions;
    # seq-mean-token-sum-norm: Dr. GRPO's unbiased sum / (completions * max_new_tokens).
    loss_agg: str = "token-mean"
    # What advantages are divided by, as TRL's scale_rewards: "group", the std of the
    # group's rewards; "batch", the std of the step's rewards (Lite PPO); "none" (Dr. GRPO's
    # unbiased variant). true and false mean group and none, as in TRL.
    scale_rewards: str = "group"
    # The baseline a tree leaf's reward is compared with. "independent": the mean over the
    # leaves of the other first-level subtrees (none shares a sampled token with it), scaled
    # so that the expected gradient is flat GRPO's on prod(rollout.branching) rollouts;
    # needs rollout.branching[0] >= 2. "group": the mean over all leaves, its own siblings
    # included, which shrinks the gradient on the tokens siblings share (docs/algorithms.md).
    tree_baseline: str = "independent"
    # KL penalty to the frozen base model (0 = off; no reference pass then).
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    clip_eps: float = 0.2
    # The ratio's upper clip, 1 + clip_eps_high (DAPO's clip-higher, e.g. 0.28); 0 = clip_eps.
    clip_eps_high: float = 0.0
    # Truncated importance sampling: weight every token's advantage by min(p_trainer /
    # p_engine, tis_cap) of that token, for a rollout engine whose probabilities differ from
    # the trainer's (vLLM; the step's engine_logprob_gap_* say by how much). 0 = off.
    tis_cap: float = 0.0
    # Off-policy correction (rollout.max_staleness > 0; docs/async.md): false, the clipped
    # ratio is against the behaviour policy's logprobs (those the rollouts recorded); true,
    # AReaL's decoupled PPO: against the proximal policy (the caching pass's recomputed
    # logprobs at the update's start), each token weighted by min(p_proximal / p_behaviour,
    # behaviour_cap) (0 = uncapped).
    decoupled: bool = False
    behaviour_cap: float = 5.0
    # PPO: passes over each step's trees, and minibatches (of whole trees) per pass; one
    # optimizer update per minibatch.
    epochs: int = 1
    minibatches: int = 1
    # PPO's advantages: "group" (GRPO's, over each tree's leaves) or "gae" (from the critic).
    advantage: str = "group"
    # PPO: a critic, a value head on the policy's own trunk trained with a clipped value loss.
    critic: bool = False
    gamma: float = 1.0
    lam: float = 0.95
    # The value loss's weight next to the policy loss, its clip range around the old values
    # (0 = no clip), and the value head's learning rate (the trunk learns at optim.lr).
    vf_coef: float = 0.1
    value_clip: float = 0.2
    value_lr: float = 1.0e-4
    # DPO: beta, and where the pairs come from: "rollouts" (each tree's best leaf against
    # its worst, online) or "dataset" (offline: data.path is a preference dataset with
    # prompt, chosen and rejected columns; no rollouts).
    dpo_beta: float = 0.1
    dpo_source: str = "rollouts"
    # Dynamic sampling (DAPO): a tree whose leaves all score alike on `dynamic_sampling_metric`
    # is replaced by the tree of another prompt, drawn in advance by the prompts stage, for up
    # to this many rounds of draws in all (the first included); a tree still all alike after
    # the last round is left out of the loss and its denominators (DAPO keeps only groups
    # that differ; verl draws more batches instead).
    dynamic_sampling: bool = False
    dynamic_sampling_draws: int = 4
    # What "alike" is judged on: "reward" (what the reward functions returned: accuracy for a
    # checker, verl's filter_groups.metric=acc), "training_reward" (after the overlong
    # penalty) or "rewards/NAME" (one reward function's values, NAME as in rewards/NAME/mean).
    dynamic_sampling_metric: str = "reward"
    # Answers cut at rollout.max_new_tokens: "none"; "mask" (left out of the policy loss);
    # "penalty": a reward minus overlong_penalty x (length - (max_new_tokens -
    # overlong_buffer)) / overlong_buffer over the last overlong_buffer tokens (DAPO's).
    overlong: str = "none"
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    # Max global gradient norm; 0 = no clipping.
    grad_clip: float = 1.0
    # The learning rate over the run's optimizer updates (one per step; algo.epochs x
    # algo.minibatches per step with PPO): constant, or decaying towards 0 (linear, cosine,
    # which makes `steps` change the results; as transformers' schedules, the last update
    # runs at lr / (updates - warmup_steps) and 0 would be the next), after a linear warmup
    # of warmup_steps updates from lr / warmup_steps.
    schedule: str = "constant"
    warmup_steps: int = 0


@dataclass
class ReplayConfig:
    # "replay" (branch replay) or "naive" (per-rollout backward, the baseline).
    mode: str = "replay"
    # Memory for one micro-batch of sibling leaves, MiB; 0 = what one per-rollout backward needs.
    budget_mb: int = 0
    # Shard weights, gradients and optimizer state over the ranks with FSDP2.
    fsdp: bool = False
    # "store": the backward reads prefix K/V back from the run's storage (works across
    # processes and after a crash); "host": also keep them in CPU memory between the
    # caching and backward stages of one process, read from storage only if missing.
    kv_offload: str = "store"
    # A branching node run layer by layer (one whose graph does not fit replay.budget_mb: a
    # long prompt) keeps its layer inputs in pinned host memory on CUDA, each fetched back one
    # layer ahead of its backward on a side stream; on a CPU it changes nothing.
    offload_prefix: bool = False
    # Join a branching node into its children when (children - 1) x its tokens is below
    # this: every replay run costs about this many positions' worth on top of its length
    # (a pass over all weight gradients; ~100 for SmolLM2-135M on 2 CPU cores). 0: never.
    join_below: int = 64
    # -- Context parallelism (lsreplay/distributed/context.py; docs/pool-and-scale-out.md) --
    # Ranks of the update a prompt too long for one device is split over, in contiguous
    # shares: each rank runs its share layer by layer and replays a share of the prompt's
    # answers on the whole prompt; the gradient is the one-device one. 1: no splitting.
    # Groups of this many consecutive ranks: it divides pool.devices_per_step.
    context_parallel: int = 1
    # A tree whose prompt (with the opening its answers share) has at least this many tokens
    # is split; 0 = one that a device cannot replay within replay.budget_mb (the least budget
    # a tree needs, memory.least_budget, as `lsreplay plan` counts it). Other trees keep the
    # one-device path, whole trees per rank.
    context_parallel_tokens: int = 0
