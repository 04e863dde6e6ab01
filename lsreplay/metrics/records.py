"""One flat metrics record per RL step, from the stages' manifests.

Next to lsreplay's own keys (reward_mean, loss, step_seconds, ...) a record carries TRL's
GRPOTrainer names where the meaning is the same (TRL 1.16): reward, reward_std (over the
step's batch, as TRL since 0.27), rewards/NAME/mean and /std, frac_reward_zero_std,
num_tokens, completions/{mean,min,max}_length and completions/{mean,min,max}_terminated_length,
completions/clipped_ratio, entropy, clip_ratio/{region,low,high}_mean, clip_ratio/low_min,
clip_ratio/high_max, learning_rate, grad_norm, loss, kl, step_time; and what the reward
functions gave log_metric, under their names. A tree's leaf counts as the samples it
stands for, so each figure is that of the G samples per prompt a flat GRPO run would draw;
a completion no reward function applies to is left out of the reward figures, as in TRL.
"""

from __future__ import annotations

import math
import numbers

from lsreplay.algos.model_tokens import sampled_flags


# The trees stage's figures under TRL's names (rollout_metrics), copied into the step's record.
TRL_ROLLOUT_PREFIXES = ("completions/", "rewards/", "extras/")
TRL_ROLLOUT_KEYS = ("reward_std", "frac_reward_zero_std", "entropy", "num_tokens")
TRL_POLICY_KEYS = ("learning_rate", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
                   "clip_ratio/low_min", "clip_ratio/high_max")


def _weighted(values: list[float], counts: list[int]) -> tuple[float, float]:
    """Mean and sample standard deviation of values each standing for `counts` samples."""
    n = sum(counts)
    mean = sum(c * v for c, v in zip(counts, values)) / n
    var = sum(c * (v - mean) ** 2 for c, v in zip(counts, values)) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var)


def _scored(values: list, counts: list[int]) -> tuple[list[float], list[int]]:
    """The values a reward function gave (not None), and the samples each stands for."""
    pairs = [(float(v), n) for v, n in zip(values, counts) if v is not None]
    return [v for v, _ in pairs], [n for _, n in pairs]


def rollout_metrics(records: list[dict], max_new_tokens: int) -> dict:
    """TRL's rollout figures of a step's tree records: the reward figures (_reward_figures),
    completion lengths (all, and of those that ended with EOS), the share cut at
    max_new_tokens, the entropy of the sampled tokens (their mean negative logprob under the
    distribution they were drawn from, tempered and truncated: an unbiased estimate of its
    per-token entropy; not for a preference dataset's answers, which nothing sampled), and the
    mean of each numeric column the reward functions logged per completion (extras/COLUMN/mean)."""
    counts = [r.get("counts", [1] * len(r["completions"])) for r in records]
    # Lengths in the model's tokens: an episode's replies, not the environment's answers between them.
    leaves = [(sum(flags), f, n, lps) for r, ns in zip(records, counts)
              for flags, f, n, lps in zip(sampled_flags(r), r["finished"], ns, r["logprobs"] or [None] * len(ns))]
    out = _reward_figures(records, counts)
    for key, chosen in (("", leaves), ("_terminated", [leaf for leaf in leaves if leaf[1]])):
        samples = sum(n for _, _, n, _ in chosen)
        out[f"completions/mean{key}_length"] = sum(n * k for k, _, n, _ in chosen) / samples if samples else 0.0
        out[f"completions/min{key}_length"] = min((k for k, *_ in chosen), default=0)
        out[f"completions/max{key}_length"] = max((k for k, *_ in chosen), default=0)
    samples = sum(n for *_, n, _ in leaves)
    out["completions/clipped_ratio"] = sum(n for _, f, n, _ in leaves if not f) / samples
    # The model's tokens only: an episode's environment tokens were not sampled (logprob 0 in the record).
    tokens = sum(n * sum(flags) for r, ns in zip(records, counts) for flags, n in zip(sampled_flags(r), ns))
    if tokens and all(lps is not None for *_, lps in leaves):
        out["entropy"] = -sum(n * sum(lps) for _, _, n, lps in leaves) / tokens
    for column in dict.fromkeys(k for r in records for k in r.get("extras", {})):
        pairs = [(v, n) for r, ns in zip(records, counts) for v, n in zip(r.get("extras", {}).get(column, []), ns)
                 if isinstance(v, numbers.Real)]  # numbers and bools (verl's acc); text stays in trees.json
        if pairs:
            out[f"extras/{column}/mean"] = _weighted([float(v) for v, _ in pairs], [n for _, n in pairs])[0]
    return out


def episode_metrics(records: list[dict]) -> dict:
    """Episodes' figures (episodes/NAME), each leaf counted as the samples it stands for: turns
    per episode, tool calls per episode, the share of tool calls that failed, and the share
    of completion tokens the environment wrote (tool results, its messages, the template
    around them; every length figure counts the model's tokens only). Nothing for
    single-turn rollouts."""
    if not any("turns" in r for r in records):
        return {}
    leaves = [(n, t, calls, errors, len(flags) - sum(flags), len(flags))
              for r in records for n, t, calls, errors, flags in zip(r["counts"], r["turns"], r["tool_calls"],
                                                                      r["tool_errors"], r["sampled"])]
    samples, calls = sum(leaf[0] for leaf in leaves), sum(n * c for n, _, c, *_ in leaves)
    tokens = sum(n * k for n, *_, k in leaves)
    return {"episodes/turns_mean": sum(n * t for n, t, *_ in leaves) / samples,
            "episodes/tool_calls_mean": calls / samples,
            "episodes/tool_error_share": sum(n * e for n, _, _, e, _, _ in leaves) / calls if calls else 0.0,
            "episodes/environment_token_share": sum(n * e for n, *_, e, _ in leaves) / tokens if tokens else 0.0}


def _reward_figures(records: list[dict], counts: list[list[int]]) -> dict:
    """The std of the batch's rewards (TRL's reward_std since 0.27), the share of trees whose
    rewards do not vary, and each reward function's mean and std over the completions it
    applies to; unscorable completions (reward None) left out, as TRL's nanstd leaves NaN."""
    trees = [_scored(r["rewards"], ns) for r, ns in zip(records, counts)]
    batch = _scored([v for vs, _ in trees for v in vs], [n for _, ns in trees for n in ns])
    # As TRL's nanstd: a group of fewer than two scored samples has no std (it is not "zero").
    zero = [sum(ns) >= 2 and _weighted(vs, ns)[1] == 0 for vs, ns in trees]
    out = {"reward_std": _weighted(*batch)[1] if sum(batch[1]) else 0.0,
           "frac_reward_zero_std": sum(zero) / len(zero)}
    for name in dict.fromkeys(k for r in records for k in r.get("reward_functions", {})):
        values, ns = _scored([v for r in records for v in r["reward_functions"][name]], [n for ns in counts for n in ns])
        if values:
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = _weighted(values, ns)
    return out


# Episodes' figures (episode_metrics; the engine's counters, stages.trees.EPISODE_COUNTERS).
EPISODE_KEYS = ("episodes/turns_mean", "episodes/tool_calls_mean", "episodes/tool_error_share",
                "episodes/environment_token_share", "episodes/prefill_positions", "episodes/history_positions")
# Figures a stage's manifest holds only for some configs, copied into the step's record
# where present. trees: the most K/V bytes the HF sampler held (rollout.shared_prompt: each
# prompt's once), the trees that train nothing (with dynamic sampling, prompts_drawn -
# trees were dropped for that), the policy version that sampled them, and the tree shape
# per tree (stages.trees.group_stats;
# absent from rollouts sampled before leaves carried counts). prefixes: the rollout
# engine's logprobs against the trainer's, per token. policy: the algorithm's figures
# (docs/algorithms.md): KL, updates, the critic's, DPO's pairs and implicit rewards, the
# trees dynamic sampling left out of the loss, what truncated importance sampling capped,
# and TRL's learning rate and clip fractions; with asynchronous rollouts (docs/async.md)
# the trees dropped as too stale, the others' staleness, and the behaviour ratio's figures
# per staleness (OFF_POLICY_PREFIX).
OPTIONAL_KEYS = {
    "trees": ("kv_bytes_peak", "trees_all_alike", "prompts_drawn", "trees_dropped", "policy_version",
              "leaves_per_tree", "group_size",
              "effective_group_size", *EPISODE_KEYS),
    "prefixes": ("engine_logprob_gap_mean", "engine_logprob_gap_max"),
    "policy": ("kl", "updates", "layer_by_layer_positions", "value_loss", "value_explained_variance", "value_clip_fraction", "dpo_pairs",
               "dpo_unpaired_trees", "dpo_reward_margin", "dpo_reward_accuracy", "trees_left_out",
               "tis_capped_fraction", "tis_weight_mean", "trees_stale_dropped", "staleness_mean", "staleness_max",
               *TRL_POLICY_KEYS),
}
OFF_POLICY_PREFIX = "off_policy/"


def step_record(step: int, manifests: dict[str, dict]) -> dict:
    trees, prefixes, policy = manifests["trees"], manifests["prefixes"], manifests["policy"]
    record = {
        "step": step,
        "reward_mean": trees["reward_mean"],
        "reward": trees["reward_mean"],  # TRL's name
        "loss": policy["loss"],
        "grad_norm": policy["grad_norm"],
        "rollouts": trees["rollouts"],
        "completion_tokens": trees["completion_tokens"],
        "rollout_tokens_per_s": trees["tokens_per_s"],
        "rollout_positions": trees["forward_positions"],
        "tail_time_share": trees["tail_time_share"],
        # The adaptive engine: speculative rounds in the tail, tokens per sequence per verify.
        "spec_rounds": trees["spec_rounds"],
        "rollout_accept_len": trees["accept_len"],
        "positions": policy["positions"],
        "per_rollout_positions": policy["per_rollout_positions"],
        "positions_ratio": policy["positions_ratio"],
        "prefix_kv_bytes": prefixes["kv_bytes"],
        "peak_activation_bytes": policy["peak_activation_bytes"],
        "train_positions_per_s": policy["positions"] / max(policy["backward_seconds"], 1e-9),
    }
    # The figures a stage's manifest has only for some configs, copied where present
    # (OPTIONAL_KEYS), and the trees stage's TRL-named ones (rollout_metrics).
    for stage, keys in OPTIONAL_KEYS.items():
        record.update({k: manifests[stage][k] for k in keys if k in manifests[stage]})
    record.update({k: v for k, v in trees.items() if k in TRL_ROLLOUT_KEYS or k.startswith(TRL_ROLLOUT_PREFIXES)})
    record.update({k: v for k, v in policy.items() if k.startswith(OFF_POLICY_PREFIX)})
    if prefixes.get("seconds"):
        record["prefixes_positions_per_s"] = prefixes["unique_positions"] / max(prefixes["seconds"], 1e-9)
    # Loading and saving state next to the compute: the stages' waits for models to load
    # and for the checkpoint snapshot (its write runs in the background).
    record["state_seconds"] = sum(manifests[s].get("state_seconds", 0.0) for s in ("trees", "prefixes", "policy"))
    record["policy_state_seconds"] = policy.get("state_seconds", 0.0)
    if policy.get("device_peak_bytes"):
        record["device_peak_bytes"] = policy["device_peak_bytes"]
    for stage, manifest in manifests.items():
        if "seconds" in manifest:
            record[f"{stage}_seconds"] = manifest["seconds"]
    # Wall time of the RL step proper, prompts to policy update: the drafter is left out, as
    # it trains alongside the next step's rollouts.
    spans = [manifests[s] for s in ("prompts", "trees", "prefixes", "policy") if manifests[s].get("started")]
    record["step_seconds"] = max(m["ended"] for m in spans) - min(m["started"] for m in spans)
    record["step_time"] = record["step_seconds"]  # TRL's name
    if "drafter" in manifests:
        d = manifests["drafter"]
        record["drafter_steps"] = d["steps_done"]
        if d["steps_done"]:  # a session that trained no step has no figures
            record.update(drafter_loss=d["drafter_loss"], drafter_top1_accept=d["drafter_top1_accept"])
    return {**logged(trees), **record}


def logged(manifest: dict) -> dict[str, float]:
    """What the reward functions gave log_metric, under their names (TRL's); lsreplay's own
    keys win where a name is taken."""
    return dict(manifest.get("logged", {}))


# The evaluation stage's figures, as they appear in a step's record (eval_accuracy, ...).
EVAL_KEYS = ("accuracy", "accuracy_lo", "accuracy_hi", "greedy_reward", "sample_accuracy", "sample_accuracy_lo",
             "sample_accuracy_hi", "reward", "reward_lo", "reward_hi", "prompts", "unscored", "samples", "seconds",
             "tokens_per_s")


def eval_record(step: int, manifest: dict) -> dict:
    """The held-out evaluation of the policy after `step` updates, for that step's record;
    what the reward functions gave log_metric as eval_NAME (TRL's eval prefix)."""
    figures = {**logged(manifest), **{k: manifest[k] for k in EVAL_KEYS if k in manifest}}
    return {"step": step, **{f"eval_{k}": v for k, v in figures.items()}}
