"""A completion no reward function applies to (every one returned None) as TRL >= 1.6 treats
it: left out of its group's baseline and std, and of the batch's (scale_rewards=batch), with
advantage 0 (GRPOTrainer._generate_and_score_completions: nansum of the weighted rewards,
NaN for unscorable rows, nanmean and nanstd, nan_to_num); left out of the reward figures,
of DPO's pairs and of what decides a tree trains nothing."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lsreplay.algos.dpo import best_worst_pairs
from lsreplay.algos.grpo import batch_reward_std, group_advantages, tree_advantages
from lsreplay.metrics.records import rollout_metrics
from lsreplay.stages.common import all_alike
from lsreplay.stages.trees import group_stats

NAN = float("nan")
GROUPS = [[1.0, None, 0.0, 1.0], [None, None, 0.5, 2.0], [None, None, None, None], [3.0, 3.0, None, 3.0]]
EPS = 1e-6  # lsreplay's (TRL adds 1e-4 to the std)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """trl.trainer.utils.nanstd: Bessel-corrected, NaNs ignored, NaN below two values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    return torch.where(count > 1, variance, torch.full_like(variance, NAN)).sqrt()


def trl_advantages(groups: list[list], scale: str) -> torch.Tensor:
    """GRPOTrainer's sum_then_normalize advantages (TRL 1.16), with lsreplay's eps."""
    rewards = torch.tensor([[NAN if r is None else r for r in g] for g in groups], dtype=torch.float64)
    mean = torch.nanmean(rewards, dim=1, keepdim=True)
    std = nanstd(rewards, dim=1) if scale == "group" else nanstd(rewards.flatten()).expand_as(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + EPS)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_of_flat_groups_are_trls(scale):
    batch_std = batch_reward_std(GROUPS) if scale == "batch" else None
    ours = torch.stack([tree_advantages(g, scale, batch_std=batch_std, eps=EPS) for g in GROUPS])
    theirs = trl_advantages(GROUPS, scale)
    # TRL's nanstd of a one-element group is NaN, so its advantage is NaN -> 0; lsreplay's is 0 as well.
    assert torch.allclose(ours, theirs, atol=1e-12), (ours, theirs)
    assert ours[2].tolist() == [0.0] * 4 and ours[0, 1] == 0.0


def test_the_independent_baseline_leaves_unscorable_leaves_out():
    """A tree [[a, b], [c, d]] (two first-level subtrees) with b unscorable: a, c, d get the
    advantages of the tree without b, b gets 0; with every scored leaf in one subtree, no leaf
    is independent of another and the group mean is their baseline."""
    rewards, subtrees = [1.0, None, 0.0, 0.5], [0, 0, 1, 1]
    kept = group_advantages(torch.tensor([1.0, 0.0, 0.5]), True, subtrees=[0, 1, 1]).tolist()
    assert tree_advantages(rewards, "group", subtrees=subtrees).tolist() == pytest.approx(
        [kept[0], 0.0, kept[1], kept[2]])
    one_subtree = tree_advantages([1.0, 0.0, None, None], "group", subtrees=subtrees)
    assert one_subtree.tolist() == pytest.approx([*group_advantages(torch.tensor([1.0, 0.0]), True).tolist(), 0, 0])


def record(rewards, counts) -> dict:
    return {"completions": [[1, 2]] * len(rewards), "rewards": rewards, "counts": counts,
            "finished": [True] * len(rewards), "logprobs": None, "prompt_ids": [7],
            "reward_functions": {"f": rewards}}


def test_reward_figures_leave_unscorable_samples_out():
    records = [record([1.0, None, 0.0], [2, 1, 1]), record([None, None], [1, 1]), record([0.5, 0.5], [1, 1])]
    m = rollout_metrics(records, max_new_tokens=4)
    samples = [1.0, 1.0, 0.0, 0.5, 0.5]  # the scored leaves, each as the samples it stands for
    assert m["reward_std"] == pytest.approx(float(nanstd(torch.tensor(samples, dtype=torch.float64))[0]))
    assert m["rewards/f/mean"] == pytest.approx(sum(samples) / 5)
    assert m["frac_reward_zero_std"] == pytest.approx(1 / 3)  # only the third: the second has no std (TRL: NaN)
    assert group_stats(records)["reward_mean"] == pytest.approx(sum(samples) / 5)
    assert batch_reward_std([r["rewards"] for r in records], [r["counts"] for r in records]) == pytest.approx(
        m["reward_std"])


def test_unscorable_leaves_take_no_part_in_pairs_or_in_what_trains():
    assert best_worst_pairs([[None, 1.0, 0.0], [None, None], [None, 2.0]]) == [[(1, 2)], [], []]
    assert all_alike([None, 1.0, 1.0]) and all_alike([None, None]) and not all_alike([None, 1.0, 0.0])


def test_a_step_with_unscorable_completions_trains_on_the_rest(tiny_model_dir, tmp_path, monkeypatch):
    """TRL's multi-task reward (its docs' Example 4): a function for math rows returns None on
    the others. Their trees keep reward None, the step's figures leave them out, the update
    runs; the reward functions got the run's TrainerState."""
    from lsreplay import stages
    from lsreplay.core.config import load_config
    from lsreplay.stages.preflight import preflight
    from lsreplay.stages.trainer_state import trainer_state

    (tmp_path / "multi_task_15.py").write_text(
        "def math_reward_func(completions, task, **kwargs):\n"
        "    return [float(len(c) % 2) if t == 'math' else None for c, t in zip(completions, task)]\n")
    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} + {i} =", "task": "math" if i % 2 else "code"}) + "\n"
                            for i in range(6)))
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", f"data.path={rows}",
                             "data.prompts_per_step=6", "rollout.branching=[2,2]", "rollout.segment_tokens=[2]",
                             "rollout.max_new_tokens=5", "drafter.enabled=false", "optim.lr=1e-2",
                             "reward.functions=[multi_task_15.math_reward_func]", "steps=2"])
    run = preflight(cfg)
    stages.sample_prompts(run, 0)
    manifest = stages.generate_trees(run, 0)
    records = json.loads(run.store.read_bytes(manifest["files"][0]["key"]))["trees"]
    code = [r for r in records if r["prompt_index"] % 2 == 0]
    assert len(code) == 3 and all(reward is None for r in code for reward in r["rewards"])
    scored = [(n, v) for r in records for n, v in zip(r["counts"], r["rewards"]) if v is not None]
    assert manifest["reward_mean"] == pytest.approx(sum(n * v for n, v in scored) / sum(n for n, _ in scored))
    stages.cache_prefixes(run, 0)
    assert math.isfinite(stages.train_policy(run, 0)["loss"])
    state = trainer_state(run, 1)
    assert (state.global_step, state.max_steps, state.epoch) == (1, 2, 1.0)  # 6 prompts of 6 rows
    assert state.num_input_tokens_seen == manifest["num_tokens"] == sum(
        n * (len(r["prompt_ids"]) + len(c)) for r in records for n, c in zip(r["counts"], r["completions"]))
