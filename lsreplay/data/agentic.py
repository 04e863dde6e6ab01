"""Example tools and environments for multi-turn episodes (docs/agents.md): a calculator tool
(configs/agentic-tool.yaml), an environment whose tool takes the final answer and which owns
the reward, TRL's environment_factory shape (configs/agentic-submit.yaml), and an arithmetic
environment that says "wrong, try again" (configs/agentic.yaml)."""

from __future__ import annotations

from lsreplay.data.expressions import arithmetic
from lsreplay.data.rewards import extract_answer


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 5"
    """
    # Every integer it makes is sized first (lsreplay.data.expressions): a model writing
    # 9**9**9 gets an error back at once, instead of stalling the rollouts.
    value = arithmetic(expression)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def _correct(text: str, answer: str) -> bool:
    found = extract_answer(text)
    try:
        return found is not None and abs(float(found) - float(answer)) < 1e-6
    except ValueError:
        return found is not None and found.strip() == answer.strip()


class ArithmeticFeedback:
    """An environment that answers in words: after each reply it checks the final answer
    against the row's; a wrong one gets "Wrong, try again." (up to rollout.max_turns
    replies), a right one ends the episode. Its reward: 1 / the replies it took, 0 if none
    was right."""

    RETRY = "Wrong, try again."

    def reset(self, answer: str, **row) -> str:
        self.answer, self.replies, self.solved_at = str(answer), 0, None
        return " If your answer is wrong, you will be told and may try again."

    def respond(self, messages: list[dict]) -> str | None:
        self.replies += 1
        if _correct(messages[-1]["content"], self.answer):
            self.solved_at = self.replies
            return None
        return self.RETRY

    def get_reward(self) -> float:
        return 0.0 if self.solved_at is None else 1.0 / self.solved_at


class SubmitAnswer:
    """TRL's environment_factory shape: the model submits its final answer with the
    environment's `submit` tool, and the environment owns the reward (get_reward: 1 for a right
    answer, 0 for a wrong one or none)."""

    def reset(self, answer: str, **row) -> str:
        self.answer, self.submitted = str(answer), None
        return " Submit your final answer with the submit tool."

    def submit(self, answer: str) -> str:
        """Submit your final answer; only the first submission counts.

        Args:
            answer: the final answer, a number
        """
        if self.submitted is not None:
            return "An answer was submitted already."
        self.submitted = answer
        return "Submitted."

    def get_reward(self) -> float:
        return float(self.submitted is not None and _correct(f"<answer>{self.submitted}</answer>", self.answer))
