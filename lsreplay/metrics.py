"""One flat metrics record per RL step, from the stages' manifests."""

from __future__ import annotations


ALGO_KEYS = ("lr", "updates", "clip_fraction", "value_loss", "value_explained_variance", "value_clip_fraction",
             "dpo_pairs", "dpo_unpaired_trees", "dpo_reward_margin", "dpo_reward_accuracy")


def step_record(step: int, manifests: dict[str, dict]) -> dict:
    trees, prefixes, policy = manifests["trees"], manifests["prefixes"], manifests["policy"]
    record = {
        "step": step,
        "reward_mean": trees["reward_mean"],
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
    if "kl" in policy:
        record["kl"] = policy["kl"]
    # The algorithm's figures (docs/algorithms.md): learning rate, updates, clipping, the
    # critic's, DPO's pairs and implicit rewards; and the trees that train nothing.
    for key in ALGO_KEYS:
        if key in policy:
            record[key] = policy[key]
    for key in ("trees_all_alike", "prompts_drawn", "trees_dropped"):
        if key in trees:
            record[key] = trees[key]
    # The rollout engine's logprobs against the trainer's, per token (whenever the caching pass scores).
    for key in ("engine_logprob_gap_mean", "engine_logprob_gap_max"):
        if key in prefixes:
            record[key] = prefixes[key]
    # Loading and saving state next to the compute: the stages' waits for models to load
    # and for the checkpoint snapshot (its write runs in the background).
    record["state_seconds"] = sum(manifests[s].get("state_seconds", 0.0) for s in ("trees", "prefixes", "policy"))
    record["policy_state_seconds"] = policy.get("state_seconds", 0.0)
    if policy.get("device_peak_bytes"):
        record["device_peak_bytes"] = policy["device_peak_bytes"]
    # The tree shape per tree: leaves sampled, the samples G they stand for, and the
    # effective group size of their counts (stages.trees.group_stats; absent from the
    # manifests of rollouts sampled before leaves carried counts).
    for key in ("leaves_per_tree", "group_size", "effective_group_size"):
        if key in trees:
            record[key] = trees[key]
    for stage, manifest in manifests.items():
        if "seconds" in manifest:
            record[f"{stage}_seconds"] = manifest["seconds"]
    # Wall time of the RL step proper, prompts to policy update: the drafter is left out, as
    # it trains alongside the next step's rollouts.
    spans = [manifests[s] for s in ("prompts", "trees", "prefixes", "policy") if manifests[s].get("started")]
    record["step_seconds"] = max(m["ended"] for m in spans) - min(m["started"] for m in spans)
    if "drafter" in manifests:
        d = manifests["drafter"]
        record["drafter_steps"] = d["steps_done"]
        if d["steps_done"]:  # a session that trained no step has no figures
            record.update(drafter_loss=d["drafter_loss"], drafter_top1_accept=d["drafter_top1_accept"])
    return record


# The evaluation stage's figures, as they appear in a step's record (eval_accuracy, ...).
EVAL_KEYS = ("accuracy", "accuracy_lo", "accuracy_hi", "greedy_reward", "sample_accuracy", "sample_accuracy_lo",
             "sample_accuracy_hi", "reward", "reward_lo", "reward_hi", "prompts", "samples", "seconds")


def eval_record(step: int, manifest: dict) -> dict:
    """The held-out evaluation of the policy after `step` updates, for that step's record."""
    return {"step": step, **{f"eval_{k}": manifest[k] for k in EVAL_KEYS if k in manifest}}
