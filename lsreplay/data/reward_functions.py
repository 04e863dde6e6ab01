"""Your reward functions, by import path, called as the trainer they were written for calls
them (`reward.styles`, else told by their parameters):

- TRL's (GRPOTrainer._calculate_rewards, TRL 1.16): once per batch, `f(prompts=,
  completions=, completion_ids=, trainer_state=, log_extra=, log_metric=, **columns)`, every
  dataset column but the prompt's (and but `completion` and `completion_ids`, as TRL) a
  keyword holding one value per completion; with an environment (rollout.environment) also
  `environments=`, each completion's episode's instance (TRL's environment_factory). It
  returns one float (or None: it does not apply) per completion. `log_metric(name, value)`
  logs a scalar, `log_extra(column, values)` a column of the completions table (one value
  per completion).
- verl's (its naive reward manager and single-turn agent loop): once per completion,
  `compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`, returning a float
  or a dict with "score" whose other keys are logged per completion.
- lsreplay's: `function(prompt, completion) -> float` per completion.

`reward.kwargs` adds keywords to every call of a function, over those its style passes
(verl's custom_reward_function.reward_kwargs). A function is named as TRL names it
(trl.trainer.utils.get_callable_name): a functools.partial by the function it wraps, a
callable object by its class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable
from difflib import get_close_matches
from pathlib import Path

from lsreplay.core.config import ConfigError
from lsreplay.data.sources import Prompt, jsonable, lookup

# What a TRL-style function is given besides the dataset's columns (TRL's GRPOTrainer).
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
# What TRL adds with an environment_factory (lsreplay: rollout.environment): one instance per completion.
ENVIRONMENTS_KEYWORD = "environments"
# Dataset columns TRL does not pass as keywords (GRPOTrainer._calculate_rewards).
TRL_UNPASSED_COLUMNS = ("prompt", "completion", "completion_ids")
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
# Where verl's datasets keep the reference answer, which verl's reward manager reads.
VERL_GROUND_TRUTH = "reward_model.ground_truth"
# The turns verl's reward manager adds to a row's extra_info: its single-turn agent loop
# (verl's default rollout) records 2, the prompt and the answer.
VERL_NUM_TURNS = 2


class RewardError(ConfigError):
    """A reward function that cannot be used as given: not importable, the wrong signature,
    or a return that is not a finite number."""


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


def _import(spec: str, module_name: str, what: str):
    if module_name.endswith(".py"):  # verl's custom_reward_function.path
        path = Path(module_name)
        if not path.is_file():
            raise RewardError(f"{what} {spec!r}: no file {path} (relative to the working directory "
                              f"{os.getcwd()})")
        loaded = importlib.util.spec_from_file_location(f"lsreplay_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
        return module
    with _working_directory_importable():
        return importlib.import_module(module_name)


def load_function(spec: str, what: str = "reward function") -> Callable:
    """The callable an import path names (module.function, module:function, file.py:function);
    `what` it is names it in the errors (a reward function, a tool, an environment)."""
    module_name, name = _split(spec)
    try:
        module = _import(spec, module_name, what)
    except RewardError:
        raise
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise RewardError(f"{what} {spec!r}: importing {module_name} failed: {e}") from e
        raise RewardError(f"{what} {spec!r}: no module named {module_name!r}; put {module_name}.py in the "
                          "working directory or on PYTHONPATH (or pip install the package that has it)") from e
    except Exception as e:
        raise RewardError(f"{what} {spec!r}: importing {module_name} raised "
                          f"{type(e).__name__}: {e}") from e
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(f"{what} {spec!r}: {module_name} ({module.__file__}) has no function {name!r}")
    return function


def callable_name(function: Callable) -> str:
    """TRL's name for a reward function (get_callable_name): a functools.partial is named by
    the function it wraps, a callable object by its class."""
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", type(function).__name__)


def parameters(function: Callable) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(function).parameters)
    except ValueError:  # no signature to inspect (some builtins): the first call will tell
        return None


def takes_any_keyword(params: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in params.values())


def detect_style(function: Callable) -> str:
    """verl's when it takes solution_str; TRL's when it takes completions, prompts or
    completion_ids, keywords only, or **kwargs and not two positional arguments; else
    lsreplay's (prompt, completion)."""
    params = parameters(function)
    if params is None:
        return "lsreplay"
    if "solution_str" in params:
        return "verl"
    if set(params) & {"prompts", "completions", "completion_ids"}:
        return "trl"
    try:
        inspect.signature(function).bind({}, "")
    except TypeError:
        return "trl" if takes_any_keyword(params) or not [
            p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)] else "lsreplay"
    return "lsreplay"


@dataclasses.dataclass
class RewardFunction:
    """One configured reward function: its import path (or model), the name its figures are
    logged under (rewards/NAME/mean), its calling style (trl, verl, lsreplay; model for a
    reward model), weight and keywords (reward.kwargs)."""

    spec: str
    name: str
    style: str
    weight: float
    function: Callable
    kwargs: dict = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        return f"reward function {self.spec!r}"

    def signature(self) -> str:
        return f"{self.name}{inspect.signature(self.function)}"


def check_call(rf: RewardFunction) -> None:
    """What can be checked of a signature before the data is known."""
    params = parameters(rf.function)
    if params is None:
        return
    unknown = [k for k in rf.kwargs if k not in params]
    if unknown and not takes_any_keyword(params):
        raise RewardError(f"{rf.describe()}: {rf.signature()} takes no {unknown} and no **kwargs, but reward.kwargs "
                          "gives them; drop them from reward.kwargs or add the parameters")
    if rf.style == "lsreplay":
        try:
            inspect.signature(rf.function).bind({}, "", **rf.kwargs)
        except TypeError:
            raise RewardError(f"{rf.describe()}: {rf.signature()} cannot be called as {rf.name}(prompt, completion) "
                              "(lsreplay's style); it must take the prompt record (a dict) and the completion text, "
                              "and return a float. TRL's style takes completions=, verl's solution_str= (or say "
                              "reward.styles)") from None
    elif rf.style == "verl":
        required = [n for n, p in params.items()
                    if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        unknown = [n for n in required if n not in VERL_KEYWORDS and n not in rf.kwargs]
        if unknown or ("solution_str" not in params and not takes_any_keyword(params)):
            raise RewardError(f"{rf.describe()}: {rf.signature()} cannot be called as verl calls compute_score: "
                              f"({', '.join(f'{k}=' for k in VERL_KEYWORDS)}); "
                              + (f"it also needs {unknown}" if unknown else "it takes no solution_str"))
    else:
        positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
        if positional:
            raise RewardError(f"{rf.describe()}: {rf.signature()} takes {positional} by position only; TRL-style "
                              f"functions are called with keywords ({', '.join(TRL_KEYWORDS)} and the dataset's "
                              "columns)")


def trl_columns(columns: list[str]) -> list[str]:
    """The dataset columns TRL passes a reward function as keywords (all but the prompt's,
    which `columns` leaves out, and but TRL's completion and completion_ids)."""
    return [c for c in columns if c not in TRL_UNPASSED_COLUMNS]


def check_trl_keywords(rf: RewardFunction, columns: list[str], environments: bool = False) -> None:
    """A TRL-style function takes every keyword it is given (or **kwargs) and is given every
    one it needs: TRL's own, `environments` with an environment, and the dataset's columns
    (but the prompt's)."""
    params = parameters(rf.function)
    if params is None or rf.style != "trl":
        return
    own = [*TRL_KEYWORDS, *([ENVIRONMENTS_KEYWORD] if environments else [])]
    given = [*own, *trl_columns(columns), *rf.kwargs]
    for name, p in params.items():
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in given:
            near = get_close_matches(name, given, n=1)
            hint = (" (environments: with rollout.environment only)" if name == ENVIRONMENTS_KEYWORD else
                    f"; did you mean {near[0]!r}?" if near else "")
            raise RewardError(f"{rf.describe()}: {rf.signature()} needs {name!r}, which TRL-style functions are not "
                              f"given: they get {', '.join(own)} and the dataset's columns {columns}{hint}")
    if not takes_any_keyword(params):
        extra = [k for k in given if k not in params]
        if extra:
            raise RewardError(f"{rf.describe()}: {rf.signature()} takes no **kwargs, but TRL-style functions are "
                              f"given every dataset column as a keyword ({extra} too); add **kwargs as TRL's do")


class CallLog:
    """What the functions of one batch logged: TRL's log_metric scalars (name -> values, one
    per call) and per-completion columns (TRL's log_extra, verl's dict keys; column -> one
    value per completion of the batch)."""

    def __init__(self, completions: int):
        self.completions, self.metrics, self.extras = completions, {}, {}

    def metric_logger(self, rf: RewardFunction) -> Callable[[str, float], None]:
        def log_metric(name: str, value: float) -> None:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RewardError(f"{rf.describe()} called log_metric({name!r}, {value!r}); the value must be a "
                                  "finite number")
            self.metrics.setdefault(str(name), []).append(float(value))
        return log_metric

    def extra_logger(self, rf: RewardFunction) -> Callable[[str, list], None]:
        def log_extra(column: str, values: list) -> None:
            self.add_column(rf, str(column), list(values))
        return log_extra

    def add_column(self, rf: RewardFunction, column: str, values: list) -> None:
        if len(values) != self.completions:
            raise RewardError(f"{rf.describe()} logged {len(values)} values of column {column!r} for "
                              f"{self.completions} completions; give one value per completion")
        if column in self.extras:
            raise RewardError(f"{rf.describe()} logged column {column!r}, which this batch has already; give each "
                              "logged column a name of its own")
        self.extras[column] = jsonable(values)


def trl_keywords(rf: RewardFunction, flat: list[tuple[Prompt, str, list[int]]], state, log: CallLog,
                 messages: list[list[dict]] | None = None, environments: list | None = None) -> dict:
    """Every keyword TRL's GRPOTrainer passes a reward function, for a batch of (prompt,
    completion text, completion token ids): for message prompts each completion is
    [{"role": "assistant", "content": text}], or for episodes their `messages` (the assistant,
    tool and environment messages after the prompt, as TRL passes multi-turn completions) and
    with an environment each episode's instance (`environments`)."""
    columns = trl_columns(list(flat[0][0].columns))
    return {"prompts": [p.question for p, _, _ in flat],
            "completions": messages if messages is not None else
            [c if isinstance(p.question, str) else [{"role": "assistant", "content": c}] for p, c, _ in flat],
            "completion_ids": [list(i) for _, _, i in flat],
            **{k: [p.columns.get(k) for p, _, _ in flat] for k in columns},
            "trainer_state": state, "log_extra": log.extra_logger(rf), "log_metric": log.metric_logger(rf),
            **({ENVIRONMENTS_KEYWORD: environments} if environments is not None else {}), **rf.kwargs}


def verl_keywords(rf: RewardFunction, prompt: Prompt, completion: str, answer_column: str, source_column: str) -> dict:
    """What verl's reward manager passes compute_score: data_source (the data.reward_fn_key
    column), the completion, ground_truth (reward_model.ground_truth, where the row has none
    the data.columns.answer field) and the row's extra_info ({} when absent) with
    num_turns and rollout_reward_scores; reward.kwargs over them. Only the keywords the
    function takes, unless it takes **kwargs."""
    truth = lookup(prompt.columns, VERL_GROUND_TRUTH)
    extra_info = prompt.columns.get("extra_info")
    if extra_info is None or isinstance(extra_info, dict):
        extra_info = {**(extra_info or {}), "num_turns": VERL_NUM_TURNS, "rollout_reward_scores": {}}
    values = {"data_source": prompt.columns.get(source_column), "solution_str": completion,
              "ground_truth": lookup(prompt.columns, answer_column) if truth is None else truth,
              "extra_info": extra_info, **rf.kwargs}
    params = parameters(rf.function)
    if params is None or takes_any_keyword(params):
        return values
    return {k: v for k, v in values.items() if k in params}
