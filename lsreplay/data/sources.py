"""Prompt sources: reasoning-gym's procedural generators, lsreplay's own long-context task
(lsreplay.data.long_context), or your own file.

Generated prompts are written once to a JSONL file (offline, seeded, idempotent). Every
prompt file, generated or yours (JSONL, Parquet, or a folder `datasets` wrote with
save_to_disk), is read with `datasets`, its columns named by `data.columns`. How an answer
is scored lives in lsreplay.data.rewards.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lsreplay.data import long_context
from lsreplay.data.errors import DatasetError

if TYPE_CHECKING:  # imported where a dataset is read: a sandbox child reads none, and it took 0.6 s of its start
    import datasets

log = logging.getLogger(__name__)

REQUIRED_FIELDS = ("question", "answer", "task")
# A prompt as TRL and verl datasets hold it: a string, or chat messages with these keys.
MESSAGE_KEYS = ("role", "content")

_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Prompt:
    index: int  # row number in the prompt file
    task: str  # reasoning-gym dataset name, e.g. "basic_arithmetic" ("" if the file has no task column)
    question: str | list[dict]  # the prompt: its text, or its chat messages ({role, content})
    answer: str
    # The reasoning-gym entry's metadata (its checker may need it); for your own file, its
    # metadata column and every column data.columns does not map.
    metadata: dict
    # Every column of the row but the prompt's, as the file holds them (nested fields
    # nested): what TRL passes a reward function as keywords and verl's compute_score reads.
    columns: dict = field(default_factory=dict)


def prompt_key(question: str | list[dict]) -> str:
    """A prompt as one string: to tell prompts apart (held-out questions) and measure them."""
    return question if isinstance(question, str) else json.dumps(question, sort_keys=True, ensure_ascii=False)


def lookup(row: dict, column: str):
    """The value of a (dotted: reward_model.ground_truth) column in a row; None if absent."""
    value = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def check_prompt_value(value, column: str, index) -> None:
    """A prompt is a string or a non-empty list of {role, content} messages; anything else
    names the column, the row and what was expected."""
    if isinstance(value, str):
        return
    expected = (f"a string, or a list of chat messages with {' and '.join(MESSAGE_KEYS)} strings "
                "(TRL's and verl's prompt formats)")
    if not isinstance(value, list) or not value:
        raise DatasetError(f"column {column!r}, row {index}: {_shown(value)} is not a prompt; expected {expected}.")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not all(isinstance(message.get(k), str) for k in MESSAGE_KEYS):
            raise DatasetError(f"column {column!r}, row {index}: message {i} is {_shown(message)}; expected "
                               f"{expected}.")


def _shown(value) -> str:
    text = repr(value)
    return f"{text[:80]}... ({type(value).__name__})" if len(text) > 80 else f"{text} ({type(value).__name__})"


# ---------------------------------------------------------------- generation


def jsonable(obj):
    """Make reasoning-gym metadata JSON-safe, deterministically.

    json.dumps alone fails on non-string dict keys such as tuples and on numpy values,
    and set order would make two generations with the same seed differ byte-wise.
    """
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((jsonable(v) for v in obj), key=repr)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def reasoning_gym_tasks() -> dict:
    """reasoning-gym's task registry. Imported where it is used (generating prompts, scoring
    its tasks): importing reasoning-gym imports every task's dependencies, which a machine
    that trains on a prompt file of its own need not have (the GPU check's has not)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise DatasetError(f"reasoning-gym is not importable here ({e}); generated prompts (no data.path) and "
                           "the default reward of their tasks need it: `pip install reasoning-gym==0.1.25`, or "
                           "train on a data.path of task exact_answer rows or with a reward.function") from e
    return DATASETS


def task_args_for(tasks: list[str], task_args: dict[str, dict]) -> dict[str, dict]:
    """The generator arguments of `tasks`: entries for other tasks are left out (a default
    keyed to one task never stands in the way of another); a name that is neither one of
    lsreplay's tasks nor reasoning-gym's is a typo and an error. reasoning-gym is imported
    only for a name that is not lsreplay's."""
    builtin = long_context.TASKS
    for key, names in (("data.tasks", tasks), ("data.task_args", task_args)):
        for name in names:
            if name in builtin:
                continue
            known = reasoning_gym_tasks()
            if name not in known:
                close = get_close_matches(name, [*builtin, *known], n=3) or sorted(known)[:5]
                raise DatasetError(
                    f"{key}: unknown task {name!r}: neither lsreplay's ({', '.join(builtin)}) nor reasoning-gym's; "
                    f"valid names include {', '.join(close)} ({len(known)} reasoning-gym tasks in all, see "
                    "reasoning_gym.factory.DATASETS)."
                )
    ignored = sorted(set(task_args) - set(tasks))
    if ignored:
        log.info("data.task_args for %s ignored: not in data.tasks %s", ignored, list(tasks))
    return {name: dict(task_args[name]) for name in tasks if name in task_args}


def _create(path: Path, name: str, size: int, seed: int, args: dict):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **args)
    except (TypeError, AssertionError, ValueError) as e:
        fields = sorted(reasoning_gym_tasks()[name][1].__dataclass_fields__)
        raise DatasetError(
            f"{path}: data.task_args.{name} = {args} rejected by reasoning-gym task {name!r} ({e}); "
            f"its config fields are {fields}."
        ) from e


def _shares(tasks: list[str], size: int) -> list[tuple[str, int]]:
    """The rows each task gets of `size`: an equal share, the remainder over the first tasks
    so that the file has exactly `size` rows."""
    share, extra = divmod(size, len(tasks))
    return [(name, share + (i < extra)) for i, name in enumerate(tasks)]


def _rows(path: Path, tasks: list[str], size: int, seed: int, task_args: dict[str, dict], measure):
    for name, n in _shares(tasks, size):
        if n == 0:
            continue
        if name in long_context.TASKS:
            yield from long_context.rows(name, n, seed, task_args[name], measure)
            continue
        for entry in _create(path, name, n, seed, task_args.get(name, {})):
            yield _row(name, entry)


def _row(name: str, entry: dict) -> dict:
    """A generated entry as the prompt file holds it."""
    return {
        "question": entry["question"],
        # Tasks with many valid solutions (rush_hour, ...) have answer None and
        # checkers that ignore it; "" keeps the column a plain string column.
        "answer": "" if entry["answer"] is None else str(entry["answer"]),
        "task": name,
        # A JSON string, not a nested object: each task's metadata has its own
        # shape, and one Arrow struct column cannot hold them all.
        "metadata": json.dumps(jsonable(entry.get("metadata", {})), sort_keys=True),
    }


def generated_row(tasks: list[str], size: int, seed: int, task_args: dict[str, dict], task: str, index: int) -> dict:
    """Row `index` of `task` (reasoning-gym's metadata.source_index) of the file
    generate_prompt_file(..., tasks, size, seed, task_args) writes, generated again, without
    the file; DatasetError if that file holds no such row."""
    shares = dict(_shares(tasks, size))
    if not 0 <= index < shares.get(task, 0):
        raise DatasetError(f"the prompts generated from data.tasks={tasks}, data.size={size} and seed {seed} hold no "
                           f"row {index} of task {task!r}")
    args = json.dumps(task_args_for(tasks, task_args).get(task, {}), sort_keys=True)
    return _row(task, _generator(task, shares[task], seed, args)[index])


@functools.lru_cache(maxsize=32)
def _generator(task: str, size: int, seed: int, args_json: str):
    return _create(Path(f"reasoning-gym task {task}"), task, size, seed, json.loads(args_json))


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
    measure=None,
) -> Path:
    """Write `size` prompts split over `tasks` (reasoning-gym's, or lsreplay's long-context
    task, whose arguments must be complete: long_context.task_args) to a JSONL file, once.
    `measure` (a long_context.PromptMeasure): how long a prompt renders, which lsreplay's
    tasks need.

    A sidecar `<path>.meta.json` records the request; a call matching it does nothing.
    """
    path = Path(path)
    if size < 1:
        raise DatasetError(f"{path}: size must be at least 1, got {size}.")
    if not tasks:
        raise DatasetError(f"{path}: no tasks given; pass at least one reasoning-gym task name.")
    task_args = task_args_for(tasks, task_args or {})
    sidecar = Path(f"{path}.meta.json")
    # The generators' versions are recorded too: a new release may generate other rows.
    builtin = set(tasks) & set(long_context.TASKS)
    versions = {"reasoning_gym": importlib.metadata.version("reasoning_gym")} if set(tasks) - builtin else {}
    if builtin:
        versions.update(lsreplay_tasks=long_context.VERSION, rendering=None if measure is None else measure.key)
    request = jsonable({"tasks": list(tasks), "size": size, "seed": seed, "task_args": task_args, **versions})
    if path.exists() and sidecar.exists() and json.loads(sidecar.read_text()) == request:
        log.debug("prompt file %s is up to date; not regenerating", path)  # the usual case: nothing to tell
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Drop the old sidecar first, so a crash between the two writes cannot leave new
    # data under a stale record that a later call would wrongly accept.
    sidecar.unlink(missing_ok=True)
    rows = _rows(path, tasks, size, seed, task_args, measure)
    _write_atomic(path, (json.dumps(r, ensure_ascii=False) for r in rows))
    _write_atomic(sidecar, [json.dumps(request, sort_keys=True)])
    log.info("wrote %d prompts from %s to %s", size, tasks, path)
    return path


# ---------------------------------------------------------------- loading


def _looks_like_hub_name(path: Path) -> bool:
    """`org/name` (openai/gsm8k, trl-lib/DeepMath-103K): a dataset on the Hugging Face Hub."""
    return not path.is_absolute() and len(path.parts) == 2 and path.suffix.lower() not in _LOADERS


def _load(path: Path, split: str) -> datasets.Dataset:
    import datasets

    if path.is_dir():
        return _load_saved(path, split)
    if not path.is_file() and _looks_like_hub_name(path):
        raise DatasetError(
            f"{path}: no such file or folder here; a dataset name on the Hugging Face Hub is not read, because "
            "nothing is downloaded at run time. Save it to disk once, e.g. python -c \"import datasets; "
            f"datasets.load_dataset('{path.as_posix()}').save_to_disk('{path.name}')\", and give data.path={path.name} "
            "(data.split picks the training split, eval.split a test split)."
        )
    if not path.is_file():
        raise DatasetError(
            f"{path}: prompt file not found; create it with generate_prompt_file() or point the config "
            "at an existing .jsonl/.parquet file or a folder written by datasets' save_to_disk."
        )
    loader = _LOADERS.get(path.suffix.lower())
    if loader is None:
        raise DatasetError(
            f"{path}: unsupported suffix {path.suffix!r}; use one of {sorted(_LOADERS)}, "
            "or a folder written by datasets' save_to_disk."
        )
    try:
        return datasets.load_dataset(loader, data_files=str(path), split="train")
    except Exception as e:  # datasets raises many types for a malformed file
        raise DatasetError(
            f"{path}: could not be read as {loader} ({e}); fix or regenerate it."
        ) from e


def _load_saved(path: Path, split: str) -> datasets.Dataset:
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DatasetError(f"{path}: a folder, but not one datasets' save_to_disk wrote ({e}); "
                           "give a .jsonl/.parquet file or such a folder.") from e
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DatasetError(f"{path}: no split {split!r}; it holds {sorted(saved)}: set data.split (eval.split for "
                               "the held-out prompts) to one of them.")
        saved = saved[split]
    return saved


def _metadata(value, row: int) -> dict:
    """A row's `metadata` column as a dict: a JSON object string (as reasoning-gym's prompts
    keep it) or a struct; DatasetError naming the row and the fix otherwise."""
    if value is None:
        return {}
    try:
        found = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        found, reason = None, f"not JSON: {e.msg} at character {e.pos + 1}"
    else:
        reason = f"a JSON {type(found).__name__}, not an object"
    if isinstance(found, dict):
        return dict(found)
    raise DatasetError(f"row {row}: the column 'metadata' holds {str(value)[:80]!r}, {reason}; write it as a JSON "
                       "object ('{\"key\": 1}') or a struct, or rename the column (any other column is kept as "
                       "metadata as it is)")


def _is_prompt_feature(feature) -> bool:
    """A string column, or a list of structs with string role and content (chat messages)."""
    if getattr(feature, "dtype", None) in ("string", "large_string"):
        return True
    inner = getattr(feature, "feature", None)
    if isinstance(feature, list) and len(feature) == 1:  # datasets' [feature] for a list
        inner = feature[0]
    return isinstance(inner, dict) and all(getattr(inner.get(k), "dtype", None) in ("string", "large_string")
                                           for k in MESSAGE_KEYS)


def prompt_column(columns: dict[str, str], names: list[str]) -> str:
    """The column holding the prompt: data.columns.prompt; else `prompt` where the file has
    it (TRL's and verl's name) and data.columns.question is not set otherwise; else that."""
    if columns.get("prompt"):
        return columns["prompt"]
    if "prompt" in names and columns["question"] == "question":
        return "prompt"
    return columns["question"]


class PromptSet:
    """Prompts of one file (or some of its rows), indexable and seed-deterministically
    sampled. `columns` maps each field (question: the prompt, answer, task) to the file's
    (dotted) column that holds it; the row's other columns join its `metadata`, and all but
    the prompt's its `columns`, where reward functions find them."""

    def __init__(self, table: datasets.Dataset, path: Path, columns: dict[str, str], rows: list[int] | None = None):
        self._table, self.path, self.columns = table, path, columns
        self.rows = list(range(len(table))) if rows is None else list(rows)  # the file's row numbers

    @classmethod
    def from_file(cls, path: str | Path, columns: dict[str, str] | None = None, required=REQUIRED_FIELDS,
                  split: str = "train") -> "PromptSet":
        path = Path(path)
        columns = {name: name for name in REQUIRED_FIELDS} | dict(columns or {})
        table = _load(path, split)
        columns = {"question": prompt_column(columns, table.column_names),
                   "answer": columns["answer"], "task": columns["task"]}
        for name in required:
            column = columns[name]
            if lookup(table.features, column) is None:
                key = "prompt" if name == "question" else name
                raise DatasetError(
                    f"{path}: required field {name!r} is missing (column {column!r}); the file has fields "
                    f"{_field_names(table.features)}. Add {column!r} to every row, or name the column that holds "
                    f"it with data.columns.{key}=NAME (a dotted name reaches a nested field)."
                )
        feature = lookup(table.features, columns["question"])
        if feature is not None and not _is_prompt_feature(feature):
            raise DatasetError(f"{path}: column {columns['question']!r} holds {_shown_feature(feature)}, not prompts; "
                               "expected a string or a list of chat messages with role and content strings in every "
                               "row (data.columns.prompt names the prompt's column).")
        if len(table) == 0:
            raise DatasetError(f"{path}: the file has no rows; regenerate it or use another file.")
        return cls(table, path, columns)

    def check_prompts(self) -> None:
        """Every row's prompt is a string or a list of chat messages (the error names the row)."""
        for row, value in zip(self.rows, self.column("question")):
            check_prompt_value(value, self.columns["question"], row)
        if "metadata" in self._table.column_names:
            metadata = list(self._table["metadata"])
            for row in self.rows:
                _metadata(metadata[row], row)

    def reward_columns(self) -> list[str]:
        """The columns a prompt's `columns` holds: every one but the prompt's."""
        return [c for c in self._table.column_names if c != self.columns["question"]]

    def select(self, rows: list[int]) -> "PromptSet":
        """The prompts of these rows of the file."""
        return PromptSet(self._table, self.path, self.columns, rows)

    def column(self, field: str) -> list:
        """One field of every prompt of the set, in order."""
        top, _, nested = self.columns[field].partition(".")
        if top not in self._table.column_names:
            return [None] * len(self)
        values = list(self._table[top])
        return [lookup(values[r], nested) if nested else values[r] for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Prompt:
        if not -len(self) <= i < len(self):
            raise IndexError(f"prompt index {i} out of range: {self.path} has {len(self)} prompts")
        index = self.rows[i]
        row = jsonable(self._table[index])
        mapped = {c.partition(".")[0] for c in self.columns.values()} | {"metadata"}
        extra = {k: v for k, v in row.items() if k not in mapped}
        question = lookup(row, self.columns["question"])
        check_prompt_value(question, self.columns["question"], index)
        answer = lookup(row, self.columns["answer"])
        return Prompt(
            index=index,
            task=lookup(row, self.columns["task"]) or "",
            question=question,
            answer="" if answer is None else str(answer),
            metadata={**extra, **self._row_metadata(row.get("metadata"), index)},
            columns={k: v for k, v in row.items() if k != self.columns["question"]},
        )

    def _row_metadata(self, value, row: int) -> dict:
        try:
            return _metadata(value, row)
        except DatasetError as e:
            raise DatasetError(f"{self.path}: {e}") from None

    def sample(self, step: int, batch_size: int, seed: int, draw: int = 0) -> list[Prompt]:
        """The batch for `step`: a pure function of (seed, step), so reruns and resumed
        runs see the same prompts. Repeats only when the batch exceeds the set. `draw` > 0:
        another batch of the step (dynamic sampling's replacements)."""
        return [self[i] for i in sample_rows(len(self), step, batch_size, seed, draw)]


def sample_rows(size: int, step: int, batch_size: int, seed: int, draw: int = 0) -> list[int]:
    """`batch_size` of `size` rows for (seed, step, draw): distinct unless the batch exceeds them."""
    rng = np.random.default_rng([seed, step] + ([draw] if draw else []))
    return [int(i) for i in rng.choice(size, size=batch_size, replace=batch_size > size)]


def _field_names(features, prefix: str = "") -> list[str]:
    """A file's fields, nested ones dotted: [data_source, prompt, reward_model.ground_truth, ...]."""
    out = []
    for name, feature in features.items():
        out += _field_names(feature, f"{prefix}{name}.") if isinstance(feature, dict) else [prefix + name]
    return out


def _shown_feature(feature) -> str:
    return getattr(feature, "dtype", None) or type(feature).__name__
