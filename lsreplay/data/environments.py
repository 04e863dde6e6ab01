"""Tools and environments of multi-turn episodes (docs/agents.md), as TRL and verifiers take them.

- Tools (`rollout.tools`): plain functions, sync or async, with type hints and a Google-style
  docstring (their JSON schema: transformers' `get_json_schema`). A call's result,
  `str(result)`, or on failure TRL's `{'error': <the exception's message>}`, comes back as a
  tool message (lsreplay.data.chat_formats reads the calls in the model's format).
- An environment (`rollout.environment`): a class, one live instance per episode, from
  `reset(**row)` (the dataset row, its prompt included; a string it returns is appended to
  the last user message) to the episode's end, when `close()` is called if it has one (also
  when the stage fails). The functions its class defines (public, not a hook) are tools;
  `respond(messages)`, if it has one, answers a reply without tool calls in words (the next
  user message; None ends the episode); `get_reward()`, if it has one, is a reward of the
  episode (None: none).

Where the tree branches after a turn, each branch gets its own copy of the instance:
`instance.fork()` where the class has one (an environment holding a sandbox, a browser, a
subprocess: a snapshot), else `copy.deepcopy`; the last branch keeps the original. So no tool
is ever called twice for the same turn, and an environment's answers need not be a function
of the calls (a random one trains on exactly what the model saw). An environment that can be
neither forked nor deep-copied is refused at start.

Every call of a tool or of the environment runs through the stage's `Calls`: given
`rollout.tool_timeout_seconds` (a tool call past it answers as a failed call; an
environment's hook past it stops the run with an EpisodeError naming it), an async one on
the stage's one event loop (async tools and environments can share a client). A thread
cannot be stopped: a sync call that hangs is left behind, logged; an async one is cancelled.

A `Journal` records every answer as it is given. A trees stage that resumes after an
interruption reads the recorded results of plain tools instead of calling them again, and
rebuilds an environment's state by calling it again, comparing each answer with the
recorded one: the first difference stops the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import hashlib
import inspect
import json
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from lsreplay.core.config import RolloutConfig, SandboxConfig
from lsreplay.core.sandbox import limits_of
from lsreplay.data.chat_formats import Chat, EpisodeError
from lsreplay.data.rendering import fit_prompt
from lsreplay.data.reward_functions import callable_name, load_function
from lsreplay.data.rewards import Overdue, within
from lsreplay.data.sources import Prompt
from lsreplay.data.untrusted import UntrustedFunction, untrusted_function

log = logging.getLogger(__name__)

# An environment's methods that are not tools (respond too, where it takes `messages`).
ENVIRONMENT_HOOKS = ("reset", "get_reward", "close", "fork")


def tool_schema(function: Callable, what: str) -> dict:
    """The function's JSON schema, as the chat template's `tools=` takes it."""
    try:  # an untrusted tool's, as its child process read it
        return getattr(function, "json_schema", None) or get_json_schema(function)
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise EpisodeError(f"{what}: {e} A tool needs a type hint on every parameter and a Google-style docstring "
                           "(a description, then an Args: section with a line per parameter), from which "
                           "transformers' get_json_schema writes its JSON schema") from None


def answers_in_words(factory) -> bool:
    """Whether the environment class has the hook respond(messages) (a `respond` taking
    anything else is a tool, as TRL offers every public method)."""
    function = getattr(factory, "respond", None)
    if not inspect.isfunction(function):
        return False
    params = [p for p in inspect.signature(function).parameters.values() if p.name != "self"]
    return [p.name for p in params] == ["messages"]


def environment_tools(factory) -> list[str]:
    """The names of the environment's tools: the public functions its class defines (and
    inherits) that are not hooks; attributes an instance sets (a client, a callable) are not."""
    hooks = ENVIRONMENT_HOOKS + (("respond",) if answers_in_words(factory) else ())
    return [name for name, member in inspect.getmembers(factory, inspect.isfunction)
            if not name.startswith("_") and name not in hooks]


@dataclass
class Play:
    """What episodes are played with: the tool functions, the environment class (None: none),
    every tool's schema (the functions', then the environment's methods'), the names of
    the environment's tool methods, the seconds a call may take (0: no limit), the most
    tokens an answer of the environment may add, and the format replies write calls in."""

    functions: dict[str, Callable]
    factory: Callable | None = None
    schemas: list[dict] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    timeout: float = 0.0
    max_answer_tokens: int = 256
    format: str = "auto"

    @property
    def answers(self) -> bool:
        """Whether the environment answers replies in words (has respond(messages))."""
        return self.factory is not None and answers_in_words(self.factory)

    @property
    def rewards(self) -> bool:
        """Whether the environment scores its episode (has `get_reward`)."""
        return self.factory is not None and callable(getattr(self.factory, "get_reward", None))

    @property
    def name(self) -> str:
        return callable_name(self.factory) if self.factory is not None else "none"

    def tools(self, instance) -> dict[str, Callable]:
        """The tools of one episode: the functions and its environment instance's methods."""
        return {**self.functions, **{name: getattr(instance, name) for name in self.methods}}


def load_play(r: RolloutConfig, sandbox: SandboxConfig | None = None) -> Play:
    """The configured tools and environment, their schemas checked; with
    rollout.untrusted_tools the tools run in a child process with `sandbox`'s limits."""
    play = Play({}, timeout=r.tool_timeout_seconds, max_answer_tokens=r.max_environment_tokens,
                format=r.tool_call_format)
    for i, spec in enumerate(r.tools):
        what = f"tool rollout.tools[{i}] ="
        function = untrusted_function(spec, what, limits_of(sandbox or SandboxConfig()), r.tool_timeout_seconds,
                                      tool=True) if r.untrusted_tools else load_function(spec, what)
        name = callable_name(function)
        if name in play.functions:
            raise EpisodeError(f"rollout.tools[{i}] = {spec!r}: a tool named {name!r} is listed already; the model "
                               "calls tools by name, so give each a name of its own")
        play.functions[name] = function
        play.schemas.append(tool_schema(function, f"tool rollout.tools[{i}] = {spec!r}"))
    if r.environment:
        play.factory = load_function(r.environment, "environment rollout.environment =")
        play.methods = environment_tools(play.factory)
        for name in play.methods:
            if name in play.functions:
                raise EpisodeError(f"environment {r.environment!r}: its method {name!r} has the name of a tool in "
                                   "rollout.tools; rename one of them")
            play.schemas.append(tool_schema(getattr(play.factory, name),
                                            f"environment {r.environment!r}, method {name!r}"))
    return play


def environment_rewards(r: RolloutConfig) -> bool:
    """Whether the configured environment scores its episodes (has get_reward)."""
    return bool(r.environment) and callable(getattr(load_function(r.environment, "environment rollout.environment ="),
                                                    "get_reward", None))


def instance_of(factory: Callable):
    """A new instance of the environment class, for one episode."""
    try:
        return factory()
    except Exception as e:
        raise EpisodeError(f"environment {callable_name(factory)}() raised {type(e).__name__}: {e}; an environment "
                           "class is built with no arguments, one instance per episode (rollout.environment)") from e


def fork_of(instance):
    """An independent copy of an episode's instance, for a branch: its fork(), else a deep copy."""
    fork = getattr(instance, "fork", None)
    try:
        return fork() if callable(fork) else copy.deepcopy(instance)
    except Exception as e:
        how = "its fork()" if callable(fork) else "copy.deepcopy"
        raise EpisodeError(f"environment {type(instance).__name__}: {how} raised {type(e).__name__}: {e}. Episodes "
                           "fork where the tree branches, each branch with an instance of its own: give the class a "
                           "fork() method that returns an independent copy (a sandbox's snapshot, a new connection "
                           "with the same state), or make its state deep-copyable") from e


# ---------------------------------------------------------------- where calls run


class Calls:
    """Where one stage's tool and environment calls run: sync calls on the calling thread (a
    thread of their own under a timeout), coroutines on the stage's one event loop; `submit`
    runs work on a pool of `workers` threads (episodes' turns of the environment side)."""

    def __init__(self, timeout: float = 0.0, workers: int = 32):
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lsreplay-episode-loop", daemon=True)
        self._thread.start()
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="lsreplay-episode")

    def run(self, function: Callable, *args, **kwargs):
        """function(*args, **kwargs), awaited on the loop if it returns an awaitable, within
        the timeout (0: none): Overdue past it (a coroutine is cancelled)."""
        started = time.monotonic()
        # An untrusted tool keeps the time of its call itself, in its child process (killed past it).
        bounded = self.timeout and not isinstance(function, UntrustedFunction)
        value = within(self.timeout, lambda: function(*args, **kwargs)) if bounded else function(*args, **kwargs)
        if not inspect.isawaitable(value):
            return value
        future = asyncio.run_coroutine_threadsafe(_awaited(value), self.loop)
        try:
            return future.result(max(0.0, self.timeout - (time.monotonic() - started)) if self.timeout else None)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise Overdue(f"not done within {self.timeout:g} s") from None

    def submit(self, function: Callable, *args) -> concurrent.futures.Future:
        return self.pool.submit(function, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> Calls:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _awaited(awaitable):
    return await awaitable


@dataclass(frozen=True)
class ToolAnswer:
    """The tool message answering one call; whether the call failed (TRL's tool_failure: an
    unknown tool, bad arguments, an unreadable call, an exception, no answer in time), and
    whether it ran out of time."""

    message: dict
    failed: bool
    timed_out: bool = False


def call_tool(tools: dict[str, Callable], call: dict, calls: Calls) -> ToolAnswer:
    """The answer to one parsed call: the one place a tool runs."""
    function = call.get("function", {})
    name = function.get("name") or "unknown"
    try:
        if "error" in call:  # a call the format could not read
            raise ValueError(call["error"])
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        return ToolAnswer(_tool_message(name, calls.run(tools[name], **function.get("arguments", {})), call), False)
    except Overdue:
        log.warning("tool %s did not answer within rollout.tool_timeout_seconds=%g s: answered as a failed call",
                    name, calls.timeout)
        return ToolAnswer(_tool_message(name, {"error": f"Tool {name} did not answer within {calls.timeout:g} s."},
                                        call), True, True)
    except Exception as e:
        return ToolAnswer(_tool_message(name, {"error": str(e)}, call), True)


def _tool_message(name: str, result, call: dict) -> dict:
    return {"role": "tool", "name": name, "content": str(result),
            **({"tool_call_id": call["id"]} if "id" in call else {})}  # Mistral's template pairs them by id


# ---------------------------------------------------------------- episodes


class Journal(Protocol):
    """The environment's answers of a trees stage, by reply (journal_key): recorded as they are
    given, read again by a stage that resumes."""

    def get(self, key: str) -> dict | None: ...

    def put(self, key: str, entry: dict) -> None: ...


def journal_key(tree: int, completion: list[int]) -> str:
    """The key of the answer to an episode's reply: its tree and its completion up to the reply."""
    return hashlib.sha256(json.dumps([tree, completion]).encode()).hexdigest()[:32]


@dataclass
class Episode:
    """One episode as the environment sees it, up to the model's next reply (or its end): its
    tree, its live environment instance (None: no environment), its messages after the opening
    (TRL's multi-turn completion), its tool calls and their failures, and once it ended the
    environment's reward (None: none)."""

    tree: int
    instance: object = None
    messages: list[dict] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None
    opening: list[dict] = field(default_factory=list)  # the prompt's messages, with the reset string
    reset: str | None = None  # what reset() returned

    @property
    def answer(self) -> str:
        """The episode's last reply's content: what single-answer rewards score."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


class Episodes:
    """One batch of prompts' episodes on the environment's side (rollout.episodes'
    EpisodeEnvironment): each tree's first episode (its instance built and reset, the opening
    rendered), a branch's copy, the environment's answer to each reply, and every instance's
    close. Calls run through `calls`; `journal`, if given, records the answers and holds
    those of an interrupted stage."""

    def __init__(self, play: Play, chat: Chat, prompts: list[Prompt], calls: Calls, journal: Journal | None = None):
        self.play, self.chat, self.prompts, self.calls, self.journal = play, chat, list(prompts), calls, journal
        self.rows = [{"prompt": p.question, **p.columns} for p in prompts]
        self.roots: list[Episode] = []
        self._prompt_ids: list[list[int]] = []
        self._closed: dict[int, object] = {}  # the instances closed, by id (a branch's last reply shares its parent's)
        try:
            for tree in range(len(prompts)):
                self.roots.append(self._start(tree))
        except BaseException:
            for episode in self.roots:
                self.close(episode)
            raise

    def _start(self, tree: int) -> Episode:
        """The tree's first episode: a fresh instance, reset with the row; its opening, within
        data.max_prompt_tokens: refused, or its prompt's text cut (data.prompt_truncation)."""
        episode = Episode(tree)
        if self.play.factory is not None:
            episode.instance = self._hook(tree, "construction", instance_of, self.play.factory)
            if callable(getattr(episode.instance, "reset", None)):
                said = self._hook(tree, "reset", episode.instance.reset, **self.rows[tree])
                episode.reset = None if said is None else str(said)
        chat = self.chat
        self.prompts[tree], ids = fit_prompt(self.prompts[tree],
                                             lambda p: chat.prompt_ids(p, chat.opening(p, episode.reset)),
                                             chat.tokenizer, chat.data)
        self._prompt_ids.append(ids)
        episode.opening = chat.opening(self.prompts[tree], episode.reset)
        return episode

    def prompt_ids(self) -> list[list[int]]:
        return self._prompt_ids

    def reward_prompts(self) -> list[Prompt]:
        """The prompts as reward functions see them: the reset string appended (TRL's prompts)."""
        return [dataclasses.replace(p, question=_with_reset(p.question, e.reset)) for p, e in zip(self.prompts,
                                                                                                    self.roots)]

    def root(self, tree: int) -> Episode:
        return self.roots[tree]

    def branch(self, parent: Episode, last: bool) -> Episode:
        """The episode of one reply to `parent`: the parent's instance for its last reply, a
        fork of it for the others."""
        instance = parent.instance if last or parent.instance is None else fork_of(parent.instance)
        return dataclasses.replace(parent, instance=instance, messages=list(parent.messages))

    def respond(self, episode: Episode, reply: list[int], completion: list[int], ending: bool) -> list[int] | None:
        """The environment's tokens answering the episode's reply (its token ids; `completion`:
        the episode's tokens up to it), or None: the episode ended (`ending`: it ends whatever
        the answer: its last turn, or a reply cut at max_new_tokens). An ended episode has its
        messages, tool figures and the environment's reward."""
        message = self.chat.reply(reply)
        before = episode.messages + [message]
        if ending and "tool_calls" in message:  # no turn left to read the results (TRL's: no iterations left)
            answers = None
        else:
            answers = self._answers(episode, message, before, journal_key(episode.tree, completion))
        ids = None if answers is None or ending else self._fitted(episode, before, answers)
        if ids is None:
            episode.messages = before
            episode.reward = self._reward(episode) if self.play.rewards else None
            return None
        episode.messages = before + answers
        return ids

    def _answers(self, episode: Episode, message: dict, before: list[dict], key: str) -> list[dict] | None:
        """The messages answering a reply: its tool calls' results, or the environment's words
        (None: it has none, the episode ends). Recorded in the journal, or read from it."""
        recorded = self.journal.get(key) if self.journal is not None else None
        if "tool_calls" in message:
            answers = self._tool_answers(episode, message["tool_calls"], recorded)
            episode.tool_calls += len(answers)
            episode.tool_errors += sum(a.failed for a in answers)
            entry = {"tools": [dataclasses.asdict(a) for a in answers]}
            messages = [a.message for a in answers]
        elif self.play.answers:
            said = self._hook(episode.tree, "respond", episode.instance.respond, episode.opening + before)
            said = None if said is None else str(said)
            if recorded is not None and recorded.get("said", said) != said:
                self._diverged(episode, "respond", said, recorded["said"])
            entry = {"said": said}
            messages = None if said is None else [{"role": "user", "content": said}]
        else:
            return None
        if self.journal is not None and recorded is None:
            self.journal.put(key, entry)
        return messages

    def _tool_answers(self, episode: Episode, tool_calls: list[dict], recorded: dict | None) -> list[ToolAnswer]:
        """Each call's answer, in order: a plain tool's (or a timed-out call's) recorded answer
        as it was; the environment's methods called again, to rebuild its state, and checked."""
        tools, answers = self.play.tools(episode.instance), []
        for i, call in enumerate(tool_calls):
            old = ToolAnswer(**recorded["tools"][i]) if recorded and i < len(recorded.get("tools", [])) else None
            if old is not None and (old.timed_out or call.get("function", {}).get("name") not in self.play.methods):
                answers.append(old)
                continue
            answer = call_tool(tools, call, self.calls)
            if old is not None and (answer.message, answer.failed) != (old.message, old.failed):
                self._diverged(episode, f"tool {call['function'].get('name')}", answer.message["content"],
                               old.message["content"])
            answers.append(answer)
        return answers

    def _diverged(self, episode: Episode, what: str, now, then) -> None:
        raise EpisodeError(
            f"environment {self.play.name}: on resume its {what} answered {str(now)[:120]!r} to an episode of prompt "
            f"{self.prompts[episode.tree].index}, where the interrupted stage recorded {str(then)[:120]!r}. A resumed "
            "trees stage rebuilds each episode's environment by calling it again, which needs the same answers to "
            "the same calls; make the environment a function of the row and the calls (seed its randomness from "
            "them), or start the step's trees stage afresh (delete its journal, trees/journal_*)")

    def _fitted(self, episode: Episode, before: list[dict], answers: list[dict]) -> list[int] | None:
        """The tokens of the answers, their contents cut (at the end, logged) until they fit in
        rollout.max_environment_tokens; None where not even an empty answer fits."""
        opening, limit, tokenizer = episode.opening, self.play.max_answer_tokens, self.chat.tokenizer
        ids = self.chat.continuation(opening + before, opening + before + answers)
        for _ in range(4):
            if len(ids) <= limit:
                return ids
            log.warning("the environment's answer to an episode of prompt %d is %d tokens, more than "
                        "rollout.max_environment_tokens=%d: its longest message is cut",
                        self.prompts[episode.tree].index, len(ids), limit)
            longest = max(range(len(answers)), key=lambda i: len(answers[i]["content"]))
            content = tokenizer.encode(answers[longest]["content"], add_special_tokens=False)
            kept = content[:max(0, len(content) - (len(ids) - limit) - 2)]  # 2: the ellipsis, and a token's drift
            answers[longest] = {**answers[longest], "content": tokenizer.decode(kept) + "…"}
            ids = self.chat.continuation(opening + before, opening + before + answers)
        if len(ids) <= limit:
            return ids
        log.warning("the environment's answer to an episode of prompt %d does not fit in rollout.max_environment_tokens"
                    "=%d even cut: the episode ends at the reply before it", self.prompts[episode.tree].index, limit)
        return None

    def _reward(self, episode: Episode) -> float | None:
        value = self._hook(episode.tree, "get_reward", episode.instance.get_reward)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise EpisodeError(f"environment {self.play.name}.get_reward() returned {value!r} for an episode of prompt "
                               f"{self.prompts[episode.tree].index}; it must return a finite float (or None: no "
                               "reward from the environment)")
        return float(value)

    def close(self, episode: Episode) -> None:
        """The episode's instance closed (its close(), sync or async, where it has one), once; a
        failure is logged (the episode is over; it must not hide another error)."""
        instance = episode.instance
        if instance is None or id(instance) in self._closed:
            return
        self._closed[id(instance)] = instance
        if callable(close := getattr(instance, "close", None)):
            try:
                self.calls.run(close)
            except Exception:  # noqa: BLE001
                log.warning("environment %s: close() raised", self.play.name, exc_info=True)

    def _hook(self, tree: int, hook: str, function: Callable, *args, **kwargs):
        """A call of the environment (`hook`: its construction, reset, respond, get_reward) for
        an episode of the tree's prompt, within rollout.tool_timeout_seconds: EpisodeError past them."""
        try:
            return self.calls.run(function, *args, **kwargs)
        except Overdue:
            raise EpisodeError(f"environment {self.play.name}: its {hook} did not return within "
                               f"rollout.tool_timeout_seconds={self.play.timeout:g} s (an episode of prompt "
                               f"{self.prompts[tree].index}); a call that hangs stops the rollouts here: fix it, or "
                               "raise rollout.tool_timeout_seconds if it is only slow") from None


def _with_reset(question: str | list[dict], reset: str | None) -> str | list[dict]:
    if not reset:
        return question
    if isinstance(question, str):
        return question + reset
    users = [i for i, m in enumerate(question) if m["role"] == "user"]
    return [{**m, "content": m["content"] + reset} if users and i == users[-1] else m for i, m in enumerate(question)]
