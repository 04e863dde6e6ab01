"""What the model sees of a prompt: its token ids, as TRL's GRPOTrainer renders a dataset's
prompt (GRPOTrainer._tokenize_prompts, TRL 1.6 to 1.16).

A list of chat messages goes through the tokenizer's chat template with the generation
prompt (`apply_chat_template(..., add_generation_prompt=True, tokenize=True)` with
`data.chat_template_kwargs`, TRL's chat_template_kwargs); a string does too with
`data.chat_template` (as the user's message), and is tokenized as it is otherwise, with the
tokenizer's own special tokens (`tokenizer(text)`: BOS on Llama-family tokenizers, as TRL).
Nothing is added but what `data` says: `system_prompt` (a system message put first, where
the prompt has none), `example_messages` (earlier turns put before the prompt's own, after
its system message) and `answer_instruction` (appended to the prompt, or to its last user
message). The first and last are lsreplay's own for the prompts it generates and empty for
`data.path` (lsreplay.core.config.settle).

A prompt longer than `data.max_prompt_tokens` once rendered is refused, or with
`data.prompt_truncation` left, right or middle cut in its own text (the string, or its last
user message) by as many tokens, then rendered again: the template and what `data` adds stay
whole (`fit_prompt`). Each cut prompt is logged once per process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from jinja2 import TemplateError

from lsreplay.core.config import DataConfig
from lsreplay.data.sources import DatasetError, Prompt

log = logging.getLogger(__name__)
# Renders after a cut: the text's tokens do not add up exactly once decoded and rendered
# again (merges across the cut), so a second cut takes what the first left over.
CUT_TRIES = 4


def prompt_messages(prompt: Prompt, data: DataConfig) -> list[dict] | None:
    """The chat messages the template renders, with what `data` adds; None for a string
    that goes to the model as it is."""
    question = prompt.question
    if isinstance(question, str) and not data.chat_template:
        for key in ("system_prompt", "example_messages"):
            if getattr(data, key):
                raise DatasetError(f"prompt {prompt.index}: data.{key} is set, but string prompts go to the model as "
                                   "they are (data.chat_template=false), where there is no conversation to put it in; "
                                   f"empty data.{key} or set data.chat_template=true")
        return None
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else [dict(m) for m in question]
    if data.answer_instruction:
        users = [m for m in messages if m["role"] == "user"]
        if not users:
            raise DatasetError(f"prompt {prompt.index} has no user message to append data.answer_instruction to; "
                               "set data.answer_instruction='' or give every prompt a user message")
        users[-1]["content"] += data.answer_instruction
    if data.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": data.system_prompt})
    first = 1 if messages and messages[0]["role"] == "system" else 0
    messages[first:first] = [dict(m) for m in data.example_messages]
    return messages


def render_prompt(tokenizer, prompt: Prompt, data: DataConfig) -> list[int]:
    """The prompt's token ids, as TRL's GRPOTrainer tokenizes it, within data.max_prompt_tokens (`fit_prompt`)."""
    return fit_prompt(prompt, lambda p: rendered_ids(tokenizer, p, data), tokenizer, data)[1]


def rendered_ids(tokenizer, prompt: Prompt, data: DataConfig) -> list[int]:
    """The prompt's token ids as TRL's GRPOTrainer tokenizes it, however many (`render_prompt` fits them)."""
    messages = prompt_messages(prompt, data)
    if messages is None:
        return tokenizer(prompt.question + data.answer_instruction)["input_ids"]
    return render_messages(tokenizer, messages, prompt, data)


def render_messages(tokenizer, messages: list[dict], prompt: Prompt, data: DataConfig,
                    tools: list[dict] | None = None, template: str | None = None) -> list[int]:
    """The token ids of `prompt`'s chat messages (as given: an episode's opening adds to
    them) with the generation prompt, and the tool schemas where the template renders them;
    `template`: a chat template other than the tokenizer's (episodes' training templates)."""
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=True, chat_template=template,
                                            **data.chat_template_kwargs)["input_ids"]
    except (ValueError, TemplateError) as e:  # no chat template, or one that refuses these messages
        raise DatasetError(f"prompt {prompt.index}: the tokenizer's chat template cannot render it ({e}); give "
                           "a model with a chat template, or string prompts with data.chat_template=false") from e
    return list(ids)


_cut_logged: set[tuple[str, int]] = set()


def fit_prompt(prompt: Prompt, render: Callable[[Prompt], list[int]], tokenizer,
               data: DataConfig) -> tuple[Prompt, list[int]]:
    """`prompt` and its ids `render(prompt)` if they fit data.max_prompt_tokens; else, with
    data.prompt_truncation left, right or middle, the prompt with the excess tokens cut from
    that part of its own text, rendered again; else DatasetError naming the prompt and the fix."""
    ids, limit, side = render(prompt), data.max_prompt_tokens, data.prompt_truncation
    if len(ids) <= limit:
        return prompt, list(ids)
    if side == "error":
        raise DatasetError(f"prompt {prompt.index} has {len(ids)} tokens, more than data.max_prompt_tokens={limit}; "
                           "raise the limit, use shorter prompts, or cut them: data.prompt_truncation=left, right or "
                           "middle")
    text = _text(prompt)
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut, first = 0, len(ids)
    for _ in range(CUT_TRIES):
        cut += len(ids) - limit
        if cut >= len(text_ids):
            raise DatasetError(f"prompt {prompt.index}: {first} tokens, and without its own text still more than "
                               f"data.max_prompt_tokens={limit} (the chat template, system prompt, examples and answer "
                               "instruction take the rest); raise the limit or shorten what data adds")
        fitted = _with_text(prompt, tokenizer.decode(_kept(text_ids, cut, side)))
        ids = render(fitted)
        if len(ids) <= limit:
            if (side, prompt.index) not in _cut_logged:
                _cut_logged.add((side, prompt.index))
                log.warning("prompt %d: %d tokens, more than data.max_prompt_tokens=%d: cut %d tokens of its text at "
                            "the %s (data.prompt_truncation=%s)", prompt.index, first, limit, cut, side, side)
            return fitted, list(ids)
    raise DatasetError(f"prompt {prompt.index}: {first} tokens, still more than data.max_prompt_tokens={limit} after "
                       f"{CUT_TRIES} cuts of its text; raise the limit or shorten the prompt")


def _kept(ids: list[int], cut: int, side: str) -> list[int]:
    """`ids` less `cut` of them, taken from its left, right or middle."""
    keep = len(ids) - cut
    if side == "left":
        return ids[cut:]
    if side == "right":
        return ids[:keep]
    return ids[:keep - keep // 2] + ids[len(ids) - keep // 2:]


def _text(prompt: Prompt) -> str:
    """A prompt's own text: the string, or its last user message's content."""
    if isinstance(prompt.question, str):
        return prompt.question
    users = [m for m in prompt.question if m["role"] == "user"]
    if not users:
        raise DatasetError(f"prompt {prompt.index} has no user message whose text data.prompt_truncation could cut; "
                           "set data.prompt_truncation=error or give every prompt a user message")
    return users[-1]["content"]


def _with_text(prompt: Prompt, text: str) -> Prompt:
    if isinstance(prompt.question, str):
        return dataclasses.replace(prompt, question=text)
    messages = [dict(m) for m in prompt.question]
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last]["content"] = text
    return dataclasses.replace(prompt, question=messages)
