"""The chat template's side of episodes: how a model writes tool calls, and what the template
renders around the environment's answers.

**Tool calls.** A reply's calls are read by the tokenizer's own parser where it has one
(`tokenizer.response_template`, transformers' `parse_response`), else by the parser of its
family (`rollout.tool_call_format`, "auto": told by the chat template's text):

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number (Hermes,
  Qwen2.5, and the documented format for templates that show no tool format, SmolLM2's);
- qwen3: the same, after a `<think>...</think>` block read as the reply's reasoning;
- llama3: one JSON object `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or
  alone (Llama 3.1 / 3.2; their template renders one call per reply);
- mistral: `[TOOL_CALLS]` and a JSON list of `{"name", "arguments", "id"}` (Mistral v0.3),
  or `[TOOL_CALLS]name[ARGS]{...}` per call (later Mistral tokenizers).

A call that cannot be read (not JSON, no name, no closing tag) becomes an error the model
sees as the tool's answer (TRL's `{'error': ...}`), never a failure of the run. The reply is
decoded with its special tokens (the family's markers are special tokens), less its final
end-of-turn token.

**Rendering.** The environment's tokens are the template's rendering of what it appended:
the conversation rendered whole, less its rendering before (trimmed at the reply's
end-of-turn token, as TRL's `_get_tool_suffix_ids`). A template that renders earlier turns
differently once more follow is not prefix-preserving: Qwen3's own (it drops the thinking
block of earlier replies) is swapped for the training template lsreplay ships
(`chat_templates/`), any other is refused with the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import string
from pathlib import Path

from transformers.utils.chat_parsing import parse_response

from lsreplay.core.config import ConfigError, DataConfig
from lsreplay.data.rendering import prompt_messages, render_messages
from lsreplay.data.sources import DatasetError, Prompt

log = logging.getLogger(__name__)

TEMPLATES = Path(__file__).with_name("chat_templates")
# Model templates that are not prefix-preserving, by the sha256 of their text, and the training
# template that replaces each (chat_templates/README.md says how each was derived).
TRAINING_TEMPLATES = {"a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": "qwen3_training.jinja"}
# For templates that ignore `tools=` (SmolLM2's): the tools described in the system message.
TOOLS_SYSTEM_MESSAGE = (
    "You can call these functions (JSON schemas):\n<tools>\n{schemas}\n</tools>\n"
    "To call one, write <tool_call>{{\"name\": <its name>, \"arguments\": <a JSON object of its arguments>}}"
    "</tool_call>; its result comes back in a tool message.")
HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)
MISTRAL_NAMED_CALL = re.compile(r"\s*([^\[\s]+)\[ARGS\]")
ID_CHARACTERS = string.ascii_letters + string.digits


class EpisodeError(ConfigError):
    """A tool, environment or chat template that multi-turn episodes cannot use as given."""


class MalformedCall(ValueError):
    """A tool call the reply's format does not read; its message says what was expected."""


# ---------------------------------------------------------------- reading a reply


def tool_call_format(tokenizer, configured: str = "auto") -> str:
    """The format the replies' tool calls are read in: `configured`, or for "auto" the
    tokenizer's own parser ("response_template") where it has one, else the family its chat
    template's text names."""
    if configured != "auto":
        return configured
    if getattr(tokenizer, "response_template", None) is not None:
        return "response_template"
    text = template_text(tokenizer)
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or '"parameters": ' in text:
        return "llama3"
    if "<tool_call>" in text and "<think>" in text:
        return "qwen3"
    return "hermes"


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template.get("default", "") if isinstance(template, dict) else template


def parse_reply(tokenizer, ids: list[int], eos: set[int], schemas: list[dict], format: str) -> dict:
    """The assistant message of a reply (its token ids): content, tool calls in TRL's form
    ({"type": "function", "function": {"name", "arguments"}}, "id" where the format has one),
    "reasoning_content" where the format has reasoning. A call that cannot be read holds
    "error" and its text. No calls at all where no tool is offered."""
    text = tokenizer.decode(ids[:-1] if ids and ids[-1] in eos else ids, skip_special_tokens=False)
    if not schemas:
        return _assistant(text.strip(), [])
    try:
        if format == "response_template":
            message = parse_response(text, tokenizer.response_template, prefix="", tools=schemas)
            calls = [_checked(c.get("function", c), text) for c in message.get("tool_calls") or []]
            return _assistant(message.get("content") or "", calls, message.get("reasoning_content"))
        return PARSERS[format](text)
    except Exception as e:  # noqa: BLE001 - whatever the parser raised, the model sees it as the call's error
        return _assistant("", [_malformed(f"the reply could not be read as {format} tool calls ({e})", text)])


def _hermes(text: str, reasoning: str | None = None) -> dict:
    calls = []
    for body, closing in HERMES_CALL.findall(text):
        if not closing:
            calls.append(_malformed("the tool call has no closing </tool_call>; write <tool_call>{\"name\": <the "
                                    "tool>, \"arguments\": {...}}</tool_call>", body))
        else:
            calls.append(_json_call(body, "arguments",
                                    '<tool_call>{"name": <the tool>, "arguments": {...}}</tool_call>'))
    return _assistant(HERMES_CALL.sub("", text).strip(), calls, reasoning)


def _qwen3(text: str) -> dict:
    thought = THINK.match(text)
    if thought is None:
        return _hermes(text)
    return _hermes(text[thought.end():], thought.group(1).strip("\n"))


def _llama3(text: str) -> dict:
    body = text.removeprefix("<|python_tag|>").strip()
    if not text.startswith("<|python_tag|>") and not body.startswith("{"):
        return _assistant(text.strip(), [])
    fix = '{"name": <the tool>, "parameters": {...}}, one call per reply'
    try:
        parsed, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        return _assistant("", [_malformed(f"the tool call is not JSON ({e}); write {fix}", body)])
    if body[end:].strip():
        return _assistant("", [_malformed(f"text after the tool call's JSON object ({body[end:].strip()[:40]!r}); "
                                          f"write {fix}", body)])
    return _assistant("", [_call(parsed, "parameters", fix, body)])


def _mistral(text: str) -> dict:
    content, _, tail = text.partition("[TOOL_CALLS]")
    if not _:
        return _assistant(text.strip(), [])
    fix = '[TOOL_CALLS][{"name": <the tool>, "arguments": {...}}]'
    calls = []
    if tail.lstrip().startswith("["):
        try:
            parsed = json.loads(tail)
        except json.JSONDecodeError as e:
            parsed = None
            calls.append(_malformed(f"the tool calls are not a JSON list ({e}); write {fix}", tail))
        if isinstance(parsed, list):
            calls += [_call(c, "arguments", fix, tail) for c in parsed] or [_malformed(f"no call; write {fix}", tail)]
        elif parsed is not None:
            calls.append(_malformed(f"the tool calls are not a JSON list; write {fix}", tail))
    else:  # [TOOL_CALLS]name[ARGS]{...}, once per call
        for part in tail.split("[TOOL_CALLS]"):
            named = MISTRAL_NAMED_CALL.match(part)
            if named is None:
                calls.append(_malformed("expected [TOOL_CALLS]<name>[ARGS]{...}", part))
                continue
            calls.append(_json_call(part[named.end():], None, "[TOOL_CALLS]<name>[ARGS]{...}", named.group(1)))
    for i, call in enumerate(calls):  # Mistral's template wants an id of 9 letters and digits on every call
        if not (isinstance(call.get("id"), str) and len(call["id"]) == 9 and call["id"].isalnum()):
            call["id"] = call_id(text, i)
    return _assistant(content.strip(), calls)


def call_id(text: str, index: int) -> str:
    """A call id of 9 letters and digits, a function of the reply and the call's place."""
    digest = int.from_bytes(hashlib.sha256(f"{index}:{text}".encode()).digest()[:8], "big")
    return "".join(ID_CHARACTERS[(digest >> (6 * k)) % len(ID_CHARACTERS)] for k in range(9))


PARSERS = {"hermes": _hermes, "qwen3": _qwen3, "llama3": _llama3, "mistral": _mistral}


def _json_call(body: str, arguments_key: str | None, fix: str, name: str | None = None) -> dict:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError as e:
        return _malformed(f"the tool call is not JSON ({e}); write {fix}", body)
    if name is not None:  # the name was outside the JSON, which holds the arguments
        parsed = {"name": name, "arguments": parsed}
    return _call(parsed, arguments_key or "arguments", fix, body)


def _call(parsed, arguments_key: str, fix: str, text: str) -> dict:
    arguments = parsed.get(arguments_key, parsed.get("arguments", {})) if isinstance(parsed, dict) else None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or not isinstance(arguments, dict):
        return _malformed(f"the tool call has no name or no {arguments_key} object; write {fix}", text)
    call = {"type": "function", "function": {"name": parsed["name"], "arguments": arguments}}
    if isinstance(parsed.get("id"), str):
        call["id"] = parsed["id"]
    return call


def _checked(function, text: str) -> dict:
    """A call transformers' parser read, in TRL's form, or malformed."""
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not isinstance(function.get("arguments", {}), dict):
        return _malformed("the tool call has no name or no arguments object", text)
    return {"type": "function", "function": {"name": function["name"], "arguments": function.get("arguments", {})}}


def _malformed(error: str, text: str) -> dict:
    return {"type": "function", "function": {}, "error": error, "text": text}


def _assistant(content: str, calls: list[dict], reasoning: str | None = None) -> dict:
    """The reply as an assistant message. A malformed call is not a call the template could
    render: its text stays in the content (the tool's error still answers it)."""
    unread = [c["text"] for c in calls if "error" in c]
    message = {"role": "assistant", "content": "\n".join([content, *unread]).strip() if unread else content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def rendered(message: dict) -> dict:
    """The message as the chat template renders it: only the calls it could read."""
    if "tool_calls" not in message:
        return message
    calls = [{k: v for k, v in c.items() if k != "text"} for c in message["tool_calls"] if "error" not in c]
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, **({"tool_calls": calls} if calls else {})}


# ---------------------------------------------------------------- rendering a conversation


def renders_tools(tokenizer, schemas: list[dict], template_kwargs: dict, template: str | None = None) -> bool:
    """Whether the chat template shows `tools=` to the model (SmolLM2's ignores them)."""
    probe = [{"role": "user", "content": "?"}]
    with_tools = tokenizer.apply_chat_template(probe, tools=schemas, tokenize=False, chat_template=template,
                                               **template_kwargs)
    return with_tools != tokenizer.apply_chat_template(probe, tokenize=False, chat_template=template, **template_kwargs)


def training_template(tokenizer) -> str | None:
    """The shipped training template that replaces this tokenizer's chat template, if any."""
    digest = hashlib.sha256(template_text(tokenizer).encode()).hexdigest()
    name = TRAINING_TEMPLATES.get(digest)
    return None if name is None else (TEMPLATES / name).read_text()


class Chat:
    """Conversations as the chat template renders them (the training template where lsreplay
    ships one for it), the tools shown its way, replies read in its tool-call format."""

    def __init__(self, tokenizer, schemas: list[dict], data: DataConfig, eos: list[int], format: str = "auto"):
        self.tokenizer, self.schemas, self.data, self.eos = tokenizer, schemas, data, set(eos)
        self.template = training_template(tokenizer)
        if self.template is not None:
            log.info("episodes render with lsreplay's training template for this model's chat template "
                     "(prefix-preserving; lsreplay/data/chat_templates/README.md)")
        self.format = tool_call_format(tokenizer, format)
        self.native = bool(schemas) and renders_tools(tokenizer, schemas, data.chat_template_kwargs, self.template)

    @property
    def tools(self) -> list[dict] | None:
        return self.schemas if self.native else None

    def reply(self, ids: list[int]) -> dict:
        """The assistant message of a reply's token ids (parse_reply)."""
        return parse_reply(self.tokenizer, ids, self.eos, self.schemas, self.format)

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
        if self.schemas and not self.native:
            described = TOOLS_SYSTEM_MESSAGE.format(schemas="\n".join(json.dumps(s) for s in self.schemas))
            if messages[0]["role"] == "system":
                messages[0]["content"] += "\n\n" + described
            else:
                messages.insert(0, {"role": "system", "content": described})
        return messages

    def prompt_ids(self, prompt: Prompt, opening: list[dict]) -> list[int]:
        return render_messages(self.tokenizer, opening, prompt, self.data, self.tools, self.template)

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
                "turns before (e.g. it drops earlier reasoning, or moves the system message), so the episode's "
                "tokens would not be the conversation the model reads. lsreplay ships training templates for the "
                "templates it knows (Qwen3's: lsreplay/data/chat_templates); for this one, give the model a chat "
                "template that renders each turn the same whatever follows (the tokenizer's chat_template in its "
                "folder), or use single-turn rollouts (rollout.max_turns=1, no rollout.tools or rollout.environment)")
        return full[len(prefix):]

    def _ids(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template([rendered(m) for m in messages], tools=self.tools,
                                                       add_generation_prompt=generation_prompt, tokenize=True,
                                                       return_dict=True, chat_template=self.template,
                                                       **self.data.chat_template_kwargs)["input_ids"])
