"""The library's layers import downwards only: no import circle inside `lsreplay/` (an
import inside a function counts too), and `lsreplay/` never imports Prefect (the flows and
tasks above it do). Read from the source with `ast`, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lsreplay"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Every absolute module name an import statement of the file names (from A import B
    names A and A.B: B may be a submodule)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported_names(path) & files.keys() - {name} for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_inside_the_library():
    graph = import_graph()
    assert len(graph) > 40 and "lsreplay.core.faults" in graph["lsreplay.core.storage"]  # the graph is read
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(f"{m} (imports {sorted(graph[m] & set(c))})" for m in c) for c in found)


def test_the_library_never_imports_prefect():
    offenders = {module_name(p): sorted(n for n in imported_names(p) if n.split(".")[0] == "prefect")
                 for p in PACKAGE.rglob("*.py")}
    assert not {m: n for m, n in offenders.items() if n}


def test_the_core_imports_nothing_above_it():
    graph = import_graph()
    above = {m: sorted(n for n in graph[m] if not n.startswith("lsreplay.core")) for m in graph
             if m.startswith("lsreplay.core")}
    assert len(above) >= 6 and not {m: n for m, n in above.items() if n}
