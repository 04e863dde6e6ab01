"""reasoning-gym's checkers, with what others wrote kept as data.

Some of reasoning-gym's (0.1.25) checkers evaluate text as code: Python's eval, or sympy's
parse_expr, which is eval underneath (its namespace holds every builtin function). Text from
a prompt row (a downloaded prompt file) or from the model would run there. So:

- A row of a task whose checker evaluates the row (EVALUATES_ROW) is scored only with the
  entry lsreplay generated itself: generated again from the generation's request (data.tasks,
  data.size, the seed, data.task_args) and the row's metadata.source_index, and equal to the
  row's question and answer. Any other row is refused before any work (`check_rows`), naming
  the task and the fix (reward.functions of your own).
- Every checker that evaluates the row or the model's answer (SANDBOXED) runs in a child
  process (lsreplay.core.sandbox) with CPU, memory and wall limits (sandbox.*), where the
  names it evaluates with stand for bounded readers (lsreplay.data.hardened_checkers):
  Python literals for eval, sized arithmetic for bitwise_arithmetic's eval, and for
  parse_expr only numbers, + - * / **, elementary functions and plain names, every number
  sized first (lsreplay.data.expressions). An answer the child refuses, fails on, or does
  not score in sandbox.checker_seconds scores 0 (logged once per task).

The other checkers compare strings and numbers, and run in this process.
"""

from __future__ import annotations

import json
import logging

from lsreplay.core.config import Config
from lsreplay.core.sandbox import Overrun, SandboxError, child, limits_of
from lsreplay.data.sources import DatasetError, Prompt, generated_row

log = logging.getLogger(__name__)

# Checkers that evaluate the row they are given, and what they evaluate.
EVALUATES_ROW = {
    "bitwise_arithmetic": "eval(metadata['problem'])",
    "simple_integration": "sympy.parse_expr(metadata['integrand'])",
    "intermediate_integration": "sympy.parse_expr(metadata['integrand'])",
    "polynomial_multiplication": "sympy.parse_expr(answer), the row's answer",
    "number_sorting": "eval(answer), the row's answer (not JSON as reasoning-gym writes it)",
    "composite": "the checker its row's metadata.source_dataset names, any of these",
}
# Checkers that evaluate the model's answer, and how.
EVALUATES_ANSWER = {
    "string_insertion": "eval(answer), to read a list",
    "spiral_matrix": "eval(answer), to read a list",
    "binary_matrix": "eval(answer), to read a list of lists",
    "n_queens": "eval(answer), to read a board",
    "simple_integration": "sympy.parse_expr(answer)",
    "intermediate_integration": "sympy.parse_expr(answer)",
    "polynomial_multiplication": "sympy.parse_expr(answer)",
    "countdown": "sympy's parse_expr(answer)",
    "puzzle24": "sympy's parse_expr(answer)",
    "composite": "the checker its row's metadata.source_dataset names, any of these",
}
SANDBOXED = frozenset(EVALUATES_ROW) | frozenset(EVALUATES_ANSWER)


class Checking:
    """Scores answers to prompts of SANDBOXED tasks for a run (see the module's docstring)."""

    def __init__(self, cfg: Config):
        d, s = cfg.data, cfg.sandbox
        self.request = (list(d.tasks), d.size, cfg.seed, dict(d.task_args))
        self.seconds, self.child = s.checker_seconds, child("reasoning-gym", limits_of(s))
        self._warned: set[str] = set()

    def entry(self, prompt: Prompt) -> dict:
        """The entry a row of a SANDBOXED task is scored with: what lsreplay generated for it,
        or the row itself where its checker evaluates only the answer; DatasetError naming the
        task and the fix for a row lsreplay did not generate."""
        row = {"question": prompt.question, "answer": prompt.answer, "metadata": prompt.metadata}
        if prompt.task not in EVALUATES_ROW:
            return row
        index = prompt.metadata.get("source_index")
        try:
            if not isinstance(index, int):
                raise DatasetError("it has no metadata.source_index")
            generated = generated_row(*self.request, prompt.task, index)
        except DatasetError as e:
            raise self._refused(prompt, str(e)) from None
        if (generated["question"], generated["answer"]) != (prompt.question, prompt.answer):
            raise self._refused(prompt, f"its question or answer is not the one generated for row {index} of the task")
        return {**generated, "metadata": json.loads(generated["metadata"])}

    def _refused(self, prompt: Prompt, why: str) -> DatasetError:
        tasks, size, seed, _ = self.request
        return DatasetError(
            f"row {prompt.index} of task {prompt.task!r}: its checker evaluates the row as code "
            f"({EVALUATES_ROW[prompt.task]}), so lsreplay scores it only as it generated it itself, and {why} (lsreplay "
            f"generates from data.tasks={tasks}, data.size={size}, seed={seed}, data.task_args). Leave data.path empty "
            f"with data.tasks=[{prompt.task}] for prompts lsreplay generates, or score these rows with "
            "reward.functions=[module:function] of your own")

    def score(self, prompt: Prompt, answer: str, task_args: dict | None) -> float:
        """reasoning-gym's checker's score of `answer`, in the child process; 0 where the
        child refuses the answer, fails, or does not score it within sandbox.checker_seconds."""
        args = json.dumps(task_args or {}, sort_keys=True)
        try:
            self.child.prepare("lsreplay.data.hardened_checkers:harden")  # at its start: the calls' time is theirs
            value = self.child.call("lsreplay.data.hardened_checkers:score_in_child", prompt.task, args, answer,
                                    self.entry(prompt), seconds=self.seconds)
        except (Overrun, SandboxError) as e:
            if prompt.task not in self._warned:  # a bad answer must not stop training; real bugs still show
                self._warned.add(prompt.task)
                log.warning("the checker of %s did not score an answer of prompt %d (%s); scoring 0", prompt.task,
                            prompt.index, e)
            return 0.0
        return min(1.0, max(0.0, float(value)))


def check_rows(cfg: Config, prompts) -> None:
    """Every row of a task in EVALUATES_ROW among `prompts` (a PromptSet) is one lsreplay
    generated (`Checking.entry`); DatasetError naming the first that is not."""
    checking = Checking(cfg)
    for i, task in enumerate(prompts.column("task")):
        if task in EVALUATES_ROW:
            checking.entry(prompts[i])
