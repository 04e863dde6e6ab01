"""Your own reward function (reward.function=module:function): found next to the config,
used for training rollouts, and every way it can be wrong named before or when it bites."""

from __future__ import annotations

import json
import math
import re

import pytest
from transformers import TrainerState

from lsreplay.core.config import load_config
from lsreplay.data.rewards import Reward, RewardError
from lsreplay.data.sources import Prompt

REWARDS = '''
import math

def exact(prompt, completion):
    return float(completion.strip() == prompt["answer"])

def by_difficulty(prompt, completion):
    return prompt["metadata"]["difficulty"] + 0.5

def digit_sum_even(prompt, completion):  # varies from rollout to rollout of a random model
    return float(sum(int(c) for c in completion if c.isdigit()) % 2 == 0)

def one_argument(prompt):
    return 1.0

def not_a_number(prompt, completion):
    return "1.0"

def nan(prompt, completion):
    return math.nan

def boom(prompt, completion):
    raise KeyError("solution")
'''

PROMPT = Prompt(index=4, task="", question="What is 2 + 2?", answer="4", metadata={"difficulty": 2})


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A module in the working directory, as a user keeps one next to their config."""
    (tmp_path / "my_rewards_15.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    return "my_rewards_15"


def reward(function: str) -> Reward:
    return Reward(load_config(None, [f"reward.function={function}"]))


def one(reward: Reward, prompt: Prompt, completion: str) -> float:
    """The reward of one completion (its token ids do not matter to lsreplay-style functions)."""
    return reward.score([prompt], [[completion]], [[[]]], TrainerState()).totals[0][0]


def test_own_function_gets_the_prompt_record_and_the_text(reward_module):
    assert one(reward(f"{reward_module}:exact"), PROMPT, " 4\n") == 1.0
    assert one(reward(f"{reward_module}:exact"), PROMPT, "5") == 0.0
    assert one(reward(f"{reward_module}:by_difficulty"), PROMPT, "") == 2.5


@pytest.mark.parametrize("function, message", [
    ("no_such_module_15:f", "no module named 'no_such_module_15'; put no_such_module_15.py in the working directory"),
    ("{m}:missing", "has no function 'missing'"),
    ("{m}:one_argument", "one_argument(prompt) cannot be called as one_argument(prompt, completion)"),
])
def test_unusable_function_is_named_before_any_work(function, message, reward_module):
    with pytest.raises(RewardError, match=re.escape(message)):
        reward(function.format(m=reward_module))


@pytest.mark.parametrize("function, message", [
    ("not_a_number", "returned '1.0' (str) for completion 0 of prompt 4 (row 4 of the prompt file); it must "
                     "return a float"),
    ("nan", "returned nan for completion 0 of prompt 4 (row 4 of the prompt file); it must return a finite float"),
    ("boom", "raised KeyError: 'solution' on prompt 4"),
])
def test_bad_return_stops_with_the_function_and_prompt(function, message, reward_module):
    with pytest.raises(RewardError, match=re.escape(message)):
        one(reward(f"{reward_module}:{function}"), PROMPT, "4")


def test_rollouts_are_scored_by_the_own_function(reward_module, tiny_model_dir, tmp_path):
    """The trees stage scores with the configured function, on prompts of one's own file
    whose task column names no reasoning-gym task."""
    from lsreplay import stages
    from lsreplay.core.run import Run
    from lsreplay.stages.preflight import preflight

    rows = tmp_path / "own.jsonl"
    rows.write_text("".join(json.dumps({"q": f"Say {i}.", "kind": "echo"}) + "\n" for i in range(4)))
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", f"data.path={rows}",
                             "data.columns.question=q", "data.columns.task=kind", "data.prompts_per_step=2",
                             "rollout.branching=[4]", "rollout.segment_tokens=[]", "rollout.max_new_tokens=6",
                             f"reward.function={reward_module}:digit_sum_even"])
    run = preflight(cfg)
    stages.sample_prompts(run, 0)
    trees = json.loads(Run(cfg).store.read_bytes(stages.generate_trees(run, 0)["files"][0]["key"]))["trees"]
    for tree in trees:
        assert tree["rewards"] == [float(sum(int(c) for c in t if c.isdigit()) % 2 == 0) for t in tree["texts"]]
    assert not all(math.isclose(r, trees[0]["rewards"][0]) for t in trees for r in t["rewards"])
