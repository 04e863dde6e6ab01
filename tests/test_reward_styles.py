"""Reward functions as TRL's and verl's docs write them (TRL: GRPO Trainer, "Using a custom
reward function"; verl: "Implement Reward Function for Dataset"), told apart by their
parameters, given what those trainers give them, weighted, and each one's mean logged."""

from __future__ import annotations

import functools
import json
import re
import statistics

import pytest
from transformers import TrainerState

from lsreplay.algos.grpo import clip_fractions
from lsreplay.core.config import load_config
from lsreplay.data.rewards import Reward, RewardError
from lsreplay.data.sources import Prompt
from lsreplay.metrics.records import rollout_metrics

# Verbatim from the docs (TRL's Examples 1.1, 2, 3 and 5; verl's my_reward_fn), then a few
# written as their docs describe them (verl's dict return, TRL's None for other tasks).
TRL_REWARDS = r'''
import asyncio
import functools
import re

def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]

def accuracy_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]

def math_reward_func(prompts, completions, task, **kwargs):
    return [float("4" in c) if t == "math" else None for c, t in zip(completions, task)]

def token_count(completion_ids, trainer_state, **kwargs):
    return [float(len(ids)) + trainer_state.global_step for ids in completion_ids]

def docs_token_count(completions_ids, **kwargs):
    """TRL's docs' Example 1 (TRL's trainer passes completion_ids)."""
    return [float(len(ids)) for ids in completions_ids]

def one_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def nan_for_long(completions, **kwargs):
    return [float("nan") if len(c) > 3 else 0.0 for c in completions]

def no_kwargs(completions):
    return [0.0 for _ in completions]

def my_reward_fn(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str)/100

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = solution_str.split("####")[-1].strip()
    return {"score": float(answer == ground_truth), "acc": answer == ground_truth, "source": data_source,
            "index": extra_info["index"]}

def logging_reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    """TRL's Example 6, verbatim."""
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])

    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards

def curriculum(completions, trainer_state, **kwargs):
    return [trainer_state.global_step / trainer_state.max_steps + trainer_state.num_input_tokens_seen] * len(completions)

def only_math(completions, task, **kwargs):
    return [1.0 if t == "math" else None for t in task]

def scaled_length(completions, scale, **kwargs):
    return [scale * len(c) for c in completions]

half_length = functools.partial(scaled_length, scale=0.5)

class LengthReward:
    def __call__(self, completions, **kwargs):
        return [float(len(c)) for c in completions]

length_reward = LengthReward()

def verl_seen(data_source, solution_str, ground_truth, extra_info, bonus=0.0):
    return {"score": float(solution_str == ground_truth) + bonus, "turns": extra_info["num_turns"],
            "source": data_source, "split": extra_info.get("split", "none")}

def strict_verl(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "styles_15.py").write_text(TRL_REWARDS)
    monkeypatch.chdir(tmp_path)
    return "styles_15"


def reward(*overrides: str) -> Reward:
    return Reward(load_config(None, list(overrides)))


STATE = TrainerState(global_step=3, max_steps=9)


def row(i: int, question, task: str = "math", truth: str = "4") -> Prompt:
    columns = {"ground_truth": truth, "task": task, "data_source": "openai/gsm8k",
               "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": i}}
    return Prompt(index=i, task=task, question=question, answer="", metadata={}, columns=columns)


def test_trl_functions_get_batches_of_keywords_and_are_weighted(module):
    r = reward(f"reward.functions=[{module}.reward_func,{module}:accuracy_func,{module}.async_reward_func,"
               f"{module}.math_reward_func,{module}.token_count]", "reward.weights=[0.5,1,1,2,1]", "steps=9")
    assert [f.style for f in r.functions] == ["trl"] * 5
    prompts = [row(0, "Solve 2 + 2."), row(7, "Write code.", task="code")]
    scores = r.score(prompts, [[r"\boxed{4}", ""], ["abcd"]], [[[1, 2], []], [[5]]], STATE)
    totals, parts = scores.totals, scores.by_function
    assert parts["reward_func"] == [[9.0, 0.0], [4.0]]
    assert parts["accuracy_func"] == [[1.0, 0.0], [0.0]]
    assert parts["async_reward_func"] == [[1.0, 0.0], [1.0]]
    assert parts["math_reward_func"] == [[1.0, 0.0], [None]]  # TRL's None: does not apply to code
    assert parts["token_count"] == [[5.0, 3.0], [4.0]]  # trainer_state.global_step is the step
    assert totals == [[0.5 * 9 + 1 + 1 + 2 + 5, 3.0], [0.5 * 4 + 1 + 4]]


def test_conversational_prompts_get_message_completions(module):
    """TRL's Example 2 on chat prompts: each completion is [{"role": "assistant", "content": ...}]."""
    r = reward(f"reward.functions=[{module}.format_reward_func]")
    prompts = [row(0, [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}])]
    scores = r.score(prompts, [["<think>3 * 4</think><answer>12</answer>", "12"]], [[[1], [2]]], STATE)
    assert scores.totals == [[1.0, 0.0]]


def test_verl_compute_score_gets_ground_truth_from_reward_model(module):
    r = reward(f"reward.functions=[{module}.compute_score,{module}.my_reward_fn]")
    assert [f.style for f in r.functions] == ["verl", "verl"]
    prompts = [row(3, [{"role": "user", "content": "What is 2 + 2?"}])]
    prompts[0].columns.pop("ground_truth")  # verl's rows keep it under reward_model only
    scores = r.score(prompts, [["so #### 4", "#### 5"]], [[[1], [2]]], STATE)
    assert scores.by_function == {"compute_score": [[1.0, 0.0]], "my_reward_fn": [[0.09, 0.06]]}
    assert scores.totals == [[1.09, 0.06]]
    # verl's dict: its other keys are logged per completion (verl's reward_extra_info)
    assert scores.extras == {"acc": [[True, False]], "source": [["openai/gsm8k"] * 2], "index": [[3, 3]]}
    prompts[0].columns.pop("reward_model")  # a row without verl's field: the data.columns.answer one
    answer_column = Reward(load_config(None, [f"reward.functions=[{module}.compute_score]",
                                              "data.columns.answer=extra_info.index"]))
    assert answer_column.score(prompts, [["#### 3"]], [[[1]]], STATE).totals == [[0.0]]  # "3" != 3: the raw value


def test_log_metric_and_log_extra_reach_the_scores_as_trl_logs_them(module):
    """TRL's Example 6: log_extra adds columns of the completions table (one value per
    completion), log_metric a scalar per call (averaged over the step's calls)."""
    r = reward(f"reward.functions=[{module}.logging_reward_func]")
    prompts = [row(0, "Solve 2 + 2.", truth="4"), row(1, "Solve 1 + 2.", truth="3")]
    scores = r.score(prompts, [[r"\boxed{4}", "4"], [r"\boxed{3}"]], [[[1], [2]], [[3]]], STATE)
    assert scores.totals == [[1.0, 0.0], [1.0]]
    assert scores.metrics == {"accuracy": [pytest.approx(2 / 3)]}
    assert scores.extras == {"golden_answer": [["4", "4"], ["3"]], "extracted_answer": [["4", "[none]"], ["3"]]}


def test_trainer_state_is_the_one_given(module):
    r = reward(f"reward.functions=[{module}.curriculum]")
    state = TrainerState(global_step=2, max_steps=8, num_input_tokens_seen=100)
    assert r.score([row(0, "q")], [["a"]], [[[1]]], state).totals == [[100.25]]


def test_a_completion_no_function_applies_to_is_unscorable(module, caplog):
    """TRL >= 1.6: None from every function leaves the completion without a reward (it is
    left out of the baselines and gets advantage 0); one function applying is enough."""
    r = reward(f"reward.functions=[{module}.only_math]")
    prompts = [row(0, "Solve 2 + 2."), row(1, "Write code.", task="code")]
    with caplog.at_level("WARNING", logger="lsreplay.data.rewards"):
        scores = r.score(prompts, [["4", "5"], ["x"]], [[[1], [2]], [[3]]], STATE)
    assert scores.totals == [[1.0, 1.0], [None]] and scores.by_function["only_math"] == [[1.0, 1.0], [None]]
    assert "no reward function applies to a completion of prompt 1" in caplog.text
    both = reward(f"reward.functions=[{module}.only_math,{module}.reward_func]", "reward.weights=[1,0.5]")
    assert both.score(prompts, [["4", "5"], ["x"]], [[[1], [2]], [[3]]], STATE).totals == [[1.5, 1.5], [0.5]]


def test_partials_and_callable_objects_are_named_as_trl_names_them(module):
    r = reward(f"reward.functions=[{module}.half_length,{module}.length_reward]")
    assert [f.name for f in r.functions] == ["scaled_length", "LengthReward"]  # trl's get_callable_name
    assert [f.style for f in r.functions] == ["trl", "trl"]
    assert r.score([row(0, "q")], [["abcd"]], [[[1]]], STATE).by_function == {"scaled_length": [[2.0]],
                                                                             "LengthReward": [[4.0]]}


def test_verl_gets_what_its_reward_manager_passes(module):
    """verl's naive reward manager: ground_truth from reward_model (over an answer column),
    data_source from data.reward_fn_key, extra_info {} when the row has none, with num_turns
    (2: a single turn, as verl's default agent loop records it); custom_reward_function's
    reward_kwargs over them."""
    prompt = row(0, [{"role": "user", "content": "2 + 2?"}], truth="4")
    prompt.columns.update(answer="5", source="mine")
    del prompt.columns["extra_info"]
    r = reward(f"reward.functions=[{module}.verl_seen]", "data.reward_fn_key=source", "reward.kwargs=[{bonus: 0.5}]")
    scores = r.score([prompt], [["4", "5"]], [[[1], [2]]], STATE)
    assert scores.totals == [[1.5, 0.5]]  # reward_model.ground_truth, not the answer column
    assert scores.extras == {"turns": [[2, 2]], "source": [["mine", "mine"]], "split": [["none", "none"]]}
    with pytest.raises(RewardError, match=r"strict_verl\(data_source, solution_str, ground_truth, extra_info=None\) "
                                          r"takes no \['bonus'\] and no \*\*kwargs, but reward.kwargs gives them"):
        reward(f"reward.functions=[{module}.strict_verl]", "reward.kwargs=[{bonus: 1}]")


@pytest.mark.parametrize("function, message", [
    ("docs_token_count", "docs_token_count(completions_ids, **kwargs) needs 'completions_ids', which TRL-style "
                         "functions are not given: they get prompts, completions, completion_ids, trainer_state, "
                         "log_extra, log_metric and the dataset's columns ['answer', 'task']; did you mean "
                         "'completion_ids'?"),
    ("no_kwargs", "no_kwargs(completions) takes no **kwargs, but TRL-style functions are given every dataset column "
                  "as a keyword"),
])
def test_trl_signatures_that_cannot_take_the_keywords_are_named_before_any_work(function, message, module):
    with pytest.raises(RewardError, match=re.escape(message)):
        reward(f"reward.functions=[{module}.{function}]").check_columns(["answer", "task"])


@pytest.mark.parametrize("function, message", [
    ("one_short", "returned 1 values for 2 completions (of prompts 5); TRL-style functions return a list with one "
                  "float (or None) per completion"),
    ("nan_for_long", "returned nan for completion 1 of prompt 5 (row 5 of the prompt file); it must return a finite "
                     "float"),
    ("accuracy_func", "raised KeyError"),
])
def test_bad_batches_name_the_function_and_the_prompt(function, message, module):
    r = reward(f"reward.functions=[{module}.{function}]")
    prompt = row(5, "q")
    if function == "accuracy_func":
        prompt.columns.pop("ground_truth")
        message = "raised TypeError: accuracy_func() missing 1 required positional argument: 'ground_truth' on prompt 5"
    with pytest.raises(RewardError, match=re.escape(f"reward function '{module}.{function}' ") + ".*"
                       + re.escape(message)):
        r.score([prompt], [["abc", "abcd"]], [[[1], [2]]], STATE)


def test_styles_can_be_told_and_bad_styles_are_refused(module):
    with pytest.raises(RewardError, match=r"cannot be called as reward_func\(prompt, completion\) .lsreplay's style."):
        reward(f"reward.functions=[{module}.reward_func]", "reward.styles=[lsreplay]")
    with pytest.raises(Exception, match="reward.styles"):
        reward(f"reward.functions=[{module}.reward_func]", "reward.styles=[hydra]")
    with pytest.raises(Exception, match=r"reward.weights.*one weight per reward function \(1\)"):
        reward(f"reward.functions=[{module}.reward_func]", "reward.weights=[1,2]")


def record(rewards, counts, finished, by_function) -> dict:
    return {"completions": [[1] * (2 + i) for i in range(len(rewards))], "rewards": rewards, "counts": counts,
            "finished": finished, "logprobs": [[-0.5] * (2 + i) for i in range(len(rewards))],
            "reward_functions": by_function}


def test_rollout_metrics_carry_trls_names_and_count_leaves_as_samples():
    records = [record([1.0, 0.0], [3, 1], [True, False], {"f": [1.0, None]}),
               record([0.5, 0.5], [2, 2], [True, True], {"f": [0.0, 1.0]})]
    m = rollout_metrics(records, max_new_tokens=3)
    assert m["frac_reward_zero_std"] == 0.5
    # TRL's reward_std (since 0.27): the std of the batch's rewards, [1, 1, 1, 0, 0.5, 0.5, 0.5, 0.5] (n - 1)
    assert m["reward_std"] == pytest.approx(statistics.stdev([1, 1, 1, 0, 0.5, 0.5, 0.5, 0.5]))
    assert m["completions/mean_length"] == pytest.approx((3 * 2 + 1 * 3 + 2 * 2 + 2 * 3) / 8)
    assert (m["completions/min_length"], m["completions/max_length"]) == (2, 3)
    assert m["completions/mean_terminated_length"] == pytest.approx((3 * 2 + 2 * 2 + 2 * 3) / 7)
    assert m["completions/clipped_ratio"] == pytest.approx(1 / 8)
    assert m["entropy"] == pytest.approx(0.5)
    assert m["rewards/f/mean"] == pytest.approx((3 * 1 + 2 * 0 + 2 * 1) / 7)


def test_clip_fractions_count_the_tokens_the_surrogate_cuts():
    import torch

    old = [[torch.zeros(4)]]
    new = [[torch.log(torch.tensor([0.5, 1.5, 1.0, 1.5]))]]
    assert clip_fractions(old, old, [torch.tensor([1.0])], 0.2)["clip_ratio/region_mean"] == 0
    low = clip_fractions(new, old, [torch.tensor([-1.0])], 0.2)
    high = clip_fractions(new, old, [torch.tensor([1.0])], 0.2)
    assert (low["clip_ratio/low_mean"], low["clip_ratio/high_mean"]) == (0.25, 0.0)
    assert (high["clip_ratio/high_mean"], high["clip_ratio/region_mean"]) == (0.5, 0.5)
    assert json.dumps(high)  # plain floats for metrics.jsonl
    # TRL's clip_ratio/low_min and high_max: the least (most) share of one completion's tokens cut
    two = [[torch.log(torch.tensor([0.5, 0.5, 1.0, 1.0])), torch.log(torch.tensor([0.5, 1.0]))]]
    olds = [[torch.zeros(4), torch.zeros(2)]]
    low = clip_fractions(two, olds, [torch.tensor([-1.0, -1.0])], 0.2)
    assert (low["clip_ratio/low_mean"], low["clip_ratio/low_min"], low["clip_ratio/high_max"]) == (0.5, 0.5, 0.0)
    high = clip_fractions([[torch.log(torch.tensor([1.5, 1.5, 1.0, 1.0])), torch.log(torch.tensor([1.5, 1.5]))]],
                          olds, [torch.tensor([1.0, 1.0])], 0.2)
    assert (high["clip_ratio/high_mean"], high["clip_ratio/high_max"], high["clip_ratio/low_min"]) == (
        4 / 6, 1.0, 0.0)
