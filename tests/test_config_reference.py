"""docs/configuration.md documents every config key once: each leaf of lsreplay.core.config's
schema is named by exactly one row of its table, and the table names nothing else."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from lsreplay.core.config import Config

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def schema_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted (a dict or list is one key)."""
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def row_keys(cell: str) -> list[str]:
    """The keys a table row's first cell names: `a.b.c`, `.d` (a.b.d), `e` (a.b.e): a name
    without a dot shares the group of the full name before it."""
    keys, group = [], ""
    for name in re.findall(r"`([^`]+)`", cell):
        if name.startswith("."):
            keys.append(group + name)
        elif "." in name:
            group = name.rsplit(".", 1)[0]
            keys.append(name)
        else:
            keys.append(f"{group}.{name}" if group else name)
    return keys


def documented_keys(text: str) -> list[str]:
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    return [key for cell in rows for key in row_keys(cell)]


def test_row_keys_reads_a_rows_groups():
    assert row_keys("`data.columns.question`, `.answer`, `.task`") == [
        "data.columns.question", "data.columns.answer", "data.columns.task"]
    assert row_keys("`optim.lr`, `weight_decay`") == ["optim.lr", "optim.weight_decay"]
    assert row_keys("`seed`, `steps`") == ["seed", "steps"]


def test_every_config_key_is_documented_once():
    documented = documented_keys(REFERENCE.read_text())
    twice = sorted({k for k in documented if documented.count(k) > 1})
    missing = sorted(set(schema_keys()) - set(documented))
    unknown = sorted(set(documented) - set(schema_keys()))
    assert (missing, twice, unknown) == ([], [], [])
