"""A reward model as a reward function, as TRL's GRPOTrainer takes one: `reward.functions`
names a local folder, or a model id found in the local Hugging Face cache (nothing is
downloaded at run time), of a sequence-classification model loaded with num_labels=1.

Scored as TRL scores it (GRPOTrainer._calculate_rewards, TRL 1.16): the prompt as the
dataset holds it followed by the completion (a string prompt and the completion text
concatenated; message prompts and the assistant's message through the reward tokenizer's
chat template, with data.chat_template_kwargs), tokenized without added special tokens,
padded on the right; the reward is the first logit. It is named as TRL names it, by the
last part of its path or id.
"""

from __future__ import annotations

import functools

import torch

from lsreplay.data.reward_functions import RewardError
from lsreplay.data.sources import Prompt

# Completions scored per forward pass: bounds the memory a batch of long answers takes.
BATCH = 16


@functools.lru_cache(maxsize=4)
def _load(spec: str, device: str):
    """The model and tokenizer, once per process and device (every rollout shard scores with them)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(spec, num_labels=1, local_files_only=True)
    except OSError as e:
        raise RewardError(f"reward model {spec!r}: not a model folder here, nor a model id in the local Hugging Face "
                          f"cache ({e}); nothing is downloaded at run time: download it first (hf download {spec}) "
                          "or give the folder that holds it") from e
    if tokenizer.pad_token_id is None:  # as TRL: the end-of-sequence token pads
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer


class RewardModel:
    """Calling it scores (prompt, completion text) pairs; `name` is TRL's name for it."""

    def __init__(self, spec: str, device: torch.device | str = "cpu", chat_template_kwargs: dict | None = None):
        self.model, self.tokenizer = _load(spec, str(device))
        self.name = str(getattr(self.model.config, "_name_or_path", spec)).rstrip("/").split("/")[-1]
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def text(self, prompt: Prompt, completion: str) -> str:
        if isinstance(prompt.question, str):
            return prompt.question + completion
        messages = [*prompt.question, {"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **self.chat_template_kwargs)

    def __call__(self, pairs: list[tuple[Prompt, str]]) -> list[float]:
        texts = [self.text(p, c) for p, c in pairs]
        scores = []
        for start in range(0, len(texts), BATCH):
            batch = self.tokenizer(text=texts[start:start + BATCH], return_tensors="pt", padding=True,
                                   padding_side="right", add_special_tokens=False).to(self.model.device)
            with torch.inference_mode():
                scores += self.model(**batch).logits[:, 0].float().tolist()
        return scores
