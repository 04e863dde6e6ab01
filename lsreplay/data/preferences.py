"""Preference datasets for offline DPO (`algo.dpo_source=dataset`), in TRL's convention.

A row has `prompt`, `chosen` and `rejected` columns, either all text (TRL's "standard"
format: the prompt is tokenized as it is, each answer after it, ended by EOS) or chat
messages (TRL's "conversational" format: `prompt` a list of {"role", "content"} messages,
`chosen` and `rejected` the assistant's messages; the model's chat template renders them,
and an answer is what the template adds after the prompt with its generation prompt).

The two answers of a row share the prompt, so a row is a rollout tree of two leaves
(`preference_record`): the caching pass computes the prompt once, and replay runs it once
for both answers. The record has the shape of a sampled tree's, its rewards the
preference (chosen 1, rejected 0), so online and offline DPO pair leaves alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lsreplay.data.sources import DatasetError, _load, sample_rows

COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Preference:
    index: int  # row number in the dataset
    prompt: str | list  # text, or chat messages
    chosen: str | list
    rejected: str | list


class PreferenceSet:
    """The rows of a preference dataset (a .jsonl/.json/.parquet file or a save_to_disk folder)."""

    def __init__(self, table, path: Path):
        self._table, self.path = table, path

    @classmethod
    def from_file(cls, path: str | Path, split: str = "train") -> PreferenceSet:
        path = Path(path)
        table = _load(path, split)
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise DatasetError(f"{path}: a preference dataset for offline DPO needs the columns {list(COLUMNS)} "
                               f"(TRL's convention: text, or chat messages); {missing} missing, the file has "
                               f"{table.column_names}.")
        if len(table) == 0:
            raise DatasetError(f"{path}: the preference dataset has no rows.")
        return cls(table, path)

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, i: int) -> Preference:
        row = self._table[i]
        return Preference(index=i, **{c: row[c] for c in COLUMNS})

    def sample(self, step: int, batch_size: int, seed: int) -> list[Preference]:
        """The rows of `step`: a pure function of (seed, step), as prompts are drawn."""
        return [self[i] for i in sample_rows(len(self), step, batch_size, seed)]


def preference_record(tokenizer, pref: Preference, max_prompt_tokens: int, max_answer_tokens: int,
                      template_kwargs: dict | None = None) -> dict:
    """The tree record of one row: its prompt's token ids, the chosen and the rejected answer
    as two completions, the preference as rewards (chosen 1, rejected 0). The prompt is
    tokenized as the rollouts' prompts are (data.rendering) and as TRL 1.16's DPOTrainer
    tokenizes it (data_utils._tokenize): text with the tokenizer's own special tokens (BOS on
    Llama-family tokenizers), messages through the template with no more added. An answer
    longer than `max_answer_tokens` is cut there, unfinished (as a rollout cut at
    rollout.max_new_tokens). `template_kwargs`: data.chat_template_kwargs, as rollouts'
    prompts get them (TRL's DPOTrainer passes chat_template_kwargs alike)."""
    chat = not isinstance(pref.prompt, str)
    if chat != (not isinstance(pref.chosen, str)) or chat != (not isinstance(pref.rejected, str)):
        raise DatasetError(f"preference row {pref.index}: prompt, chosen and rejected must all be text or all chat "
                           "messages (TRL's standard or conversational format), not a mix")
    if chat:
        kwargs = template_kwargs or {}
        prompt_text = tokenizer.apply_chat_template(list(pref.prompt), add_generation_prompt=True, tokenize=False,
                                                    **kwargs)
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        answers = [_chat_answer(tokenizer, pref, prompt_text, a, kwargs) for a in (pref.chosen, pref.rejected)]
    else:
        prompt = tokenizer(pref.prompt)["input_ids"]
        answers = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                   for a in (pref.chosen, pref.rejected)]
    if not prompt or len(prompt) > max_prompt_tokens:
        raise DatasetError(f"preference row {pref.index}: its prompt has {len(prompt)} tokens; it needs at least one "
                           f"and at most data.max_prompt_tokens={max_prompt_tokens} (raise the limit or drop the row)")
    finished = [len(a) <= max_answer_tokens for a in answers]
    answers = [a[:max_answer_tokens] for a in answers]
    texts = [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
    return {"prompt_index": pref.index, "prompt_ids": prompt, "completions": answers, "logprobs": None,
            "finished": finished, "texts": texts, "rewards": [1.0, 0.0], "counts": [1, 1], "paths": [[0], [1]]}


def _chat_answer(tokenizer, pref: Preference, prompt_text: str, answer: list, template_kwargs: dict) -> list[int]:
    """The tokens the chat template adds after the prompt (and its generation prompt) for `answer`."""
    full = tokenizer.apply_chat_template(list(pref.prompt) + list(answer), tokenize=False, **template_kwargs)
    if not full.startswith(prompt_text):
        raise DatasetError(f"preference row {pref.index}: the chat template does not render the prompt as the start "
                           "of prompt + answer, so the answer's tokens cannot be told apart; give text columns")
    return tokenizer(full[len(prompt_text):], add_special_tokens=False)["input_ids"]


def check_preferences(cfg, tokenizer, rows: int = 16) -> None:
    """Before any work: the dataset at data.path loads with its columns, and its first rows
    make trees within data.max_prompt_tokens."""
    prefs = PreferenceSet.from_file(cfg.data.path, cfg.data.split)
    for i in range(min(rows, len(prefs))):
        try:
            preference_record(tokenizer, prefs[i], cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens,
                              cfg.data.chat_template_kwargs)
        except DatasetError as e:
            raise DatasetError(f"{prefs.path}: {e}") from None


def offline(cfg) -> bool:
    """Whether the run trains offline DPO from a preference dataset (no rollouts)."""
    return cfg.algo.name == "dpo" and cfg.algo.dpo_source == "dataset"
