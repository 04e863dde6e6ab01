"""TRL's environment_factory contract through a real trees stage and training step on the
tiny model: TRL's documented shape (a dataset with only a `prompt` column, an environment
whose get_reward() is the only reward) runs unchanged; a Game2048-style environment that
draws at random after every move trains on exactly the observations the model saw, read by a
TRL reward_func(prompts, completions, environments, **kwargs) that gets the reset string in
its prompts; and every instance is closed."""

from __future__ import annotations

import json
import random

import pytest
from test_episode_flow import one_step, overrides, tool_calling_model_dir  # noqa: F401 - a fixture

from lsreplay import stages
from lsreplay.core.config import load_config
from lsreplay.stages.common import load_trees
from lsreplay.stages.preflight import preflight


class IncrementEnv:
    """TRL's documented example (docs/source/grpo_trainer.md, "Environments"), unchanged."""

    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; receives sampled row fields as kwargs (e.g., `prompt`)
        self.counter = 0
        return "Counter reset to 0.\n"

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


@pytest.fixture
def prompt_only_dataset(tmp_path):
    """TRL's documented dataset: a `prompt` column of conversations, nothing else."""
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(1, 9):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"Increment the counter by {i}."}]}) + "\n")
    return path


def test_trls_documented_environment_shape_runs_unchanged(tool_calling_model_dir, prompt_only_dataset,  # noqa: F811
                                                          tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={tool_calling_model_dir}",
                             f"data.path={prompt_only_dataset}", "data.prompts_per_step=2", "rollout.max_new_tokens=8",
                             "drafter.enabled=false", "eval.every=0", "rollout.max_turns=2", "rollout.branching=[2]",
                             "rollout.segment_tokens=[]", "rollout.environment=test_trl_environments.IncrementEnv"])
    run, records, metrics = one_step(cfg)
    assert all(r["reward_functions"].keys() == {"environment"} for r in records)
    assert all(v == 0.0 for r in records for v in r["rewards"])  # the model calls no `increment`: the counter stays 0
    assert "rewards/environment/mean" in metrics and metrics["grad_norm"] == 0  # all alike: nothing trains


CLOSED: list[int] = []  # the ids of the instances closed, in order


class RandomTiles:
    """Game2048-style: every move draws a random tile (unseeded, as TRL's example does), and the
    observation is the board. The model's only call is `calculator` (the tool-calling tiny
    model's), here a move."""

    def reset(self, **kwargs) -> str:
        self.board, self.seen = [], []
        return " Play."

    def calculator(self, expression: str) -> str:
        """Play one move.

        Args:
            expression: the move
        """
        self.board.append(random.choice([2, 4, 8, 16, 32, 64]))
        observation = f"board={self.board}"
        self.seen.append(observation)
        return observation

    def close(self) -> None:
        CLOSED.append(id(self))


def saw_what_it_played(prompts, completions, environments, **kwargs) -> list[float]:
    """TRL's reward_func(prompts, completions, environments, **kwargs): 1 where the episode's
    tool messages are exactly its environment's observations and the prompt ends with the
    reset string."""
    return [float([m["content"] for m in c if m["role"] == "tool"] == env.seen
                  and (p if isinstance(p, str) else p[-1]["content"]).endswith(" Play."))
            for p, c, env in zip(prompts, completions, environments)]


def test_a_random_environment_trains_on_what_the_model_saw_and_every_instance_closes(
        tool_calling_model_dir, tmp_path):  # noqa: F811
    cfg = load_config(None, [*overrides(tmp_path / "run", tool_calling_model_dir), "rollout.branching=[3,2]",
                             "rollout.branch_at=turns", "rollout.segment_tokens=[]", "rollout.max_turns=3",
                             "rollout.environment=test_trl_environments.RandomTiles",
                             "reward.function=test_trl_environments:saw_what_it_played"])
    run = preflight(cfg)
    CLOSED.clear()
    for stage in (stages.sample_prompts, stages.generate_trees):
        stage(run, 0)
    records = load_trees(run, 0)[0]
    assert all(v == 1.0 for r in records for v in r["reward_functions"]["saw_what_it_played"])
    tiles = {r["texts"][leaf] for r in records for leaf in range(len(r["texts"]))}
    assert len(tiles) > 1  # the branches drew differently after their shared moves
    # Every episode's instance (a fork, or its parent's at the last branch) closed, once.
    assert len(CLOSED) == len(set(CLOSED)) == sum(len(r["completions"]) for r in records)
