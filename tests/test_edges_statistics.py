"""Edges of the step's statistics: every figure counts the tokens the loss counts.

- Truncated importance sampling's figures (tis_capped_fraction, tis_weight_mean) over the
  trees the update trains: a tree that trains nothing had no caching pass, so it has no
  trainer logprobs to weigh (read as zeros, each of its tokens looked capped).
- TRL's clip_ratio/* over the completions in the loss: an answer algo.overlong=mask leaves
  out is in no denominator of the loss, nor of the figures.
- Online DPO under algo.overlong=mask: an answer cut at the limit takes no part in a pair
  (its reward judges a truncation), as it takes no part in GRPO's loss.

The first runs a real sampled step; the others run the caching pass and the objective over
trees written by hand, on the tiny model.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from lsreplay import stages
from lsreplay.algos.weights import loss_and_weights
from lsreplay.core.config import load_config
from lsreplay.stages.common import load_trees
from lsreplay.stages.objectives import objective
from lsreplay.stages.preflight import preflight
from lsreplay.state.resident import RESIDENT
from test_algorithms import run_steps


def test_importance_sampling_figures_leave_out_the_trees_that_train_nothing(tiny_model_dir, tmp_path):
    """The HF engine samples with the trainer's own probabilities, so every weight of a token
    the update trains is 1 (to rounding) and none is capped. Half of the step's trees score
    all their leaves alike (no KL term: they train nothing and get no caching pass)."""
    _, m = run_steps(tmp_path, tiny_model_dir, ["algo.tis_cap=2", "data.prompts_per_step=4",
                                                 "reward.function=varied_rewards:alike_on_even_prompts"])
    assert m["trees"]["trees_all_alike"] == 2
    policy = m["policy"]
    assert policy["tis_capped_fraction"] == 0.0
    assert policy["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def hand_step(tmp_path, model_dir, trees: list[dict], overrides: list[str]):
    """Step 0 of a run whose trees stage wrote `trees` (records as it writes them), its
    caching pass, and the step's objective over them."""
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={model_dir}", "data.size=16",
                             f"data.prompts_per_step={len(trees)}", "rollout.branching=[3]",
                             "rollout.segment_tokens=[]", "rollout.max_new_tokens=4", "drafter.enabled=false",
                             "algo.tree_baseline=group", "checkpoint.keep_step_data=true", *overrides])
    run = preflight(cfg)
    run.save_or_check_config()
    run.begin(0, "trees")
    entry = run.store.write_json(run.key(0, "trees.json"), {"trees": trees})
    run.finish(0, "trees", {"files": [entry]})
    prefixes = stages.cache_prefixes(run, 0)
    records, rollout_trees = load_trees(run, 0)
    goal = objective(run, 0, records, rollout_trees, prefixes)
    RESIDENT.release(run)
    return goal


def tree(tokenizer, prompt: str, leaves: list[tuple[str, float]]) -> dict:
    """A tree of one level: each leaf's digits, ended by EOS unless it fills max_new_tokens=4."""
    eos = tokenizer.eos_token_id
    completions = [tokenizer.convert_tokens_to_ids(list(text)) for text, _ in leaves]
    completions = [c if len(c) == 4 else c + [eos] for c in completions]
    return {"prompt_index": 0, "prompt_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"],
            "completions": completions, "logprobs": None, "finished": [c[-1] == eos for c in completions],
            "texts": [text for text, _ in leaves], "rewards": [r for _, r in leaves], "reward_functions": {},
            "counts": [1] * len(leaves), "paths": [[j] for j in range(len(leaves))]}


def test_clip_ratios_count_the_tokens_in_the_loss_only(tiny_model_dir, tmp_path):
    """Scores that fell by 1 nat on every answer with a negative advantage (ratio e^-1, below
    1 - eps): the one finished answer is cut low; the answer cut at the limit is out of the
    loss (algo.overlong=mask), and so out of the figures, numerator and denominator."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trees = [tree(tokenizer, "Add 1 and 2.", [("3", 1.0), ("4", 0.0), ("5555", 0.0)])]
    goal = hand_step(tmp_path, tiny_model_dir, trees, ["algo.name=ppo", "algo.overlong=mask"])
    finished, wrong, cut = goal.old[0]
    fell = [[finished, wrong - 1, cut - 1]]
    figures = goal.figures([0], fell)
    in_loss = finished.numel() + wrong.numel()
    assert figures["clip_ratio/low_mean"] == pytest.approx(wrong.numel() / in_loss)
    assert figures["clip_ratio/region_mean"] == pytest.approx(wrong.numel() / in_loss)
    assert figures["clip_ratio/low_min"] == 0.0  # the finished answer with a positive advantage


def test_online_dpo_pairs_no_answer_the_overlong_mask_leaves_out(tiny_model_dir, tmp_path):
    """Tree 0: the cut answer scored best, so without the mask it would be the chosen one;
    with it, the best finished answer is. Tree 1: only its cut answer differs, so it has no
    pair (and trains nothing)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trees = [tree(tokenizer, "Add 1 and 2.", [("3", 0.5), ("4", 0.0), ("3333", 1.0)]),
             tree(tokenizer, "Add 2 and 2.", [("4", 0.0), ("5", 0.0), ("4444", 1.0)])]
    goal = hand_step(tmp_path, tiny_model_dir, trees, ["algo.name=dpo", "algo.overlong=mask"])
    assert goal.extras == {"dpo_pairs": 1, "dpo_unpaired_trees": 1}
    _, weights = loss_and_weights(goal.loss_for([0, 1]), goal.old)
    chosen, rejected, cut = weights[0]
    assert (chosen < 0).all() and (rejected > 0).all() and not cut.any()  # dL/dlogp: the chosen rises
    assert not any(w.any() for w in weights[1])
    assert all(not lp.any() for lp in goal.old[1])  # trains nothing: no caching pass (zeros, read by no weight)

