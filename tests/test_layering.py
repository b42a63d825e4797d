"""The layering of docs/architecture.md holds in the code: each top-level package imports
only the packages its row of the "may import" table names, and no two files import each
other, directly or around a loop.

Imports are read from the source (every `import` statement, those inside functions and
under `if TYPE_CHECKING:` included), so a late import cannot hide a dependency.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
EVERYTHING = "everything"
EVERYTHING_BUT_TESTS = "everything but `tests`"


@dataclass(frozen=True)
class Import:
    source: str  # dotted module of the importing file
    path: Path
    line: int
    target: str  # dotted module (or module.name) imported


def may_import_table() -> dict[str, set[str] | None]:
    """Package -> the packages of ours it may import (None: any), from the doc's table."""
    table: dict[str, set[str] | None] = {}
    text = ARCHITECTURE.read_text()
    header = text.index("| package (top level) | owns | may import")
    for row in text[header:].splitlines()[2:]:
        if not row.startswith("|"):
            break
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        package = cells[0].strip("`/")
        allowed = cells[-1]
        if allowed == EVERYTHING:
            table[package] = None
        elif allowed == EVERYTHING_BUT_TESTS:
            table[package] = {"*", "-tests"}
        else:
            names = re.sub(r"\(.*?\)", "", allowed)
            table[package] = set(re.findall(r"`([a-z_][a-z0-9_]*)`", names))
    return table


def top_level_packages() -> list[str]:
    return sorted(
        path.parent.name
        for path in ROOT.glob("*/__init__.py")
        if not path.parent.name.startswith(".")
    )


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> Iterator[Import]:
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(source, path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:
                yield Import(source, path, node.lineno, f"{module}.{alias.name}")


# Third-party code vendored as test data, kept as upstream wrote it: not ours to layer.
VENDORED = ("tests/sandboxes/projects",)


def our_files() -> list[Path]:
    files: list[Path] = []
    for package in top_level_packages():
        files += sorted((ROOT / package).rglob("*.py"))
    vendored = [ROOT / folder for folder in VENDORED]
    return [f for f in files if not any(f.is_relative_to(v) for v in vendored)]


def test_the_table_names_every_top_level_package() -> None:
    table = may_import_table()
    missing = sorted(set(top_level_packages()) - set(table))
    assert not missing, f"docs/architecture.md's may-import table lacks rows for {missing}"


def test_every_package_imports_only_what_the_table_allows() -> None:
    table = may_import_table()
    ours = set(top_level_packages())
    breaches = []
    for path in our_files():
        for imp in imports_of(path):
            own = imp.source.split(".")[0]
            other = imp.target.split(".")[0]
            if other not in ours or other == own:
                continue
            allowed = table.get(own, set())
            if allowed is None:
                continue
            if "*" in allowed and f"-{other}" not in allowed:
                continue
            if other not in allowed:
                breaches.append(f"{imp.path.relative_to(ROOT)}:{imp.line} imports {imp.target}")
    assert not breaches, "imports the may-import table forbids:\n" + "\n".join(breaches)


def file_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (a `from pkg import name` counts as pkg.name
    when that is a module, else as pkg)."""
    modules = {module_name(path): path for path in our_files()}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imp in imports_of(path):
            target = imp.target
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_between_files() -> None:
    found = cycles(file_graph())
    assert not found, "files that import each other (around a loop):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def test_the_cycle_finder_finds_a_loop() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
