"""How an answer is scored: reasoning-gym's checker of the prompt's task (the default), or
your own functions (`reward.functions`), for training and evaluation alike; the reward is
their weighted sum (`reward.weights`). Each function is called in its own style, told by
its parameters (or `reward.styles`):

- TRL's: `f(prompts=, completions=, completion_ids=, trainer_state=, **columns) -> list`,
  once per batch (a rollout shard's trees), every dataset column but the prompt's as a
  keyword holding one value per completion; for chat-message prompts the completions are
  messages too (`[{"role": "assistant", "content": text}]`). `async def` is awaited; None
  says the function does not apply to that completion (it adds nothing to its reward).
- verl's: `compute_score(data_source, solution_str, ground_truth, extra_info) -> float`, or a
  dict with "score", once per completion; `ground_truth` is the field `data.columns.answer`
  names, or verl's `reward_model.ground_truth` where the row has no such field.
- lsreplay's: `function(prompt, completion) -> float` per completion, `prompt` the prompt
  record as a dict (question, answer, task, index: its row, metadata, columns).

A value that is not a finite number (or None, in TRL's style) stops the run naming the
function and the prompt. An answer counts as correct in evaluation when its reward is at
least 1 (`CORRECT`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import math
import numbers
import os
import re
import sys
import threading
from collections.abc import Callable
from difflib import get_close_matches
from pathlib import Path

from lsreplay.core.config import Config, ConfigError, reward_specs
from lsreplay.data.sources import DatasetError, Prompt, lookup, reasoning_gym_tasks

log = logging.getLogger(__name__)

# The reward at and above which an answer counts as correct (reasoning-gym gives 1.0).
CORRECT = 1.0
# Rows of this task carry their own verifiable answer: scored 1 when the extracted answer
# equals it, without reasoning-gym.
EXACT_ANSWER = "exact_answer"


class RewardError(ConfigError):
    """A reward function that cannot be used as given: not importable, the wrong signature,
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
                           "(give your own reward.functions=[module:function] to score other data).")
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


# ---------------------------------------------------------------- your own functions

# What a TRL-style function is given besides the dataset's columns (TRL's GRPOTrainer).
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
# Where verl's datasets keep the reference answer.
VERL_GROUND_TRUTH = "reward_model.ground_truth"


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


def _split(spec: str) -> tuple[str, str]:
    """(module or file, function) of `module:function`, `path/file.py:function` or `module.function`."""
    module, _, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    return module, name


def _import(spec: str, module_name: str):
    if module_name.endswith(".py"):  # verl's custom_reward_function.path
        path = Path(module_name)
        if not path.is_file():
            raise RewardError(f"reward function {spec!r}: no file {path} (relative to the working directory "
                              f"{os.getcwd()})")
        loaded = importlib.util.spec_from_file_location(f"lsreplay_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
        return module
    with _working_directory_importable():
        return importlib.import_module(module_name)


def load_function(spec: str) -> Callable:
    """The function an import path names (module.function, module:function, file.py:function)."""
    module_name, name = _split(spec)
    try:
        module = _import(spec, module_name)
    except RewardError:
        raise
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise RewardError(f"reward function {spec!r}: importing {module_name} failed: {e}") from e
        raise RewardError(f"reward function {spec!r}: no module named {module_name!r}; put {module_name}.py in the "
                          "working directory or on PYTHONPATH (or pip install the package that has it)") from e
    except Exception as e:
        raise RewardError(f"reward function {spec!r}: importing {module_name} raised "
                          f"{type(e).__name__}: {e}") from e
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(f"reward function {spec!r}: {module_name} ({module.__file__}) has no function {name!r}")
    return function


def _parameters(function: Callable) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(function).parameters)
    except ValueError:  # no signature to inspect (some builtins): the first call will tell
        return None


def detect_style(function: Callable) -> str:
    """verl's when it takes solution_str; TRL's when it takes completions, prompts or
    completion_ids, keywords only, or **kwargs and not two positional arguments; else
    lsreplay's (prompt, completion)."""
    params = _parameters(function)
    if params is None:
        return "lsreplay"
    if "solution_str" in params:
        return "verl"
    if set(params) & {"prompts", "completions", "completion_ids"}:
        return "trl"
    try:
        inspect.signature(function).bind({}, "")
    except TypeError:
        return "trl" if any(p.kind == p.VAR_KEYWORD for p in params.values()) or not [
            p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)] else "lsreplay"
    return "lsreplay"


@dataclasses.dataclass
class RewardFunction:
    """One configured reward function: its import path, the name its figures are logged
    under (rewards/NAME/mean), its calling style and weight."""

    spec: str
    name: str
    style: str
    weight: float
    function: Callable

    def describe(self) -> str:
        return f"reward function {self.spec!r}"


def _check_call(rf: RewardFunction) -> None:
    """What can be checked of a signature before the data is known."""
    params = _parameters(rf.function)
    if params is None:
        return
    signature = f"{rf.function.__name__}{inspect.signature(rf.function)}"
    if rf.style == "lsreplay":
        try:
            inspect.signature(rf.function).bind({}, "")
        except TypeError:
            raise RewardError(f"{rf.describe()}: {signature} cannot be called as {rf.function.__name__}(prompt, "
                              "completion) (lsreplay's style); it must take the prompt record (a dict) and the "
                              "completion text, and return a float. TRL's style takes completions=, verl's "
                              "solution_str= (or say reward.styles)") from None
    elif rf.style == "verl":
        kinds = {p.kind for p in params.values()}
        required = [n for n, p in params.items()
                    if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        unknown = [n for n in required if n not in VERL_KEYWORDS]
        if unknown or ("solution_str" not in params and inspect.Parameter.VAR_KEYWORD not in kinds):
            raise RewardError(f"{rf.describe()}: {signature} cannot be called as verl calls compute_score: "
                              f"({', '.join(f'{k}=' for k in VERL_KEYWORDS)}); "
                              + (f"it also needs {unknown}" if unknown else "it takes no solution_str"))
    else:
        positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
        if positional:
            raise RewardError(f"{rf.describe()}: {signature} takes {positional} by position only; TRL-style "
                              f"functions are called with keywords ({', '.join(TRL_KEYWORDS)} and the dataset's "
                              "columns)")


def check_trl_keywords(rf: RewardFunction, columns: list[str]) -> None:
    """A TRL-style function takes every keyword it is given (or **kwargs) and is given every
    one it needs: TRL's own and the dataset's columns (but the prompt's)."""
    params = _parameters(rf.function)
    if params is None or rf.style != "trl":
        return
    given = [*TRL_KEYWORDS, *columns]
    signature = f"{rf.function.__name__}{inspect.signature(rf.function)}"
    for name, p in params.items():
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in given:
            near = get_close_matches(name, given, n=1)
            raise RewardError(f"{rf.describe()}: {signature} needs {name!r}, which TRL-style functions are not given: "
                              f"they get {', '.join(TRL_KEYWORDS)} and the dataset's columns {columns}"
                              + (f"; did you mean {near[0]!r}?" if near else ""))
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        extra = [k for k in given if k not in params]
        if extra:
            raise RewardError(f"{rf.describe()}: {signature} takes no **kwargs, but TRL-style functions are given "
                              f"every dataset column as a keyword ({extra} too); add **kwargs as TRL's do")


def _number(rf: RewardFunction, value, prompt: Prompt, what: str, allow_none: bool) -> float | None:
    """A returned value as a float, or None where the style allows it; else an error naming
    the function and the prompt."""
    if isinstance(value, dict) and rf.style == "verl":  # verl: {"score": ..., other figures}
        if "score" not in value:
            raise RewardError(f"{rf.describe()} returned a dict without 'score' ({sorted(value)}) {what} of prompt "
                              f"{prompt.index}; verl's compute_score returns a float or a dict with 'score'")
        value = value["score"]
    if value is None and allow_none:
        return None
    if not isinstance(value, numbers.Real):  # bools count: True is 1.0
        raise RewardError(f"{rf.describe()} returned {value!r} ({type(value).__name__}) {what} of prompt "
                          f"{prompt.index} (row {prompt.index} of the prompt file); it must return a float"
                          + (" or None" if allow_none else ""))
    if not math.isfinite(value):
        raise RewardError(f"{rf.describe()} returned {value} {what} of prompt {prompt.index} (row {prompt.index} of "
                          "the prompt file); it must return a finite float (a NaN or inf reward would poison the "
                          "update" + ("; None says it does not apply)" if allow_none else ")"))
    return float(value)


def _await_all(pending: dict[int, object]) -> dict[int, object]:
    """Await the coroutines async reward functions returned, together (as TRL gathers them)."""
    async def gather():
        return dict(zip(pending, await asyncio.gather(*pending.values())))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # this thread runs a loop already
        return pool.submit(asyncio.run, gather()).result()


class Reward:
    """The configured reward: `score` gives every completion of a batch of prompts its
    reward (the weighted sum of the functions'), and each function's values."""

    def __init__(self, cfg: Config):
        r = cfg.reward
        specs = reward_specs(r)
        self.task_args, self.steps = dict(cfg.data.task_args), cfg.steps
        self.timeout = r.timeout_seconds
        self.answer_column = cfg.data.columns.answer
        self.functions = []
        for i, spec in enumerate(specs):
            function = load_function(spec)
            style = r.styles[i] if r.styles and r.styles[i] != "auto" else detect_style(function)
            rf = RewardFunction(spec, getattr(function, "__name__", spec), style, r.weights[i] if r.weights else 1.0,
                                function)
            _check_call(rf)
            self.functions.append(rf)
        names = [rf.name for rf in self.functions]
        for rf in self.functions:
            if names.count(rf.name) > 1:  # two modules' reward_func: logged by their paths
                rf.name = rf.spec
        self._warned_inapplicable = False

    @property
    def names(self) -> list[str]:
        """The names each function's figures are logged under; the default reward's is reasoning_gym."""
        return [rf.name for rf in self.functions] or ["reasoning_gym"]

    def check_columns(self, columns: list[str]) -> None:
        """The TRL-style functions take the keywords this dataset gives them (preflight)."""
        for rf in self.functions:
            check_trl_keywords(rf, columns)

    def score(self, prompts: list[Prompt], completions: list[list[str]], completion_ids: list[list[list[int]]],
              step: int) -> tuple[list[list[float]], dict[str, list[list[float | None]]]]:
        """The reward of every completion of every prompt, and each function's value (None
        where it does not apply), both nested as `completions`; a RewardError if the
        functions take longer than reward.timeout_seconds (a function that hangs)."""
        if not self.timeout:
            return self._score(prompts, completions, completion_ids, step)
        try:
            return _within(self.timeout, self._score, prompts, completions, completion_ids, step)
        except TimeoutError:
            names = ", ".join(rf.spec for rf in self.functions) or "reasoning-gym's checkers"
            raise RewardError(f"the reward functions ({names}) did not score the completions of prompts "
                              f"{sorted({p.index for p in prompts})} within reward.timeout_seconds={self.timeout:g}; "
                              "a function that hangs (a network call without a timeout?) stops the run here: fix it, "
                              "or raise reward.timeout_seconds if it is only slow") from None

    def _score(self, prompts: list[Prompt], completions: list[list[str]], completion_ids: list[list[list[int]]],
               step: int) -> tuple[list[list[float]], dict[str, list[list[float | None]]]]:
        if not self.functions:
            values = [[score(p, c, self.task_args.get(p.task)) for c in cs] for p, cs in zip(prompts, completions)]
            return values, {"reasoning_gym": values}
        flat = [(p, c, i) for p, cs, ids in zip(prompts, completions, completion_ids) for c, i in zip(cs, ids)]
        calls = {k: self._call(rf, flat, step) for k, rf in enumerate(self.functions)}
        pending = {k: v for k, v in calls.items() if inspect.isawaitable(v)}
        if pending:
            try:
                calls.update(_await_all(pending))
            except Exception as e:
                raise RewardError(f"an async reward function raised {type(e).__name__}: {e} on the prompts "
                                  f"{sorted({p.index for p, _, _ in flat})}; fix the function") from e
        by_function = {rf.name: self._values(rf, calls[k], flat) for k, rf in enumerate(self.functions)}
        totals = [self._total(flat[j][0], [(rf.weight, by_function[rf.name][j]) for rf in self.functions])
                  for j in range(len(flat))]
        return _nest(totals, completions), {name: _nest(v, completions) for name, v in by_function.items()}

    def _call(self, rf: RewardFunction, flat: list[tuple[Prompt, str, list[int]]], step: int):
        """The function's raw results: one list (TRL) or one value per completion; a
        coroutine stands for what async functions return."""
        if rf.style == "trl":
            return self._guarded(rf, sorted({p.index for p, _, _ in flat}), rf.function,
                                 **self._trl_keywords(flat, step))
        if rf.style == "verl":
            values = [self._guarded(rf, [p.index], rf.function, **self._verl_keywords(rf, p, c)) for p, c, _ in flat]
        else:
            values = [self._guarded(rf, [p.index], rf.function, dataclasses.asdict(p), c) for p, c, _ in flat]
        if any(inspect.isawaitable(v) for v in values):  # an async compute_score: awaited together
            async def gather():
                return list(await asyncio.gather(*values))
            return gather()
        return values

    @staticmethod
    def _guarded(rf: RewardFunction, rows: list[int], function: Callable, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as e:
            raise RewardError(f"{rf.describe()} raised {type(e).__name__}: {e} on prompt{'s' if len(rows) > 1 else ''} "
                              f"{', '.join(map(str, rows))} (row{'s' if len(rows) > 1 else ''} of the prompt file); "
                              "fix the function") from e

    def _trl_keywords(self, flat: list[tuple[Prompt, str, list[int]]], step: int) -> dict:
        from transformers import TrainerState

        columns = list(flat[0][0].columns)
        return {"prompts": [p.question for p, _, _ in flat],
                "completions": [c if isinstance(p.question, str) else [{"role": "assistant", "content": c}]
                                for p, c, _ in flat],
                "completion_ids": [list(i) for _, _, i in flat],
                "trainer_state": TrainerState(global_step=step, max_steps=self.steps),
                **{k: [p.columns.get(k) for p, _, _ in flat] for k in columns}}

    def _verl_keywords(self, rf: RewardFunction, prompt: Prompt, completion: str) -> dict:
        truth = lookup(prompt.columns, self.answer_column)
        values = {"data_source": prompt.columns.get("data_source"), "solution_str": completion,
                  "ground_truth": lookup(prompt.columns, VERL_GROUND_TRUTH) if truth is None else truth,
                  "extra_info": prompt.columns.get("extra_info")}
        params = _parameters(rf.function)
        if params is None or any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return values
        return {k: v for k, v in values.items() if k in params}

    def _values(self, rf: RewardFunction, result, flat) -> list[float | None]:
        if rf.style == "trl":
            if not isinstance(result, (list, tuple)) or len(result) != len(flat):
                rows = sorted({p.index for p, _, _ in flat})
                got = f"{len(result)} values" if isinstance(result, (list, tuple)) else repr(result)[:80]
                raise RewardError(f"{rf.describe()} returned {got} for {len(flat)} completions (of prompts "
                                  f"{', '.join(map(str, rows))}); TRL-style functions return a list with one float "
                                  "(or None) per completion")
        return [_number(rf, v, p, f"for completion {j}", allow_none=rf.style == "trl")
                for j, (v, (p, _, _)) in enumerate(zip(result, flat))]

    def _total(self, prompt: Prompt, weighted: list[tuple[float, float | None]]) -> float:
        applicable = [w * v for w, v in weighted if v is not None]
        if not applicable and not self._warned_inapplicable:  # TRL's: a reward of 0, with a warning
            self._warned_inapplicable = True
            log.warning("no reward function applies to a completion of prompt %d (every one returned None); "
                        "it gets reward 0", prompt.index)
        return sum(applicable)


def _within(seconds: float, fn: Callable, *args):
    """fn(*args) on a thread of its own, given `seconds`: its result or error, or TimeoutError.
    A thread cannot be stopped: one that hangs stays behind, a daemon (it does not keep the
    process from exiting); the stage that waited for it goes on to fail."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    worker = threading.Thread(target=contextvars.copy_context().run, args=(target,), daemon=True, name="reward")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"not done within {seconds} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _nest(flat: list, like: list[list]) -> list[list]:
    out, start = [], 0
    for group in like:
        out.append(flat[start:start + len(group)])
        start += len(group)
    return out
