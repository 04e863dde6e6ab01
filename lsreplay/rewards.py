"""How an answer is scored: reasoning-gym's checker of the prompt's task (the default), or
your own function (`reward.function = "module:function"`), for training and evaluation alike.

Your function is called as `function(prompt, completion)`: `prompt` is the prompt record, a
dict with `question`, `answer`, `task`, `index` (its row in the file) and `metadata` (the
file's `metadata` column and every column not mapped by `data.columns`), `completion` the
answer's text. It returns a finite float; an answer counts as correct in evaluation when
its reward is at least 1 (`CORRECT`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import logging
import math
import numbers
import os
import re
import sys
from collections.abc import Callable

from lsreplay.config import Config, ConfigError
from lsreplay.data import DatasetError, Prompt, reasoning_gym_tasks

log = logging.getLogger(__name__)

# The reward at and above which an answer counts as correct (reasoning-gym gives 1.0).
CORRECT = 1.0
# Rows of this task carry their own verifiable answer: scored 1 when the extracted answer
# equals it, without reasoning-gym.
EXACT_ANSWER = "exact_answer"


class RewardError(ConfigError):
    """A reward.function that cannot be used as given: not importable, the wrong signature,
    or a return that is not a finite number."""


# ---------------------------------------------------------------- reasoning-gym

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# A number, allowing thousands separators; a minus counts only when it is not the
# subtraction in "3-4" (no digit right before it).
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_answer(completion: str) -> str | None:
    """The final answer in a completion: the last non-empty <answer> tag, else the last
    number (so a small model that ends with "= 12" still gets scored), else None."""
    tagged = [m.strip() for m in _ANSWER_TAG.findall(completion)]
    tagged = [t for t in tagged if t]
    if tagged:
        return tagged[-1]
    numbers_found = _NUMBER.findall(completion)
    return numbers_found[-1].replace(",", "") if numbers_found else None


@functools.lru_cache(maxsize=None)
def _checker(task: str, args_json: str):
    # size=1 keeps construction cheap (some generators precompute per-row state); the
    # seed does not affect checking. Four checkers (decimal_arithmetic, puzzle24,
    # polynomial_equations, time_intervals) read their config, hence args_json.
    if task not in reasoning_gym_tasks():  # a DatasetError saying so where reasoning-gym is missing
        raise DatasetError(f"prompt task {task!r} is not a reasoning-gym task; cannot score it "
                           "(give your own reward.function=module:function to score other data).")
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0, **json.loads(args_json))


def unscorable_tasks(tasks: set[str]) -> list[str]:
    """Those of `tasks` the default reward cannot score: neither exact answers nor
    reasoning-gym's. reasoning-gym is imported only when a task other than exact answers
    asks for it, so that a prompt file of exact answers needs none (the GPU check's)."""
    others = set(tasks) - {EXACT_ANSWER}
    return sorted(others - set(reasoning_gym_tasks())) if others else []


_warned_tasks: set[str] = set()


def score(prompt: Prompt, completion: str, task_args: dict | None = None) -> float:
    """Reward in [0, 1] from reasoning-gym's own checker for `prompt.task` (exact match for
    EXACT_ANSWER rows).

    Pass the `task_args` the prompt was generated with when the task's checker depends
    on its config (see `_checker`); the others ignore it.
    """
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    if prompt.task == EXACT_ANSWER:
        return float(answer.strip() == prompt.answer.strip())
    checker = _checker(prompt.task, json.dumps(task_args or {}, sort_keys=True))
    entry = {"question": prompt.question, "answer": prompt.answer, "metadata": prompt.metadata}
    try:
        reward = float(checker.score_answer(answer=answer, entry=entry))
    except Exception:
        # Some checkers raise on malformed model output instead of returning 0; a bad
        # completion must not stop training. Warn once per task so real bugs still show.
        if prompt.task not in _warned_tasks:
            _warned_tasks.add(prompt.task)
            log.warning("checker for %s raised on an answer; scoring 0", prompt.task, exc_info=True)
        return 0.0
    return min(1.0, max(0.0, reward))


# ---------------------------------------------------------------- your own function


@contextlib.contextmanager
def _working_directory_importable():
    """The `lsreplay` command does not put the working directory on sys.path; a reward
    module next to the config should still import."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def load_function(spec: str) -> Callable:
    """The function `module:function` names, checked to take (prompt, completion)."""
    module_name, _, name = spec.partition(":")
    try:
        with _working_directory_importable():
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise RewardError(f"reward.function={spec!r}: importing {module_name} failed: {e}") from e
        raise RewardError(f"reward.function={spec!r}: no module named {module_name!r}; put {module_name}.py in the "
                          "working directory or on PYTHONPATH (or pip install the package that has it)") from e
    except Exception as e:
        raise RewardError(f"reward.function={spec!r}: importing {module_name} raised "
                          f"{type(e).__name__}: {e}") from e
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(f"reward.function={spec!r}: {module_name} ({module.__file__}) has no function {name!r}")
    try:
        inspect.signature(function).bind({}, "")
    except TypeError:
        raise RewardError(f"reward.function={spec!r}: {name}{inspect.signature(function)} cannot be called as "
                          f"{name}(prompt, completion); it must take the prompt record (a dict) and the "
                          "completion text, and return a float") from None
    except ValueError:  # no signature to inspect (some builtins): the first call will tell
        pass
    return function


class Reward:
    """The configured reward: reward(prompt, completion_text) -> float."""

    def __init__(self, cfg: Config):
        self.spec = cfg.reward.function
        self.function = load_function(self.spec) if self.spec else None
        self.task_args = dict(cfg.data.task_args)

    def __call__(self, prompt: Prompt, completion: str) -> float:
        if self.function is None:
            return score(prompt, completion, self.task_args.get(prompt.task))
        try:
            value = self.function(dataclasses.asdict(prompt), completion)
        except Exception as e:
            raise RewardError(f"reward.function={self.spec!r} raised {type(e).__name__}: {e} on prompt "
                              f"{prompt.index} (row {prompt.index} of the prompt file); fix the function") from e
        if not isinstance(value, numbers.Real):  # bools count: True is 1.0
            raise RewardError(f"reward.function={self.spec!r} returned {value!r} ({type(value).__name__}) on "
                              f"prompt {prompt.index}; it must return a float")
        if not math.isfinite(value):
            raise RewardError(f"reward.function={self.spec!r} returned {value} on prompt {prompt.index}; it must "
                              "return a finite float (a NaN or inf reward would poison the update)")
        return float(value)
