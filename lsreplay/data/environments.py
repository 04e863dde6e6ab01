"""Tools and environments for multi-turn episodes (docs/multi-turn.md), as TRL and verifiers take them.

- Tools (`rollout.tools`): plain functions, sync or async, with type hints and a Google-style
  docstring (their JSON schema: transformers' `get_json_schema`). The model calls one by
  writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (or in the format the
  tokenizer's `response_template` parses, where it has one); the result, `str(result)`, or
  on failure TRL's `{'error': <the exception's message>}`, comes back as a tool message.
- An environment (`rollout.environment`): a class, one instance per episode. `reset(**row)`
  (the dataset row, its prompt included) may return a string appended to the last user
  message; its public methods are tools; `respond(messages)`, if it has one, answers a reply
  without tool calls in words (the next user message; None ends the episode); `get_reward()`,
  if it has one, is a reward of the episode.

A reply with tool calls gets their results; one without gets the environment's `respond`
(if any) or ends the episode. The environment's tokens are the chat template's rendering of
what it appended: the conversation rendered whole, less its rendering before (trimmed at the
reply's end-of-turn token, as TRL's `_get_tool_suffix_ids`). A template that renders earlier
turns differently once more follow is not prefix-preserving, and refused.

Episodes fork at branch points, and an instance holds one episode's state. So an instance is
never shared: for every turn a fresh one is built and the episode's earlier actions (its tool
calls, its `respond` calls) are replayed into it. That costs turns^2 / 2 calls per episode,
and needs what the HF sampler needs anyway to be bit-reproducible: tools and environments
must be deterministic (a function of the row and the episode so far; no clock, no unseeded
randomness, no outside service whose answers change).

Every call of a tool or of the environment (its construction, reset, respond, get_reward)
runs on a thread of its own, given `rollout.tool_timeout_seconds`: a tool call past it answers
as a failed call (`{'error': ...}`, as TRL returns errors) and is not replayed later (its
effect on the instance is unknown); an environment's hook past it stops the run with an
EpisodeError naming it (not retried, as a bad config is not). A thread cannot be stopped: the one that hangs is left behind, and the stall is logged.
A call that times out makes the episodes depend on timing, not only on the draws.
An environment's answer of more than `rollout.max_environment_tokens` tokens is not shown:
the episode ends at the reply before it, as at its last turn (logged).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from lsreplay.core.config import ConfigError, DataConfig, RolloutConfig
from lsreplay.data.rendering import fit_prompt, prompt_messages, render_messages
from lsreplay.data.reward_functions import callable_name, load_function
from lsreplay.data.rewards import Overdue, await_all, within
from lsreplay.data.sources import DatasetError, Prompt

log = logging.getLogger(__name__)

# The documented tool-call format, for templates without a response parser (Hermes' and Qwen2.5's).
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# An environment's methods that are not tools.
ENVIRONMENT_HOOKS = ("reset", "respond", "get_reward")
# For templates that ignore `tools=` (SmolLM2's): the tools described in the system message.
TOOLS_SYSTEM_MESSAGE = (
    "You can call these functions (JSON schemas):\n<tools>\n{schemas}\n</tools>\n"
    "To call one, write <tool_call>{{\"name\": <its name>, \"arguments\": <a JSON object of its arguments>}}"
    "</tool_call>; its result comes back in a tool message.")


class EpisodeError(ConfigError):
    """A tool, environment or chat template that multi-turn episodes cannot use as given."""


# ---------------------------------------------------------------- tools and environments


def tool_schema(function: Callable, what: str) -> dict:
    """The function's JSON schema, as the chat template's `tools=` takes it."""
    try:
        return get_json_schema(function)
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise EpisodeError(f"{what}: {e} A tool needs a type hint on every parameter and a Google-style docstring "
                           "(a description, then an Args: section with a line per parameter), from which "
                           "transformers' get_json_schema writes its JSON schema") from None


@dataclass
class Play:
    """What episodes are played with: the tool functions, the environment class (None: none),
    every tool's schema (the functions', then the environment's methods'), the names of
    the environment's tool methods, the seconds a call may take (0: no limit) and the most
    tokens an answer of the environment may add."""

    functions: dict[str, Callable]
    factory: Callable | None = None
    schemas: list[dict] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    timeout: float = 0.0
    max_answer_tokens: int = 256

    @property
    def answers(self) -> bool:
        """Whether the environment answers replies in words (has `respond`)."""
        return self.factory is not None and callable(getattr(self.factory, "respond", None))

    @property
    def rewards(self) -> bool:
        """Whether the environment scores its episode (has `get_reward`)."""
        return self.factory is not None and callable(getattr(self.factory, "get_reward", None))

    def tools(self, instance) -> dict[str, Callable]:
        """The tools of one episode: the functions and its environment instance's methods."""
        return {**self.functions, **{name: getattr(instance, name) for name in self.methods}}


def load_play(r: RolloutConfig) -> Play:
    """The configured tools and environment, their schemas checked."""
    play = Play({}, timeout=r.tool_timeout_seconds, max_answer_tokens=r.max_environment_tokens)
    for i, spec in enumerate(r.tools):
        function = load_function(spec, f"tool rollout.tools[{i}] =")
        name = callable_name(function)
        if name in play.functions:
            raise EpisodeError(f"rollout.tools[{i}] = {spec!r}: a tool named {name!r} is listed already; the model "
                               "calls tools by name, so give each a name of its own")
        play.functions[name] = function
        play.schemas.append(tool_schema(function, f"tool rollout.tools[{i}] = {spec!r}"))
    if r.environment:
        play.factory = load_function(r.environment, "environment rollout.environment =")
        probe = instance_of(play.factory)
        play.methods = [name for name, _ in inspect.getmembers(probe, callable)
                        if not name.startswith("_") and name not in ENVIRONMENT_HOOKS]
        for name in play.methods:
            if name in play.functions:
                raise EpisodeError(f"environment {r.environment!r}: its method {name!r} has the name of a tool in "
                                   "rollout.tools; rename one of them")
            play.schemas.append(tool_schema(getattr(probe, name), f"environment {r.environment!r}, method {name!r}"))
    return play


def instance_of(factory: Callable):
    """A new instance of the environment class, for one episode (or a look at its methods)."""
    try:
        return factory()
    except Exception as e:
        raise EpisodeError(f"environment {callable_name(factory)}() raised {type(e).__name__}: {e}; an environment "
                           "class is built with no arguments, one instance per episode (rollout.environment)") from e


def _resolved(value):
    """An async tool's (or environment method's) result awaited; a sync one's as it is."""
    return await_all({0: value})[0] if inspect.isawaitable(value) else value


def _run(seconds: float, function: Callable, *args, **kwargs):
    """function(*args, **kwargs), awaited if async, given `seconds` (0: no limit): Overdue past them."""
    def run():
        return _resolved(function(*args, **kwargs))

    return within(seconds, run) if seconds else run()


@dataclass(frozen=True)
class ToolAnswer:
    """The tool message answering one call; whether the call failed (TRL's tool_failure: an
    unknown tool, bad arguments, an exception, no answer in time), and whether it ran out of
    time (its effect on the instance unknown: not replayed)."""

    message: dict
    failed: bool
    timed_out: bool = False


def call_tool(tools: dict[str, Callable], call: dict, timeout: float = 0.0) -> ToolAnswer:
    """The answer to one parsed call, given `timeout` seconds (0: no limit)."""
    function = call.get("function", {})
    name = function.get("name") or "unknown"
    try:
        if "error" in call:  # a call the parser could not read
            raise ValueError(call["error"])
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        return ToolAnswer(_tool_message(name, _run(timeout, tools[name], **function.get("arguments", {}))), False)
    except Overdue:
        log.warning("tool %s did not answer within rollout.tool_timeout_seconds=%g s: answered as a failed call "
                    "(its thread is left running)", name, timeout)
        return ToolAnswer(_tool_message(name, {"error": f"Tool {name} did not answer within {timeout:g} s."}), True,
                          True)
    except Exception as e:
        return ToolAnswer(_tool_message(name, {"error": str(e)}), True)


def _tool_message(name: str, result) -> dict:
    return {"role": "tool", "name": name, "content": str(result)}


# ---------------------------------------------------------------- the chat template's side


def parse_reply(tokenizer, text: str, schemas: list[dict]) -> dict:
    """The assistant message of a reply: its content and tool calls in TRL's form
    ({"type": "function", "function": {"name", "arguments"}}; an unreadable call holds
    "error"). The tokenizer's own parser where it has a response_template, else the
    documented <tool_call> format; no calls at all where no tool is offered (an environment
    that only answers in words sees every reply)."""
    if not schemas:
        return _assistant(text.strip(), [])
    if getattr(tokenizer, "response_template", None) is not None:
        # prefix="": the reply holds all the turn's text; a template that pre-writes part of
        # the reply in its generation prompt (an opening <think>) would want that text here.
        message = tokenizer.parse_response(text, prefix="", tools=schemas)
        calls = [c if "function" in c else {"type": "function", "function": c} for c in message.get("tool_calls") or []]
        return _assistant(message.get("content") or "", calls)
    return _assistant(TOOL_CALL.sub("", text).strip(), [_call(body) for body in TOOL_CALL.findall(text)])


def _assistant(content: str, calls: list[dict]) -> dict:
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def _call(body: str) -> dict:
    fix = 'write <tool_call>{"name": <the tool>, "arguments": {<name>: <value>, ...}}</tool_call>'
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError as e:
        return {"type": "function", "function": {}, "error": f"the tool call is not JSON ({e}); {fix}"}
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) \
            or not isinstance(parsed.get("arguments", {}), dict):
        return {"type": "function", "function": {}, "error": f"the tool call has no name or arguments; {fix}"}
    return {"type": "function", "function": {"name": parsed["name"], "arguments": parsed.get("arguments", {})}}


def renders_tools(tokenizer, schemas: list[dict], template_kwargs: dict) -> bool:
    """Whether the chat template shows `tools=` to the model (SmolLM2's ignores them)."""
    probe = [{"role": "user", "content": "?"}]
    with_tools = tokenizer.apply_chat_template(probe, tools=schemas, tokenize=False, **template_kwargs)
    return with_tools != tokenizer.apply_chat_template(probe, tokenize=False, **template_kwargs)


class Chat:
    """Conversations as the chat template renders them, the tools shown its way."""

    def __init__(self, tokenizer, play: Play, data: DataConfig, eos: list[int]):
        self.tokenizer, self.play, self.data, self.eos = tokenizer, play, data, set(eos)
        self.native = bool(play.schemas) and renders_tools(tokenizer, play.schemas, data.chat_template_kwargs)

    @property
    def tools(self) -> list[dict] | None:
        return self.play.schemas if self.native else None

    def opening(self, prompt: Prompt, reset: str | None) -> list[dict]:
        """The prompt's messages, the environment's reset string appended to the last user
        message (as TRL), and the tools described in the system message for a template that
        does not render them."""
        messages = prompt_messages(prompt, self.data)
        if messages is None:
            raise DatasetError(f"prompt {prompt.index}: multi-turn episodes are conversations, but string prompts go "
                               "to the model as they are (data.chat_template=false); set data.chat_template=true")
        users = [m for m in messages if m["role"] == "user"]
        if reset and users:
            users[-1]["content"] += reset
        if self.play.schemas and not self.native:
            described = TOOLS_SYSTEM_MESSAGE.format(schemas="\n".join(json.dumps(s) for s in self.play.schemas))
            if messages[0]["role"] == "system":
                messages[0]["content"] += "\n\n" + described
            else:
                messages.insert(0, {"role": "system", "content": described})
        return messages

    def prompt_ids(self, prompt: Prompt, opening: list[dict]) -> list[int]:
        return render_messages(self.tokenizer, opening, prompt, self.data, self.tools)

    def continuation(self, before: list[dict], after: list[dict]) -> list[int]:
        """The token ids the template puts after the model's last reply (`before` ends with
        it) to render `after`, up to the next generation prompt."""
        prefix, full = self._ids(before, False), self._ids(after, True)
        ends = [i for i, t in enumerate(prefix) if t in self.eos]
        if ends:  # the model's reply ended at its end-of-turn token; what the template adds after it is ours
            prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise EpisodeError(
                "the chat template is not prefix-preserving: rendering the next turn changes how it renders the "
                "turns before (e.g. it drops earlier reasoning), so the episode's tokens would not be the "
                "conversation the model reads. Use a model whose chat template renders each turn the same whatever "
                "follows (TRL swaps in such a training template for Qwen3), or single-turn rollouts "
                "(rollout.max_turns=1, no rollout.tools or rollout.environment)")
        return full[len(prefix):]

    def _ids(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=generation_prompt,
                                                       tokenize=True, return_dict=True,
                                                       **self.data.chat_template_kwargs)["input_ids"])


# ---------------------------------------------------------------- episodes


@dataclass
class Episode:
    """An episode up to the model's next reply (or its end): its messages after the opening
    (TRL's multi-turn completion), the environment's actions to replay ("tools", calls) or
    ("respond", messages seen), and its tool calls and their failures."""

    messages: list[dict] = field(default_factory=list)
    actions: list[tuple[str, object]] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None

    @property
    def answer(self) -> str:
        """The episode's last reply's content: what single-answer rewards score."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


class Episodes:
    """One batch of prompts' episodes: their prompt ids, the environment's answers to the
    sampler (`respond`, rollout.episodes' callback) and each episode's outcome."""

    def __init__(self, play: Play, chat: Chat, prompts: list[Prompt]):
        self.play, self.chat, self.prompts = play, chat, prompts
        self.rows = [{"prompt": p.question, **p.columns} for p in prompts]
        resets = [self._reset(i)[1] for i in range(len(prompts))]
        # Each opening within data.max_prompt_tokens: refused, or its prompt's text cut (data.prompt_truncation).
        fitted = [fit_prompt(p, lambda q, reset=reset: chat.prompt_ids(q, chat.opening(q, reset)), chat.tokenizer,
                             chat.data) for p, reset in zip(prompts, resets)]
        self.prompts, self._prompt_ids = [p for p, _ in fitted], [ids for _, ids in fitted]
        self.openings = [chat.opening(p, reset) for p, reset in zip(self.prompts, resets)]
        # Per tree: the episodes waiting for the model's reply, by their completion so far.
        self.waiting: list[dict[tuple[int, ...], Episode]] = [{(): Episode()} for _ in prompts]

    def prompt_ids(self) -> list[list[int]]:
        return self._prompt_ids

    def respond(self, tree: int, completion: list[int]) -> list[int] | None:
        """The environment's tokens after the episode's last reply, or None: it ends."""
        episode, reply = self._replied(tree, completion)
        instance, errors = self._replayed(tree, episode), 0
        if "tool_calls" in reply:
            answers, errors, replayed = self._tools(instance, reply["tool_calls"])
            action = ("tools", replayed)
        elif self.play.answers:
            said = self._hook(tree, "respond", instance.respond, self.openings[tree] + episode.messages + [reply])
            answers = None if said is None else [{"role": "user", "content": str(said)}]
            action = ("respond", len(episode.messages) + 1)
        else:
            answers = None
        if answers is None:
            return None
        before = episode.messages + [reply]
        ids = self.chat.continuation(self.openings[tree] + before, self.openings[tree] + before + answers)
        if len(ids) > self.play.max_answer_tokens:
            log.warning("the environment's answer to an episode of prompt %d is %d tokens, more than "
                        "rollout.max_environment_tokens=%d: not shown, the episode ends at the reply before it",
                        self.prompts[tree].index, len(ids), self.play.max_answer_tokens)
            return None
        calls = len(reply.get("tool_calls", []))
        self.waiting[tree][tuple(completion + ids)] = Episode(before + answers, episode.actions + [action],
                                                              episode.tool_calls + calls, episode.tool_errors + errors)
        return ids

    def outcome(self, tree: int, completion: list[int]) -> Episode:
        """The ended episode whose completion this is: its messages, tool figures and the
        environment's reward. A respond-style environment sees the last reply too (its
        answer unused), so that get_reward can judge it; the last reply's tool calls are not
        run (TRL's: no iterations left)."""
        episode, reply = self._replied(tree, completion)
        ended = Episode(episode.messages + [reply], episode.actions, episode.tool_calls, episode.tool_errors)
        if self.play.factory is not None:
            instance = self._replayed(tree, episode)
            if self.play.answers and "tool_calls" not in reply:
                self._hook(tree, "respond", instance.respond, self.openings[tree] + ended.messages)
            if self.play.rewards:
                ended.reward = self._reward(tree, self._hook(tree, "get_reward", instance.get_reward))
        return ended

    def _reward(self, tree: int, value) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise EpisodeError(f"environment {callable_name(self.play.factory)}.get_reward() returned {value!r} for an "
                               f"episode of prompt {self.prompts[tree].index}; it must return a finite float")
        return float(value)

    def _replied(self, tree: int, completion: list[int]) -> tuple[Episode, dict]:
        """The episode the completion continues (the longest waiting history it extends)
        and the model's reply after it, as an assistant message."""
        history = max((h for h in self.waiting[tree] if completion[:len(h)] == list(h)), key=len)
        text = self.chat.tokenizer.decode(completion[len(history):], skip_special_tokens=True)
        return self.waiting[tree][history], parse_reply(self.chat.tokenizer, text, self.play.schemas)

    def _reset(self, tree: int):
        """A fresh environment instance for the tree's row, reset; and what reset returned."""
        if self.play.factory is None:
            return None, None
        instance = self._hook(tree, "construction", instance_of, self.play.factory)
        resets = callable(getattr(instance, "reset", None))
        said = self._hook(tree, "reset", instance.reset, **self.rows[tree]) if resets else None
        return instance, None if said is None else str(said)

    def _hook(self, tree: int, hook: str, function: Callable, *args, **kwargs):
        """A call of the environment (`hook`: its construction, reset, respond, get_reward) for
        an episode of the tree's prompt, given rollout.tool_timeout_seconds: EpisodeError past them."""
        try:
            return _run(self.play.timeout, function, *args, **kwargs)
        except Overdue:
            raise EpisodeError(f"environment {callable_name(self.play.factory)}: its {hook} did not return "
                               f"within rollout.tool_timeout_seconds={self.play.timeout:g} s (an episode of "
                               f"prompt {self.prompts[tree].index}); a call that hangs stops the rollouts here: fix "
                               "it, or raise rollout.tool_timeout_seconds if it is only slow") from None

    def _replayed(self, tree: int, episode: Episode):
        """A fresh instance brought to the episode's state by replaying its actions."""
        instance, _ = self._reset(tree)
        for kind, detail in episode.actions:
            if kind == "tools":
                self._tools(instance, detail)
            else:
                self._hook(tree, "respond", instance.respond, self.openings[tree] + episode.messages[:detail])
        return instance

    def _tools(self, instance, calls: list[dict]) -> tuple[list[dict], int, list[dict]]:
        """The tool messages answering the calls, how many of the calls failed, and the calls
        to replay into a later instance (those that answered in time)."""
        tools = self.play.tools(instance)
        answers = [call_tool(tools, call, self.play.timeout) for call in calls]
        return ([a.message for a in answers], sum(a.failed for a in answers),
                [call for call, a in zip(calls, answers) if not a.timed_out])
