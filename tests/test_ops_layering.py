"""prime_ops' module structure: no import circle between its modules, so each reads bottom-up.

Read from the sources (ast), so every import counts: inside functions and under
``TYPE_CHECKING`` too (a type-only circle still makes two modules unreadable without each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "prime_ops"


def _name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` to the modules of it that it imports: ``from pkg import mod``
    counts as ``pkg.mod`` when that is a module, as ``pkg`` (its ``__init__``) otherwise."""
    modules = {_name(p, package): p for p in package.rglob("*.py")}
    root = package.name
    graph = {}
    for name, path in modules.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = own_package.split(".")[: len(own_package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges.add(full if full in modules else base)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in modules and e != name and e.startswith(root)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_a_type_only_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.sub import front\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "front.py").write_text("from pkg.sub import back\nfrom pkg import low\n")
    (pkg / "sub" / "back.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .front import Args\n"
    )
    (pkg / "low.py").write_text("def f():\n    import pkg.sub\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.front"] == {"pkg.sub.back", "pkg.low"}
    assert graph["pkg.low"] == {"pkg.sub"}  # an import inside a function counts
    assert cycles(graph) == [["pkg.sub.back", "pkg.sub.front"]]
    (pkg / "sub" / "back.py").write_text("")
    assert cycles(import_graph(pkg)) == []


def test_prime_ops_has_no_import_circle():
    assert cycles(import_graph(PACKAGE)) == [], (
        "modules that import each other, directly or around a circle"
    )
