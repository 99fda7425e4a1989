"""No import cycles between batchd's modules, read from every module's source.

Every import counts (type-only and function-level ones included): a cycle that only
``TYPE_CHECKING`` or a late import keeps from failing still means two modules that
each need the other, so neither can be read, tested or moved alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> the repository folder it is installed from (pyproject's package-dir)
ROOMS = {
    "batchd.engine": "engine",
    "batchd.daemon": "daemon",
    "batchd.producers": "producers",
    "batchd.config": "config",
    "batchd": "batchd",
}


def module_files() -> dict[str, Path]:
    """Every module of the distribution by import name (a package by its __init__)."""
    files: dict[str, Path] = {}
    for name, folder in ROOMS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            dotted = ".".join((name, *parts))
            files.setdefault(dotted, path)
    return files


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The batchd modules ``path`` imports: ``from m import x`` counts as m.x when that is
    a module of ours, else as m."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif node.module in known:
                    found.add(node.module)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or of one
    module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    files = module_files()
    graph = {name: imports_of(path, set(files)) - {name} for name, path in files.items()}
    assert not cycles(graph), "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles(graph))


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
