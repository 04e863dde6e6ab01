"""Example tools and environments for multi-turn episodes (docs/agents.md): a calculator tool
(configs/agentic-tool.yaml), an environment whose tool takes the final answer and which owns
the reward, TRL's environment_factory shape (configs/agentic-submit.yaml), and an arithmetic
environment that says "wrong, try again" (configs/agentic.yaml)."""

from __future__ import annotations

import ast
import operator

from lsreplay.data.rewards import extract_answer

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.Pow: operator.pow, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
# A bound on exponents, so that a model writing 9**9**9 does not stall the rollouts.
_MAX_EXPONENT = 100


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 5"
    """
    value = _evaluate(ast.parse(expression, mode="eval").body)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def _evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")


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
