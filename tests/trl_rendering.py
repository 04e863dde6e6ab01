"""TRL's rendering of a dataset's prompt, by the rules of its source: GRPOTrainer.
_tokenize_prompts (TRL 1.6 to 1.16, trl/trainer/grpo_trainer.py) sends a batch of message
prompts through `processing_class.apply_chat_template(conversation=prompts,
tools=self.tools or None, chat_template=self.chat_template, add_generation_prompt=True,
tokenize=True, return_dict=True, **self.chat_template_kwargs)` and string prompts through
`processing_class(text=prompts)` (the tokenizer's own special tokens). With trl installed
(the dev extra), test_formats checks these rules against TRL's own function."""

from __future__ import annotations


def trl_prompt_ids(tokenizer, prompt, chat_template_kwargs: dict | None = None) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(text=[prompt])["input_ids"][0])
    return list(tokenizer.apply_chat_template(conversation=[prompt], tools=None, chat_template=None,
                                              add_generation_prompt=True, tokenize=True, return_dict=True,
                                              **(chat_template_kwargs or {}))["input_ids"][0])


def trls_own_prompt_ids(tokenizer, prompts: list, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """TRL's own GRPOTrainer._tokenize_prompts on a batch of prompts, with the attributes of a
    text-only trainer without tools or environments that it reads."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    trainer = SimpleNamespace(processing_class=tokenizer, _is_vlm=False, environment_factories=None, tools=None,
                              chat_template=None, chat_template_kwargs=chat_template_kwargs or {})
    return [list(ids) for ids in GRPOTrainer._tokenize_prompts(trainer, prompts)[0]]


# Qwen3's chat template ends its generation prompt so: enable_thinking=false (a
# chat_template_kwargs entry) opens the answer with an empty think block.
_THINKING_OFF = ("{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
                 "{% endif %}")


def save_llama_style_tokenizer(source, out):
    """The real SmolLM2 tokenizer as a Llama-family one (it adds BOS to what it tokenizes, as
    TRL tokenizes string prompts) whose chat template reads Qwen3's enable_thinking; saved to `out`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, add_bos_token=True)
    generation_prompt = "{{ '<|im_start|>assistant\n' }}"  # the template's strings hold real newlines
    assert generation_prompt in tokenizer.chat_template
    tokenizer.chat_template = tokenizer.chat_template.replace(generation_prompt, generation_prompt + _THINKING_OFF)
    tokenizer.save_pretrained(out)
    return tokenizer
