"""Preference datasets for offline DPO (`algo.dpo_source=dataset`), in TRL's convention.

A row has `prompt`, `chosen` and `rejected` columns, either all text (TRL's "standard"
format: prompt + answer tokenized whole, the answer ended by EOS) or chat messages (TRL's
"conversational" format: `prompt` a list of {"role", "content"} messages, `chosen` and
`rejected` the assistant's messages; the model's chat template renders them). A row gives
the tokens TRL's DPOTrainer gives it (`preference_record`).

The two answers of a row share the prompt, so a row is a rollout tree of two leaves
(`preference_record`): the caching pass computes the prompt once, and replay runs it once
for both answers. The record has the shape of a sampled tree's, its rewards the
preference (chosen 1, rejected 0), so online and offline DPO pair leaves alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from lsreplay.data.sources import DatasetError, _load, sample_rows

log = logging.getLogger(__name__)

COLUMNS = ("prompt", "chosen", "rejected")
_parted_warned = False  # whether a row's prompt and prompt + answer parted before the prompt's end (said once)


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
    as two completions, the preference as rewards (chosen 1, rejected 0). Tokenized as TRL
    1.16's DPOTrainer tokenizes a row (DPOTrainer._prepare_dataset): the prompt alone and
    prompt + answer whole (text with the tokenizer's own special tokens, BOS on Llama-family
    tokenizers, and the EOS text appended to an answer that does not end with it; messages
    through the chat template, which ends an answer as it does), the answer starting where
    the prompt's tokens and both prompt + answer's part. So a row gives TRL's tokens where an
    answer's first token merges with the prompt's last, or a template renders the prompt
    alone otherwise than followed by an answer (its generation prompt). An answer longer than
    `max_answer_tokens` is cut there, unfinished (as a rollout cut at
    rollout.max_new_tokens). `template_kwargs`: data.chat_template_kwargs, as rollouts'
    prompts get them (TRL's DPOTrainer passes chat_template_kwargs alike)."""
    chat = not isinstance(pref.prompt, str)
    if chat != (not isinstance(pref.chosen, str)) or chat != (not isinstance(pref.rejected, str)):
        raise DatasetError(f"preference row {pref.index}: prompt, chosen and rejected must all be text or all chat "
                           "messages (TRL's standard or conversational format), not a mix")
    if chat:
        kwargs = template_kwargs or {}

        def render(messages: list, **more) -> list[int]:
            return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs,
                                                      **more)["input_ids"])

        alone = render(list(pref.prompt), add_generation_prompt=True)
        wholes = [render(list(pref.prompt) + list(a)) for a in (pref.chosen, pref.rejected)]
    else:
        eos = tokenizer.eos_token
        alone = tokenizer(text=pref.prompt)["input_ids"]
        wholes = [tokenizer(text=pref.prompt + (a if a.endswith(eos) else a + eos))["input_ids"]
                  for a in (pref.chosen, pref.rejected)]
    prompt = alone[:min(shared_prefix(alone, whole) for whole in wholes)]
    if alone and not prompt:
        raise DatasetError(f"preference row {pref.index}: its answers' first tokens merge with all of its prompt's "
                           f"({tokenizer.decode(alone)!r}), so no prompt token is left to answer after; end the "
                           "prompt on a token boundary (a space, a newline or punctuation) or drop the row")
    if not prompt or len(prompt) > max_prompt_tokens:
        raise DatasetError(f"preference row {pref.index}: its prompt has {len(prompt)} tokens; it needs at least one "
                           f"and at most data.max_prompt_tokens={max_prompt_tokens} (raise the limit or drop the row)")
    global _parted_warned
    if len(prompt) < len(alone) and not _parted_warned:
        _parted_warned = True
        log.warning("preference row %d: the prompt's last tokens %r are not a prefix of prompt + answer (tokens merge "
                    "across the boundary, or the chat template renders the prompt alone otherwise); the answer "
                    "starts where they part, as in TRL's DPOTrainer (said once; likely so for most rows)", pref.index,
                    tokenizer.decode(alone[len(prompt):]))
    answers = [whole[len(prompt):] for whole in wholes]
    finished = [len(a) <= max_answer_tokens for a in answers]
    answers = [a[:max_answer_tokens] for a in answers]
    texts = [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
    return {"prompt_index": pref.index, "prompt_ids": prompt, "completions": answers, "logprobs": None,
            "finished": finished, "texts": texts, "rewards": [1.0, 0.0], "counts": [1, 1], "paths": [[0], [1]]}


def shared_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading tokens `ids` and `other` have in common."""
    return next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))


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
