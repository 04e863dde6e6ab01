"""lsreplay's built-in long-context task: key-value retrieval over generated filler (RULER's
multi-key needle in a haystack), every prompt a set length in tokens.

`kv_retrieval`: a passage of filler sentences hides `keys` sentences "One of the special magic
numbers for <key> is: <7 digits>." at random depths; the question asks for one of them (the
needle, also at a random depth); the reward is 1 when the answer's final number (its
<answer> tag, else its last number: rewards.extract_answer) is exactly that value. The filler
holds no digits, so nothing else looks like an answer.

Each prompt is `prompt_tokens` tokens long as the run renders it (the tokenizer's chat
template, the system prompt, examples and answer instruction data adds): filler sentences
are added until one more would pass that length, so a prompt ends within one sentence
(about 10 tokens) under it, never over. The length is a task argument,
data.task_args.kv_retrieval.prompt_tokens (default: data.max_prompt_tokens). Generated
offline and seeded like reasoning-gym's tasks (lsreplay.data.sources.generate_prompt_file),
the rows name the needle's key, depth and the other keys in their metadata.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from lsreplay.data.errors import DatasetError

TASKS = ("kv_retrieval",)
# A generator change that makes other rows: recorded with every prompt file (its sidecar).
VERSION = 1
# Task arguments and their defaults; prompt_tokens None: data.max_prompt_tokens.
DEFAULTS = {"kv_retrieval": {"prompt_tokens": None, "keys": 4}}

_ADJECTIVES = ("amber", "brisk", "calm", "dusky", "eager", "faint", "gentle", "hollow", "ivory", "jolly", "keen",
               "lively", "mellow", "nimble", "olive", "proud", "quiet", "rustic", "silver", "tidy", "upper", "vivid",
               "wistful", "young", "zesty")
_NOUNS = ("anchor", "beacon", "canyon", "delta", "ember", "falcon", "garden", "harbor", "island", "jasmine", "kettle",
          "lantern", "meadow", "nectar", "orchard", "pebble", "quarry", "river", "saddle", "thistle", "umbrella",
          "valley", "willow", "yarrow", "zephyr")
_SUBJECTS = ("The old miller", "A patient teacher", "The river pilot", "Every gardener", "The night watchman",
             "A travelling merchant", "The village baker", "Her younger brother", "The lighthouse keeper",
             "A quiet clerk", "The shepherd", "Our neighbour")
_VERBS = ("walked past", "painted", "forgot about", "talked about", "repaired", "looked at", "dreamed of",
          "wrote a letter about", "carried supplies to", "sang about", "cleaned", "visited")
_OBJECTS = ("the stone bridge", "a crooked fence", "the harbour wall", "an empty barn", "the market square",
            "a wooden cart", "the chapel bell", "a field of barley", "the northern road", "a broken lantern",
            "the orchard gate", "a quiet pond")
_TIMES = ("at dawn", "before supper", "in the rain", "after the fair", "on a cold morning", "late in the evening",
          "during the harvest", "while the wind rose", "without a word", "once again")
_OPENING = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. I will "
            "quiz you about the numbers afterwards.\n\n")
_CLOSING = "\n\nWhat is the special magic number for {key} mentioned in the provided text?"


@dataclass(frozen=True)
class PromptMeasure:
    """How long a question is as the run renders it: `tokens(question)`, the rendered prompt's
    token count; `key` names what it depends on (tokenizer, what data adds), recorded with
    the prompt file so that another rendering makes another file."""

    key: str
    tokens: Callable[[str], int]


def task_args(name: str, given: dict, max_prompt_tokens: int) -> dict:
    """The arguments of built-in task `name`: DEFAULTS under `given`, prompt_tokens defaulting
    to data.max_prompt_tokens; DatasetError naming an unknown or bad one."""
    unknown = sorted(set(given) - set(DEFAULTS[name]))
    if unknown:
        raise DatasetError(f"data.task_args.{name}: unknown {unknown}; the task takes {sorted(DEFAULTS[name])}")
    args = {**DEFAULTS[name], **given}
    if args["prompt_tokens"] is None:
        args["prompt_tokens"] = max_prompt_tokens
    for key, least in (("prompt_tokens", 64), ("keys", 1)):
        if not isinstance(args[key], int) or args[key] < least:
            raise DatasetError(f"data.task_args.{name}.{key} = {args[key]!r}: an integer >= {least}")
    return args


def rows(name: str, size: int, seed: int, args: dict, measure: PromptMeasure | None) -> Iterator[dict]:
    """`size` prompt rows of built-in task `name` (a file row: question, answer, task, metadata)."""
    if measure is None:
        raise DatasetError(f"task {name} makes prompts of a set length in tokens: it needs the run's tokenizer and "
                           "rendering (lsreplay.data.prompt_sets.prompt_file passes them)")
    rng = random.Random(f"{name}:{seed}")
    for _ in range(size):
        yield _kv_retrieval(rng, args["prompt_tokens"], args["keys"], measure)


def _kv_retrieval(rng: random.Random, length: int, keys: int, measure: PromptMeasure) -> dict:
    names = rng.sample([f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS], keys)
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), keys)]
    depths = [rng.random() for _ in names]
    needle = rng.randrange(keys)
    filler = _Filler(random.Random(rng.getrandbits(64)))  # its own: the row's length leaves the next rows as they are

    def question(sentences: int) -> str:
        passage = filler.sentences(sentences)
        # Each key's sentence at its depth of the passage, later depths first so indices hold.
        for i in sorted(range(keys), key=lambda i: -depths[i]):
            passage.insert(round(depths[i] * len(passage)),
                           f"One of the special magic numbers for {names[i]} is: {values[i]}.")
        return _OPENING + " ".join(passage) + _CLOSING.format(key=names[needle])

    count = _longest_within(question, measure.tokens, length)
    metadata = {"key": names[needle], "depth": depths[needle], "keys": names, "values": values,
                "prompt_tokens": measure.tokens(question(count)), "filler_sentences": count}
    return {"question": question(count), "answer": values[needle], "task": "kv_retrieval",
            "metadata": json.dumps(metadata, sort_keys=True)}


def _longest_within(question: Callable[[int], str], tokens: Callable[[str], int], length: int) -> int:
    """The most filler sentences whose question renders within `length` tokens: bracketed
    around a guess from the tokens per sentence, then bisected (a sentence always adds tokens)."""
    bare = tokens(question(0))
    if bare > length:
        raise DatasetError(f"a kv_retrieval prompt takes {bare} tokens before any filler, more than its "
                           f"prompt_tokens={length}: raise data.task_args.kv_retrieval.prompt_tokens or use fewer keys")

    def fits(count: int) -> bool:
        return tokens(question(count)) <= length

    probe = 64
    guess = int((length - bare) / max(1.0, (tokens(question(probe)) - bare) / probe))
    span = max(4, guess // 50)
    low, high = max(0, guess - span), guess + span
    while not fits(low):  # 0 fits
        high, low = low, max(0, low - span)
    while fits(high):
        low, high = high, high + span
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


class _Filler:
    """Seeded filler sentences: the first n of one endless, fixed sequence (so a longer
    passage extends a shorter one)."""

    def __init__(self, rng: random.Random):
        self.rng, self.made = rng, []

    def sentences(self, n: int) -> list[str]:
        while len(self.made) < n:
            self.made.append(f"{self.rng.choice(_SUBJECTS)} {self.rng.choice(_VERBS)} {self.rng.choice(_OBJECTS)} "
                             f"{self.rng.choice(_TIMES)}.")
        return self.made[:n]
