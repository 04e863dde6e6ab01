"""How an answer is scored: reasoning-gym's checker of the prompt's task (the default), or
your own reward functions and reward models (`reward.functions`), for training and
evaluation alike; the reward is their weighted sum (`reward.weights`), as in TRL.

Each function is called in its own style (lsreplay.data.reward_functions: TRL's batched
keywords with log_metric and log_extra, verl's compute_score, lsreplay's function(prompt,
completion)); a folder or model id is a reward model (lsreplay.data.reward_models). A
completion no function applies to (every one returned None) is unscorable, as in TRL >= 1.6:
its reward is None, it is left out of the baselines and the reward figures and gets
advantage 0. A value that is not a finite number (or None, in TRL's style) stops the run
naming the function and the prompt. An answer counts as correct in evaluation when its
reward is at least 1 (`CORRECT`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import inspect
import json
import logging
import math
import numbers
import re
import threading
from collections.abc import Callable

from lsreplay.core.config import Config, is_reward_model, reward_specs
from lsreplay.core.sandbox import Overdue, limits_of
from lsreplay.data.checkers import SANDBOXED, Checking
from lsreplay.data.hardened_checkers import checker as checker_of
from lsreplay.data.reward_functions import (RewardError, RewardFunction, CallLog, callable_name, check_call,
                                            check_trl_keywords, detect_style, load_function, trl_keywords,
                                            verl_keywords)
from lsreplay.data.reward_models import RewardModel
from lsreplay.data.long_context import TASKS as LONG_CONTEXT_TASKS
from lsreplay.data.sources import DatasetError, Prompt, reasoning_gym_tasks
from lsreplay.data.untrusted import UntrustedFunction, untrusted_function

log = logging.getLogger(__name__)

# The reward at and above which an answer counts as correct (reasoning-gym gives 1.0).
CORRECT = 1.0
# Rows of this task carry their own verifiable answer: scored 1 when the extracted answer
# equals it, without reasoning-gym.
EXACT_ANSWER = "exact_answer"
# Tasks scored so: exact answers, and lsreplay's long-context task (lsreplay.data.long_context).
EXACT_TASKS = (EXACT_ANSWER, *LONG_CONTEXT_TASKS)
# The name the default reward's figures are logged under (rewards/reasoning_gym/mean).
DEFAULT_NAME = "reasoning_gym"
# The name an episode environment's get_reward() is logged under (rewards/environment/mean).
ENVIRONMENT_NAME = "environment"

__all__ = ["CORRECT", "ENVIRONMENT_NAME", "EXACT_ANSWER", "Overdue", "Reward", "RewardError", "Scores", "await_all",
           "extract_answer", "score", "unscorable_tasks", "within"]


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


def unscorable_tasks(tasks: set[str]) -> list[str]:
    """Those of `tasks` the default reward cannot score: neither exact answers (EXACT_TASKS)
    nor reasoning-gym's. reasoning-gym is imported only when another task asks for it, so
    that a prompt file of exact answers needs none (the GPU check's)."""
    others = set(tasks) - set(EXACT_TASKS)
    return sorted(others - set(reasoning_gym_tasks())) if others else []


_warned_tasks: set[str] = set()


def score(prompt: Prompt, completion: str, task_args: dict | None = None, checking: Checking | None = None) -> float:
    """Reward in [0, 1] from reasoning-gym's own checker for `prompt.task` (exact match for
    the rows of EXACT_TASKS).

    Pass the `task_args` the prompt was generated with when the task's checker depends
    on its config (see lsreplay.data.hardened_checkers.checker); the others ignore it. A task whose
    checker evaluates text (lsreplay.data.checkers.SANDBOXED) is scored by `checking`, in a
    child process.
    """
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    if prompt.task in EXACT_TASKS:
        return float(answer.strip() == prompt.answer.strip())
    if prompt.task not in reasoning_gym_tasks():  # a DatasetError saying so where reasoning-gym is missing
        raise DatasetError(f"prompt task {prompt.task!r} is not a reasoning-gym task; cannot score it "
                           "(give your own reward.functions=[module:function] to score other data).")
    if prompt.task in SANDBOXED:
        if checking is None:
            raise DatasetError(f"task {prompt.task!r}'s checker evaluates text: it is scored in a child process, "
                               "through lsreplay.data.rewards.Reward (or give a Checking)")
        return checking.score(prompt, answer, task_args)
    checker = checker_of(prompt.task, json.dumps(task_args or {}, sort_keys=True))
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


# ---------------------------------------------------------------- the run's reward


@dataclasses.dataclass
class Scores:
    """A batch's rewards, each nested as its completions (per prompt, per completion)."""

    totals: list[list[float | None]]  # the weighted sum; None: no function applies (unscorable)
    by_function: dict[str, list[list[float | None]]]  # each function's value, None where it does not apply
    extras: dict[str, list[list]]  # per-completion columns: TRL's log_extra, verl's dict keys
    metrics: dict[str, list[float]]  # what the functions gave log_metric, one value per call


def _number(rf: RewardFunction, value, prompt: Prompt, what: str, allow_none: bool) -> float | None:
    """A returned value as a float, or None where the style allows it; else an error naming
    the function and the prompt."""
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


def await_all(pending: dict[int, object]) -> dict[int, object]:
    """Await the coroutines async reward functions (or tools) returned, together (as TRL gathers
    them), also from a thread that runs an event loop already."""
    async def gather():
        return dict(zip(pending, await asyncio.gather(*pending.values())))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # this thread runs a loop already
        return pool.submit(asyncio.run, gather()).result()


def _function(cfg: Config, i: int, spec: str, device) -> RewardFunction:
    """The i-th configured reward function: a reward model, or a callable in its style."""
    r = cfg.reward
    weight, kwargs = r.weights[i] if r.weights else 1.0, dict(r.kwargs[i]) if r.kwargs else {}
    if is_reward_model(spec):
        if kwargs:
            raise RewardError(f"reward model {spec!r} takes no keywords; leave its reward.kwargs entry empty ({{}})")
        model = RewardModel(spec, device, cfg.data.chat_template_kwargs)
        return RewardFunction(spec, model.name, "model", weight, model)
    function = untrusted_function(spec, "reward function", limits_of(cfg.sandbox), r.timeout_seconds) \
        if r.untrusted else load_function(spec)
    style = r.styles[i] if r.styles and r.styles[i] != "auto" else detect_style(function)
    rf = RewardFunction(spec, callable_name(function), style, weight, function, kwargs)
    check_call(rf)
    return rf


class Reward:
    """The configured reward: `score` gives every completion of a batch of prompts its
    reward (the weighted sum of the functions'), each function's values, and what the
    functions logged. `device`: where reward models score."""

    def __init__(self, cfg: Config, device="cpu"):
        self.task_args = dict(cfg.data.task_args)
        self.answer_column, self.source_column = cfg.data.columns.answer, cfg.data.reward_fn_key
        self.timeout = cfg.reward.timeout_seconds
        self.checking = Checking(cfg)
        self.functions = [_function(cfg, i, spec, device) for i, spec in enumerate(reward_specs(cfg.reward))]
        names = [rf.name for rf in self.functions]
        for rf in self.functions:
            if names.count(rf.name) > 1:  # two modules' reward_func: logged by their paths
                rf.name = rf.spec
        self._warned_unscorable = False

    @property
    def names(self) -> list[str]:
        """The names each function's figures are logged under; the default reward's is reasoning_gym."""
        return [rf.name for rf in self.functions] or [DEFAULT_NAME]

    def check_columns(self, columns: list[str], environments: bool = False) -> None:
        """The TRL-style functions take the keywords this dataset gives them, and `environments`
        where the rollouts have an environment (preflight)."""
        for rf in self.functions:
            check_trl_keywords(rf, columns, environments)

    def score(self, prompts: list[Prompt], completions: list[list[str]], completion_ids: list[list[list[int]]],
              state, messages: list[list[list[dict]]] | None = None,
              environment: list[list[float | None]] | None = None, environments: list[list] | None = None) -> Scores:
        """Every completion of every prompt scored; `state` is the transformers.TrainerState
        TRL-style functions get as trainer_state (lsreplay.stages.trainer_state). Episodes give
        their `messages` (TRL-style functions get them as completions), their environments'
        instances (TRL-style functions' `environments`) and, where the environment scores
        them, its rewards (None: none): one more reward of weight 1 (rewards/environment), and
        the only one when reward.functions is empty (no default checker then). A RewardError
        if the functions take longer than reward.timeout_seconds (a function that hangs)."""
        args = (prompts, completions, completion_ids, state, messages, environment, environments)
        for rf in self.functions:
            if isinstance(rf.function, UntrustedFunction):  # its child's start-up is not the batch's time
                rf.function.start()
        if not self.timeout:
            return self._score(*args)
        try:
            return within(self.timeout, self._score, *args)
        except Overdue:
            names = ", ".join(rf.spec for rf in self.functions) or "reasoning-gym's checkers"
            raise RewardError(f"the reward functions ({names}) did not score the completions of prompts "
                              f"{sorted({p.index for p in prompts})} within reward.timeout_seconds={self.timeout:g}; "
                              "a function that hangs (a network call without a timeout?) stops the run here: fix it, "
                              "or raise reward.timeout_seconds if it is only slow") from None

    def _score(self, prompts: list[Prompt], completions: list[list[str]], completion_ids: list[list[list[int]]],
               state, messages: list[list[list[dict]]] | None, environment: list[list[float | None]] | None,
               environments: list[list] | None) -> Scores:
        if not self.functions and environment is not None:
            return Scores(environment, {ENVIRONMENT_NAME: environment}, {}, {})
        if not self.functions:
            values = [[score(p, c, self.task_args.get(p.task), self.checking) for c in cs]
                      for p, cs in zip(prompts, completions)]
            return Scores(values, {DEFAULT_NAME: values}, {}, {})
        flat = [(p, c, i) for p, cs, ids in zip(prompts, completions, completion_ids) for c, i in zip(cs, ids)]
        calls, logged = self._calls(flat, state, None if messages is None else [m for ms in messages for m in ms],
                                    None if environments is None else [e for es in environments for e in es])
        by_function = {rf.name: self._values(rf, calls[k], flat, logged) for k, rf in enumerate(self.functions)}
        weighted = [(rf.weight, by_function[rf.name]) for rf in self.functions]
        if environment is not None:
            by_function[ENVIRONMENT_NAME] = [v for vs in environment for v in vs]
            weighted.append((1.0, by_function[ENVIRONMENT_NAME]))
        totals = [self._total(flat[j][0], [(w, values[j]) for w, values in weighted]) for j in range(len(flat))]
        return Scores(_nest(totals, completions), {name: _nest(v, completions) for name, v in by_function.items()},
                      {column: _nest(v, completions) for column, v in logged.extras.items()}, logged.metrics)

    def _calls(self, flat: list[tuple[Prompt, str, list[int]]], state, messages: list[list[dict]] | None,
               environments: list | None) -> tuple[dict[int, object], CallLog]:
        """Every function's raw results (async ones awaited together) and what they logged."""
        logged = CallLog(len(flat))
        calls = {k: self._call(rf, flat, state, logged, messages, environments) for k, rf in enumerate(self.functions)}
        pending = {k: v for k, v in calls.items() if inspect.isawaitable(v)}
        if pending:
            try:
                calls.update(await_all(pending))
            except RewardError:
                raise
            except Exception as e:
                raise RewardError(f"an async reward function raised {type(e).__name__}: {e} on the prompts "
                                  f"{sorted({p.index for p, _, _ in flat})}; fix the function") from e
        return calls, logged

    def _call(self, rf: RewardFunction, flat: list[tuple[Prompt, str, list[int]]], state, logged: CallLog,
              messages: list[list[dict]] | None, environments: list | None):
        """The function's raw results: one list (TRL's style, a reward model) or one value per
        completion; a coroutine stands for what async functions return."""
        if rf.style == "model":
            return self._guarded(rf, sorted({p.index for p, _, _ in flat}), rf.function, [(p, c) for p, c, _ in flat])
        if rf.style == "trl":
            return self._guarded(rf, sorted({p.index for p, _, _ in flat}), rf.function,
                                 **trl_keywords(rf, flat, state, logged, messages, environments))
        if rf.style == "verl":
            values = [self._guarded(rf, [p.index], rf.function,
                                    **verl_keywords(rf, p, c, self.answer_column, self.source_column))
                      for p, c, _ in flat]
        else:
            values = [self._guarded(rf, [p.index], rf.function, dataclasses.asdict(p), c, **rf.kwargs)
                      for p, c, _ in flat]
        if any(inspect.isawaitable(v) for v in values):  # an async compute_score: awaited together
            async def gather():
                return list(await asyncio.gather(*values))
            return gather()
        return values

    @staticmethod
    def _guarded(rf: RewardFunction, rows: list[int], function: Callable, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"{rf.describe()} raised {type(e).__name__}: {e} on prompt{'s' if len(rows) > 1 else ''} "
                              f"{', '.join(map(str, rows))} (row{'s' if len(rows) > 1 else ''} of the prompt file); "
                              "fix the function") from e

    def _values(self, rf: RewardFunction, result, flat, logged: CallLog) -> list[float | None]:
        """One value per completion, checked; a verl dict's other keys are logged columns."""
        if rf.style in ("trl", "model"):
            if not isinstance(result, (list, tuple)) or len(result) != len(flat):
                rows = sorted({p.index for p, _, _ in flat})
                got = f"{len(result)} values" if isinstance(result, (list, tuple)) else repr(result)[:80]
                raise RewardError(f"{rf.describe()} returned {got} for {len(flat)} completions (of prompts "
                                  f"{', '.join(map(str, rows))}); TRL-style functions return a list with one float "
                                  "(or None) per completion")
        if rf.style == "verl":
            result = self._verl_scores(rf, result, flat, logged)
        return [_number(rf, v, p, f"for completion {j}", allow_none=rf.style == "trl")
                for j, (v, (p, _, _)) in enumerate(zip(result, flat))]

    @staticmethod
    def _verl_scores(rf: RewardFunction, results: list, flat, logged: CallLog) -> list:
        """verl's returns as scores: a float, or a dict's "score", its other keys logged per
        completion (verl's reward_extra_info)."""
        dicts = [r for r in results if isinstance(r, dict)]
        for j, (r, (p, _, _)) in enumerate(zip(results, flat)):
            if isinstance(r, dict) and "score" not in r:
                raise RewardError(f"{rf.describe()} returned a dict without 'score' ({sorted(r)}) for completion {j} "
                                  f"of prompt {p.index}; verl's compute_score returns a float or a dict with 'score'")
        for key in dict.fromkeys(k for d in dicts for k in d if k != "score"):
            logged.add_column(rf, str(key), [r.get(key) if isinstance(r, dict) else None for r in results])
        return [r["score"] if isinstance(r, dict) else r for r in results]

    def _total(self, prompt: Prompt, weighted: list[tuple[float, float | None]]) -> float | None:
        applicable = [w * v for w, v in weighted if v is not None]
        if applicable:
            return sum(applicable)
        if not self._warned_unscorable:  # TRL's: a warning, and the completion is left out
            self._warned_unscorable = True
            log.warning("no reward function applies to a completion of prompt %d (every one returned None): it is "
                        "left out of the baselines and the reward figures, and its advantage is 0", prompt.index)
        return None


def within(seconds: float, fn: Callable, *args):
    """fn(*args) on a thread of its own, given `seconds`: its result or error, or Overdue.
    A thread cannot be stopped: one that hangs stays behind, a daemon (it does not keep the
    process from exiting), while the caller goes on (to fail, or to answer without it)."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    worker = threading.Thread(target=contextvars.copy_context().run, args=(target,), daemon=True,
                              name=getattr(fn, "__name__", "within"))
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise Overdue(f"not done within {seconds:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _nest(flat: list, like: list[list]) -> list[list]:
    out, start = [], 0
    for group in like:
        out.append(flat[start:start + len(group)])
        start += len(group)
    return out
