"""What the model sees of a prompt: its token ids, read as TRL reads a dataset's prompt.

A list of chat messages goes through the tokenizer's chat template (continuing a last
assistant message, else with the generation prompt); a string does too with
`data.chat_template` (as the user's message), and goes as it is otherwise. Nothing is added
but what `data` says: `system_prompt` (a system message put first, where the prompt has
none) and `answer_instruction` (appended to the prompt, or to its last user message). The
defaults are lsreplay's own (a short system prompt and the <answer>-tag instruction its
reasoning-gym rewards read); set them empty for a dataset's prompts as they are.
"""

from __future__ import annotations

from lsreplay.core.config import DataConfig
from lsreplay.data.sources import DatasetError, Prompt


def prompt_text(tokenizer, prompt: Prompt, data: DataConfig) -> str:
    """The prompt as the text the model continues."""
    question = prompt.question
    if isinstance(question, str) and not data.chat_template:
        if data.system_prompt:
            raise DatasetError(f"prompt {prompt.index}: data.system_prompt is set, but string prompts go to the model "
                               "as they are (data.chat_template=false), where there is no system message to put it "
                               "in; set data.system_prompt='' or data.chat_template=true")
        return question + data.answer_instruction
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else [dict(m) for m in question]
    if data.answer_instruction:
        users = [m for m in messages if m["role"] == "user"]
        if not users:
            raise DatasetError(f"prompt {prompt.index} has no user message to append data.answer_instruction to; "
                               "set data.answer_instruction='' or give every prompt a user message")
        users[-1]["content"] += data.answer_instruction
    if data.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": data.system_prompt})
    continues = messages[-1]["role"] == "assistant"  # TRL: the model continues the last assistant message
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=not continues,
                                             continue_final_message=continues, tokenize=False)
    except ValueError as e:  # no chat template, or one that refuses these messages
        raise DatasetError(f"prompt {prompt.index}: the tokenizer's chat template cannot render it ({e}); give a "
                           "model with a chat template, or string prompts with data.chat_template=false") from e


def render_prompt(tokenizer, prompt: Prompt, data: DataConfig) -> list[int]:
    """The prompt's token ids (no special tokens added: the text or the template has them)."""
    ids = tokenizer(prompt_text(tokenizer, prompt, data), add_special_tokens=False)["input_ids"]
    if len(ids) > data.max_prompt_tokens:
        raise DatasetError(f"prompt {prompt.index} has {len(ids)} tokens, more than data.max_prompt_tokens="
                           f"{data.max_prompt_tokens}; raise the limit or use shorter prompts")
    return ids
