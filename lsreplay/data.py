"""Prompt sources and verifiable rewards.

Prompts come from reasoning-gym's procedural generators, written once to a JSONL file
(offline, seeded, idempotent) and read back with `datasets`. Rewards come from the same
generator's own checker (`score_answer`), so a completion is scored exactly as
reasoning-gym defines correctness for its task. A prompt file may also carry rows of the
task `exact_answer` (its own verifiable answers): scored by exact match, without reasoning-gym.

reasoning-gym is imported only where it is used (generating prompts, scoring its tasks):
importing it imports every task's dependencies, which a machine that trains on a prompt
file of exact_answer rows need not have.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path

import datasets
import numpy as np

log = logging.getLogger(__name__)

REQUIRED_FIELDS = ("question", "answer", "task")
# The task of a prompt-file row scored without reasoning-gym: reward 1 when the completion's
# final answer (extract_answer) is the row's answer, surrounding whitespace aside; else 0.
EXACT_ANSWER = "exact_answer"

ANSWER_INSTRUCTION = (
    "\n\nWork it out briefly, then end your reply with the final answer inside "
    "<answer> and </answer> tags, with nothing else inside the tags."
)

_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DatasetError(ValueError):
    """A prompt file or prompt-generation request that cannot be used as given."""


@dataclass(frozen=True)
class Prompt:
    index: int  # row index in the prompt set
    task: str  # reasoning-gym dataset name, e.g. "basic_arithmetic"
    question: str
    answer: str
    metadata: dict  # the reasoning-gym entry's metadata (its checker may need it)


# ---------------------------------------------------------------- generation


def _jsonable(obj):
    """Make reasoning-gym metadata JSON-safe, deterministically.

    json.dumps alone fails on non-string dict keys such as tuples and on numpy values,
    and set order would make two generations with the same seed differ byte-wise.
    """
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((_jsonable(v) for v in obj), key=repr)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def _check_tasks(path: Path, tasks: list[str], task_args: dict[str, dict]) -> None:
    from reasoning_gym.factory import DATASETS

    if not tasks:
        raise DatasetError(f"{path}: no tasks given; pass at least one reasoning-gym task name.")
    for name in list(tasks) + list(task_args):
        if name not in DATASETS:
            close = get_close_matches(name, DATASETS, n=3) or sorted(DATASETS)[:5]
            raise DatasetError(
                f"{path}: unknown reasoning-gym task {name!r}; valid names include "
                f"{', '.join(close)} ({len(DATASETS)} in all, see reasoning_gym.factory.DATASETS)."
            )
    # A task_args entry for a task that is not generated is almost surely a typo.
    stray = sorted(set(task_args) - set(tasks))
    if stray:
        raise DatasetError(f"{path}: task_args given for {stray}, which are not in tasks {tasks}.")


def _create(path: Path, name: str, size: int, seed: int, args: dict):
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **args)
    except (TypeError, AssertionError, ValueError) as e:
        fields = sorted(DATASETS[name][1].__dataclass_fields__)
        raise DatasetError(
            f"{path}: task_args {args} rejected by reasoning-gym task {name!r} ({e}); "
            f"its config fields are {fields}."
        ) from e


def _rows(path: Path, tasks: list[str], size: int, seed: int, task_args: dict[str, dict]):
    # Spread the remainder over the first tasks so the file has exactly `size` rows.
    share, extra = divmod(size, len(tasks))
    for i, name in enumerate(tasks):
        n = share + (i < extra)
        if n == 0:
            continue
        for entry in _create(path, name, n, seed, task_args.get(name, {})):
            yield {
                "question": entry["question"],
                # Tasks with many valid solutions (rush_hour, ...) have answer None and
                # checkers that ignore it; "" keeps the column a plain string column.
                "answer": "" if entry["answer"] is None else str(entry["answer"]),
                "task": name,
                # A JSON string, not a nested object: each task's metadata has its own
                # shape, and one Arrow struct column cannot hold them all.
                "metadata": json.dumps(_jsonable(entry.get("metadata", {})), sort_keys=True),
            }


def _write_atomic(path: Path, lines) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def generate_prompt_file(
    path: str | Path,
    tasks: list[str],
    size: int,
    seed: int,
    task_args: dict[str, dict] | None = None,
) -> Path:
    """Write `size` reasoning-gym prompts split over `tasks` to a JSONL file, once.

    A sidecar `<path>.meta.json` records the request; a call matching it does nothing.
    """
    path = Path(path)
    task_args = task_args or {}
    if size < 1:
        raise DatasetError(f"{path}: size must be at least 1, got {size}.")
    _check_tasks(path, tasks, task_args)
    sidecar = Path(f"{path}.meta.json")
    # The generator version is recorded too: a new release may generate other rows.
    request = _jsonable({
        "tasks": list(tasks), "size": size, "seed": seed, "task_args": task_args,
        "reasoning_gym": importlib.metadata.version("reasoning_gym"),
    })
    if path.exists() and sidecar.exists() and json.loads(sidecar.read_text()) == request:
        log.info("prompt file %s is up to date; not regenerating", path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Drop the old sidecar first, so a crash between the two writes cannot leave new
    # data under a stale record that a later call would wrongly accept.
    sidecar.unlink(missing_ok=True)
    rows = _rows(path, tasks, size, seed, task_args)
    _write_atomic(path, (json.dumps(r, ensure_ascii=False) for r in rows))
    _write_atomic(sidecar, [json.dumps(request, sort_keys=True)])
    log.info("wrote %d prompts from %s to %s", size, tasks, path)
    return path


# ---------------------------------------------------------------- loading


def _load(path: Path) -> datasets.Dataset:
    if not path.is_file():
        raise DatasetError(
            f"{path}: prompt file not found; create it with generate_prompt_file() "
            "or point the config at an existing .jsonl/.parquet file."
        )
    loader = _LOADERS.get(path.suffix.lower())
    if loader is None:
        raise DatasetError(
            f"{path}: unsupported suffix {path.suffix!r}; use one of {sorted(_LOADERS)}."
        )
    try:
        return datasets.load_dataset(loader, data_files=str(path), split="train")
    except Exception as e:  # datasets raises many types for a malformed file
        raise DatasetError(
            f"{path}: could not be read as {loader} ({e}); fix or regenerate it."
        ) from e


def _metadata(value) -> dict:
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)


class PromptSet:
    """An indexable, seed-deterministically sampled set of prompts."""

    def __init__(self, table: datasets.Dataset, path: Path):
        self._table = table
        self.path = path

    @classmethod
    def from_file(cls, path: str | Path, required=REQUIRED_FIELDS) -> "PromptSet":
        path = Path(path)
        table = _load(path)
        for field in required:
            if field not in table.column_names:
                raise DatasetError(
                    f"{path}: required field {field!r} is missing; the file has fields "
                    f"{table.column_names}. Add {field!r} to every row or regenerate the file."
                )
        if len(table) == 0:
            raise DatasetError(f"{path}: the file has no rows; regenerate it or use another file.")
        return cls(table, path)

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, i: int) -> Prompt:
        if not -len(self) <= i < len(self):
            raise IndexError(f"prompt index {i} out of range: {self.path} has {len(self)} prompts")
        i %= len(self)
        row = self._table[i]
        return Prompt(
            index=i,
            task=row.get("task") or "",
            question=row["question"],
            answer="" if row.get("answer") is None else str(row["answer"]),
            metadata=_metadata(row.get("metadata")),
        )

    def sample(self, step: int, batch_size: int, seed: int) -> list[Prompt]:
        """The batch for `step`: a pure function of (seed, step), so reruns and resumed
        runs see the same prompts. Repeats only when the batch exceeds the set."""
        rng = np.random.default_rng([seed, step])
        picks = rng.choice(len(self), size=batch_size, replace=batch_size > len(self))
        return [self[int(i)] for i in picks]


# ---------------------------------------------------------------- rewards

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# A number, allowing thousands separators; a minus counts only when it is not the
# subtraction in "3-4" (no digit right before it).
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_answer(completion: str) -> str | None:
    """The final answer in a completion: the last non-empty <answer> tag, else the last
    number (so a small model that ends with "= 12" still gets scored), else None."""
    tagged = [m.strip() for m in _ANSWER_TAG.findall(completion)]
    tagged = [t for t in tagged if t]
    if tagged:
        return tagged[-1]
    numbers = _NUMBER.findall(completion)
    return numbers[-1].replace(",", "") if numbers else None


@functools.lru_cache(maxsize=None)
def _checker(task: str, args_json: str):
    # size=1 keeps construction cheap (some generators precompute per-row state); the
    # seed does not affect checking. Four checkers (decimal_arithmetic, puzzle24,
    # polynomial_equations, time_intervals) read their config, hence args_json.
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise DatasetError(f"prompt task {task!r} is not a reasoning-gym task; cannot score it.")
    return reasoning_gym.create_dataset(task, size=1, seed=0, **json.loads(args_json))


_warned_tasks: set[str] = set()


def score(prompt: Prompt, completion: str, task_args: dict | None = None) -> float:
    """Reward in [0, 1] from reasoning-gym's own checker for `prompt.task` (exact match
    for EXACT_ANSWER rows).

    Pass the `task_args` the prompt was generated with when the task's checker depends
    on its config (see `_checker`); the others ignore it.
    """
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    if prompt.task == EXACT_ANSWER:
        return float(answer.strip() == prompt.answer.strip())
    checker = _checker(prompt.task, json.dumps(task_args or {}, sort_keys=True))
    entry = {"question": prompt.question, "answer": prompt.answer, "metadata": prompt.metadata}
    try:
        reward = float(checker.score_answer(answer=answer, entry=entry))
    except Exception:
        # Some checkers raise on malformed model output instead of returning 0; a bad
        # completion must not stop training. Warn once per task so real bugs still show.
        if prompt.task not in _warned_tasks:
            _warned_tasks.add(prompt.task)
            log.warning("checker for %s raised on an answer; scoring 0", prompt.task, exc_info=True)
        return 0.0
    return min(1.0, max(0.0, reward))
