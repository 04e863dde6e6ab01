"""What README.md and docs/*.md name must exist: every config key (`section.key`, in backticks or
as a key=value of a command), every `lsreplay` command-line flag, every repository file or
folder (`lsreplay/...`, `tests/test_x.py::test_name`, a link to another page) and every
`lsreplay.module.name`. A page drifts when the code under it moves; this finds where.

    python tests/docs_check.py        (make docs-check)  prints each problem; exit status 1 if any

A plain module, not a test: tests/test_docs.py runs it too.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: the checkout's lsreplay

from lsreplay.core.config import FREE_DICTS, Config  # noqa: E402
from lsreplay.core.config.aliases import alias_of  # noqa: E402

# The repository's top-level entries a path in the docs may start with (run outputs, such as
# runs/... or a checkpoint's files, are not the repository's).
REPO_ROOTS = ("lsreplay/", "tests/", "bench/", "docs/", "configs/", "flows/", "tasks/")
# Flags of other tools the docs show (pytest, pip, Prefect, vLLM's server, ...): not lsreplay's.
OTHER_TOOLS = re.compile(r"\b(pytest|pip|prefect|python|vllm|make|ray|torchrun|git|uv|docker|nvidia-smi|mlflow|"
                         r"tensorboard|trackio|wandb|accelerate|huggingface-cli|hf)\b")
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_.-]*)")
# Names the docs give on purpose that are no keys: what a mistake is answered with.
NOT_KEYS = {"model.pth": "an unknown key, and its error", "rollout.max_new_token": "a near miss, and its fix"}
# TRL's command-line spelling, as the docs name it: `--key value`, a bare `--flag`.
FLAG_PLACEHOLDERS = ("key", "flag")
FILE_SUFFIXES = (".json", ".jsonl", ".safetensors", ".yaml", ".py", ".md", ".pt", ".txt", ".png", ".lock", ".db")
OVERRIDE = re.compile(r"(?:^|\s)['\"]?\+?([a-z_]+(?:\.[a-z_0-9]+)+)=")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def config_keys() -> set[str]:
    """Every dotted key of the schema, sections included (model, model.lora, ...)."""
    keys: set[str] = set()

    def walk(cls, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            keys.add(prefix + f.name)
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")

    walk(Config, "")
    return keys


def lsreplay_flags() -> set[str]:
    """The flags the repository's own command lines take: `lsreplay`'s, the benchmarks' and scripts'
    (without the dashes)."""
    scripts = [p for p in REPO.glob("tests/*.py") if not p.name.startswith("test_")]  # forkrun.py, ...
    sources = [*REPO.glob("lsreplay/**/*.py"), *REPO.glob("bench/*.py"), *REPO.glob("flows/*.py"), *scripts]
    return {flag for path in sources for flag in re.findall(r"[\"']--([a-z][a-z0-9-]*)[\"']", path.read_text())}


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))


def _is_flag(flag: str, flags: set[str], keys: set[str]) -> bool:
    """One of `flags`, or TRL's spelling of an override: `--config.key value`, `--trl_name value`."""
    return flag in flags or flag in FLAG_PLACEHOLDERS or flag in keys or alias_of(flag) is not None


def problems(checked: list[Path] | None = None) -> list[str]:
    """Each name a page (default: pages()) gives that does not exist, as "page:line: what"."""
    keys, flags, targets = config_keys(), lsreplay_flags(), make_targets()
    sections = {k for k in keys if "." not in k and dataclasses.is_dataclass(getattr(Config(), k))}
    found = []
    for page in checked or pages():
        fenced, paragraph = False, ""
        for number, line in enumerate(page.read_text().splitlines(), 1):
            paragraph = f"{paragraph}\n{line}" if line.strip() else ""
            where = f"{page.relative_to(REPO) if page.is_relative_to(REPO) else page}:{number}"
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            code = fenced or line.startswith("    ")
            spans = [line] if code else SPAN.findall(line)
            for span in spans:
                for key in _keys_named(span, sections, code):
                    if not _is_key(key, keys) and key not in NOT_KEYS and alias_of(key) is None:
                        found.append(f"{where}: config key {key!r} does not exist")
                # A flag is lsreplay's unless the command is another tool's (`prefect ... --type`), or
                # the line of code or the paragraph of prose names another tool and not lsreplay
                # (`--durations` beside pytest is pytest's).
                command = re.sub(r"^(\$ )?([\w.-]*/)*", "", span.strip())
                if not OTHER_TOOLS.match(command) and ("lsreplay" in span
                                                       or not OTHER_TOOLS.search(span if code else paragraph)):
                    for flag in FLAG.findall(span):
                        if not _is_flag(flag, flags, keys):
                            found.append(f"{where}: command-line flag '--{flag}' is no flag of lsreplay's")
                for target in re.findall(r"(?:^|\$ |&& |; )make ([a-z][\w-]*)", span.strip()):
                    if target not in targets:
                        found.append(f"{where}: the Makefile has no target {target!r}")
                if not code:
                    found += [f"{where}: {problem}" for problem in _path_problems(span.strip())]
            for target in LINK.findall(line):
                found += [f"{where}: {problem}" for problem in _link_problems(page, target)]
    return found


def _keys_named(span: str, sections: set[str], code: bool) -> list[str]:
    """The config keys a backticked span or a line of a command names: `section.key`,
    `section.key=value`, and key=value overrides."""
    names = OVERRIDE.findall(span)
    if not code:
        names.append(span.split("=")[0].strip().lstrip("+"))
    return [n for n in dict.fromkeys(names) if re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", n)
            and n.split(".")[0] in sections and not n.endswith(FILE_SUFFIXES)]


def _is_key(name: str, keys: set[str]) -> bool:
    """A schema key, or a name inside one of its free dicts (model.arch.hidden_size)."""
    return name in keys or any(name.startswith(d + ".") for d in FREE_DICTS)


def _path_problems(span: str) -> list[str]:
    if re.search(r"[*<>{}\[\]$ ]", span.split("::")[0]):
        return []  # a pattern or a placeholder, not one file
    path, _, test = span.partition("::")
    if re.fullmatch(r"[\w/.-]+\.py:\w+", path):  # file.py:function, as verl and Prefect name a function
        path = path.rpartition(":")[0]
    if re.fullmatch(r"test_\w+\.py", path):
        path = f"tests/{path}"
    if path.startswith(REPO_ROOTS) and not (REPO / path).exists():
        return [f"file {path!r} does not exist"]
    if test and (REPO / path).is_file():
        name = test.split("[")[0]
        if not re.search(rf"^(async )?def {re.escape(name)}\(", (REPO / path).read_text(), re.MULTILINE):
            return [f"test {path}::{name} does not exist"]
    if re.fullmatch(r"lsreplay(\.\w+)+", span):
        return _module_problems(span)
    return []


def _module_problems(dotted: str) -> list[str]:
    """`lsreplay.a.b[.name[.attr]]`: the longest prefix that is a module, and a name it defines."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:cut])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            rest = parts[cut:]
            if not rest:
                return []
            text = source.read_text()
            if re.search(rf"^\s*(async def|def|class) {rest[0]}\b|^{rest[0]}\b.*=|import .*\b{rest[0]}\b",
                         text, re.MULTILINE):
                return []
            return [f"{'.'.join(parts[:cut])} defines no {rest[0]!r} (named as {dotted!r})"]
    return [f"module {dotted!r} does not exist"]


def _link_problems(page: Path, target: str) -> list[str]:
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
        return []  # a web address, or an anchor of the page itself
    path = target.split("#")[0]
    if not (page.parent / path).exists():
        return [f"link to {path!r}: no such file"]
    return []


if __name__ == "__main__":
    found = problems()
    print("\n".join(found) if found else f"docs-check: {len(pages())} pages name only what exists")
    sys.exit(1 if found else 0)
