"""Reward functions and tools of code the user marked untrusted (reward.untrusted,
rollout.untrusted_tools): imported and called in a child process (lsreplay.core.sandbox), never
in this one.

`untrusted_function(spec, ...)` stands for the function an import path names: it carries the
function's name, signature and docstring (and a tool's JSON schema) as the child read them,
so that it is told apart, checked and offered to the model as the function itself would be.
A call sends its arguments as JSON and returns the function's JSON value (a tool's as its
text, str(result), as the tool message holds it). A TRL-style reward function's trainer_state
becomes a transformers.TrainerState again in the child, and what it gives log_metric and
log_extra is replayed on this process's loggers after the call. A call past its wall time
kills the child (Overrun); one that raises fails with its exception's type and message
(SandboxError). The calls of one function's child run one at a time; a call's wall time
counts from when it starts there (a queued call, or a child starting again after a kill,
does not use it up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

from lsreplay.core.sandbox import START_SECONDS, Limits, SandboxError, child
from lsreplay.data.reward_functions import ENVIRONMENTS_KEYWORD, RewardError, callable_name, load_function, parameters
from lsreplay.data.sources import jsonable

# The kinds of parameters, by the names the child gives them.
_KINDS = {kind.name: kind for kind in type(inspect.Parameter.POSITIONAL_ONLY)}
# The default of a parameter that has one: its value stays in the child.
HAS_DEFAULT = object()
# The keywords a TRL-style reward function gets that are not JSON: replayed or rebuilt.
LOGGERS = ("log_metric", "log_extra")


class UntrustedFunction:
    """The function `spec` names, called in the child process (see the module's docstring)."""


    def __init__(self, spec: str, what: str, limits: Limits, seconds: float, tool: bool):
        self.spec, self.seconds, self.tool = spec, seconds, tool
        self._child, self._what = child("untrusted tools" if tool else "untrusted reward functions", limits), what
        try:
            self._prepare()
            described = self._child.call("lsreplay.data.untrusted:describe", spec, tool, seconds=START_SECONDS)
        except SandboxError as e:
            raise RewardError(f"{what} {spec!r} (untrusted: loaded in a child process): {e}") from None
        self.__name__ = self.__qualname__ = described["name"]
        self.__doc__ = described["doc"]
        self.__signature__ = inspect.Signature([
            inspect.Parameter(name, _KINDS[kind], default=HAS_DEFAULT if default else inspect.Parameter.empty)
            for name, kind, default in described["parameters"]]) if described["parameters"] is not None else None
        self.json_schema = described.get("schema")

    def _prepare(self) -> None:
        """The child loads `spec` at every start (after a kill too); prepared again after the
        children were closed, which forgets what they loaded."""
        self._child.prepare("lsreplay.data.untrusted:load", self.spec, self._what)

    def start(self) -> None:
        """Start the child (after a kill) and load the functions: a caller timing a call starts
        its clock after this."""
        self._prepare()

    def __call__(self, *args, **kwargs):
        if kwargs.get(ENVIRONMENTS_KEYWORD) is not None:
            raise RewardError(f"{self.spec} (reward.untrusted: it runs in a child process) cannot be given the "
                              f"episodes' environment instances ({ENVIRONMENTS_KEYWORD}=), which live in this process; "
                              "score the episodes with the environment's get_reward, or trust the function")
        loggers = {name: kwargs.pop(name) for name in LOGGERS if callable(kwargs.get(name))}
        state = kwargs.pop("trainer_state", None)
        self._prepare()
        reply = self._child.call("lsreplay.data.untrusted:call", self.spec, list(args), kwargs,
                                 None if state is None else dataclasses.asdict(state), sorted(loggers), self.tool,
                                 seconds=self.seconds)
        for name, *logged in reply["logged"]:
            loggers[name](*logged)
        return reply["value"]


def untrusted_function(spec: str, what: str, limits: Limits, seconds: float, tool: bool = False) -> UntrustedFunction:
    """The function `spec` names, loaded and called in a child process with `limits`, each
    call killed past `seconds` (0: no limit); RewardError naming it if it cannot be loaded."""
    return UntrustedFunction(spec, what, limits, seconds, tool)


# -- the child's side --------------------------------------------------------------------------
_loaded: dict = {}


def load(spec: str, what: str) -> None:
    """Import the function `spec` names (at the child's start: its calls' wall time is theirs)."""
    _loaded[spec] = load_function(spec, what)


def describe(spec: str, tool: bool) -> dict:
    """The function's name, parameters ([name, kind, has a default], or None if it has no
    signature), docstring, and with `tool` its JSON schema (transformers' get_json_schema)."""
    function = _loaded[spec]
    params = parameters(function)
    out = {"name": callable_name(function), "doc": inspect.getdoc(function),
           "parameters": None if params is None else [[p.name, p.kind.name, p.default is not p.empty]
                                                      for p in params.values()]}
    if tool:
        from transformers.utils import get_json_schema

        out["schema"] = get_json_schema(function)
    return out


def call(spec: str, args: list, kwargs: dict, state: dict | None, loggers: list[str], tool: bool) -> dict:
    """The function called: {"value": its JSON value (a tool's text), "logged": [[logger,
    *arguments], ...]}, a coroutine's result awaited."""
    logged: list = []
    for name in loggers:
        kwargs[name] = lambda *a, _name=name: logged.append([_name, *jsonable(list(a))])
    if state is not None:
        from transformers import TrainerState

        kwargs["trainer_state"] = TrainerState(**state)
    value = _loaded[spec](*args, **kwargs)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    return {"value": str(value) if tool else jsonable(value), "logged": logged}


async def _awaited(value):
    return await value
