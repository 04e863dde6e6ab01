"""docs/configuration.md documents every config key once: each leaf of lsreplay.core.config's
schema is named by exactly one row of its table, and the table names nothing else; the
guides' example commands load as written."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from lsreplay.core.config import Config, load_config

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


GUIDES = [REFERENCE.parents[1] / "README.md", REFERENCE.parent / "data-and-rewards.md", REFERENCE.parent / "multi-turn.md"]


def train_commands(text: str) -> list[list[str]]:
    """The arguments of every `lsreplay train` line of a page's code blocks (continued lines
    joined; comments and `...` left out)."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.startswith("lsreplay train "):
            words = shlex.split(line.partition(" #")[0])[2:]
            commands.append([w for w in words if w != "..."])
    return commands


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_the_guides_train_commands_load_as_written(guide):
    """Every key and value of the guides' example commands is one lsreplay takes (the files
    they name are the user's)."""
    from lsreplay.cli import flags_to_overrides

    commands = train_commands(guide.read_text())
    assert commands
    for words in commands:
        config = words[0] if words and words[0].endswith(".yaml") else None
        load_config(config, flags_to_overrides(words[1:] if config else words, {"--force"}))
