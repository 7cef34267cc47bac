"""The package's floors, read from its imports (``ast``, so nothing is imported or run).

From the bottom: ``convfirstnet.kernels`` (the top-level ``kernels/`` folder) imports nothing of the
package outside itself; the library (``registry``, ``blocks``, ``model``, ``weights``, ...) and the
analysis library ``convfirstnet.analysis`` never import the commands; ``convfirstnet.commands`` is the
top floor. Module-level and function-local imports count alike, so a cycle hidden in a function body
fails too. A private name (``_x``) is not imported from a module of another folder.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# import name of the package -> its folder in the checkout (pyproject.toml's package-dir mapping)
FOLDERS = {"convfirstnet": ROOT / "convfirstnet", "convfirstnet.kernels": ROOT / "kernels"}
KERNELS = "convfirstnet.kernels"
ANALYSIS = "convfirstnet.analysis"
COMMANDS = "convfirstnet.commands"
# Modules that may import the commands besides the commands themselves: `python -m convfirstnet`.
COMMAND_ENTRY = ("convfirstnet.__main__",)


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool

    @property
    def folder(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str  # a module of the package
    name: str | None  # the name taken from it (``from target import name``), None for a module import
    line: int

    def __str__(self) -> str:
        what = f"{self.target}.{self.name}" if self.name else self.target
        return f"{self.source}:{self.line} imports {what}"


def modules() -> dict[str, Module]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_package else parts)])
            found[name] = Module(name, path, is_package)
    return found


class _Imports(ast.NodeVisitor):
    """Every import statement of a file, at any depth, except under ``if TYPE_CHECKING:``."""

    def __init__(self) -> None:
        self.nodes: list[ast.Import | ast.ImportFrom] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
        if name == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.nodes.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.nodes.append(node)


def _owner(name: str, mods: dict[str, Module]) -> str | None:
    """The package module that ``import name`` loads last (the longest known prefix), or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in mods:
            return ".".join(parts[:n])
    return None


def edges(mods: dict[str, Module]) -> list[Edge]:
    """Imports of package modules by package modules; also raises on a top-level ``kernels`` import."""
    out = []
    for mod in mods.values():
        visitor = _Imports()
        visitor.visit(ast.parse(mod.path.read_text(), str(mod.path)))
        for node in visitor.nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "kernels":
                        out.append(Edge(mod.name, "kernels", None, node.lineno))  # reported below
                    target = _owner(alias.name, mods)
                    if target is not None:
                        out.append(Edge(mod.name, target, None, node.lineno))
                continue
            if node.level:
                base = mod.folder.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] == "kernels":
                out.append(Edge(mod.name, "kernels", None, node.lineno))
            target = _owner(source, mods)
            if target is None:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in mods:
                    out.append(Edge(mod.name, sub, None, node.lineno))
                else:
                    out.append(Edge(mod.name, target, alias.name, node.lineno))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.fixture(scope="module")
def graph():
    mods = modules()
    return mods, edges(mods)


def test_cycles_are_found():
    """The cycle finder itself: a three-module loop and a self-contained pair, beside a tree."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert cycles(g) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles(graph):
    mods, found = graph
    g: dict[str, set[str]] = {m: set() for m in mods}
    for e in found:
        if e.target in mods and e.target != e.source:
            g[e.source].add(e.target)
    loops = cycles(g)
    detail = [
        " <-> ".join(loop) + ": " + "; ".join(str(e) for e in found if e.source in loop and e.target in loop)
        for loop in loops
    ]
    assert not loops, "import cycles:\n" + "\n".join(detail)


def test_kernels_are_the_bottom_floor(graph):
    """``kernels/`` imports nothing of the package outside ``convfirstnet.kernels``, and nothing imports
    a top-level ``kernels`` (that import name is another project's)."""
    _, found = graph
    bad = [e for e in found if _within(e.source, KERNELS) and not _within(e.target, KERNELS)]
    bad += [e for e in found if e.target == "kernels"]
    assert not bad, "\n".join(map(str, bad))


def test_commands_are_the_top_floor(graph):
    """Only the commands (and ``python -m convfirstnet``) import ``convfirstnet.commands``: the
    library and the analysis library below them never do."""
    mods, found = graph
    assert COMMANDS in mods and ANALYSIS in mods
    bad = [
        e
        for e in found
        if _within(e.target, COMMANDS) and not _within(e.source, COMMANDS) and e.source not in COMMAND_ENTRY
    ]
    assert not bad, "\n".join(map(str, bad))
    assert not [e for e in found if _within(e.source, ANALYSIS) and _within(e.target, COMMANDS)]


def test_no_private_names_across_folders(graph):
    """``from a.b import _helper`` only within one folder: a helper other folders need is public."""
    mods, found = graph
    bad = [
        e
        for e in found
        if e.name is not None
        and e.name.startswith("_")
        and not e.name.startswith("__")
        and mods[e.source].folder != mods[e.target].folder
    ]
    assert not bad, "\n".join(map(str, bad))


def test_pyproject_lists_every_package():
    """Every folder of the package with an ``__init__.py`` ships (``[tool.setuptools] packages``)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m.name for m in modules().values() if m.is_package}
    assert packages <= listed, f"not in pyproject.toml: {sorted(packages - listed)}"
