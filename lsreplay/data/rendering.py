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
"""

from __future__ import annotations

from jinja2 import TemplateError

from lsreplay.core.config import DataConfig
from lsreplay.data.sources import DatasetError, Prompt


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
    """The prompt's token ids, as TRL's GRPOTrainer tokenizes it."""
    messages = prompt_messages(prompt, data)
    if messages is None:
        return _within_limit(tokenizer(prompt.question + data.answer_instruction)["input_ids"], prompt, data)
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
    return _within_limit(ids, prompt, data)


def _within_limit(ids: list[int], prompt: Prompt, data: DataConfig) -> list[int]:
    if len(ids) > data.max_prompt_tokens:
        raise DatasetError(f"prompt {prompt.index} has {len(ids)} tokens, more than data.max_prompt_tokens="
                           f"{data.max_prompt_tokens}; raise the limit or use shorter prompts")
    return list(ids)
