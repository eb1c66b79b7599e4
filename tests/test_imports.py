"""The package has no import cycles (issue 16): every module can be read, imported and
tested below the modules that use it. And its rooms stay small (issue 27): no class over
:data:`MAX_CLASS_LINES` lines, no module over :data:`MAX_MODULE_LINES`.

The graph is built from the source with ``ast`` (nothing is imported). An edge ``A -> B``
is any ``import`` / ``from ... import`` in module ``A`` that names module ``B`` (or a
submodule of a package, ``from .pkg import mod``), **at module level or inside a
function**: a lazy import inside a function only postpones the cycle to run time, and a
cycle dodged that way is still a cycle in the design. Imports under
``if TYPE_CHECKING:`` are not edges (they never run and exist only for annotations).
Implicit parent-package imports are not edges either (a package's ``__init__`` runs
before any of its modules whatever they import); an explicit ``from .pkg import name``
is an edge to ``pkg/__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Cycles that are known and owned by other work. Each entry must still exist: once the
# cycle is gone the test fails until the entry is removed, so the list cannot go stale.
KNOWN_CYCLES: set[frozenset[str]] = set()  # none left


def _modules(src: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the modules under ``src``."""
    modules = _modules(src)
    graph: dict[str, set[str]] = {}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        edges: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target in modules:
                    edges.add(target)
                edges.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted,
    with one concrete cycle through them for the message."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One cycle inside ``component``, as ``a -> b -> a``."""
    members, start = set(component), component[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth-first back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    hops = [v]
                    while hops[-1] != start:
                        hops.append(prev[hops[-1]])
                    return " -> ".join([*reversed(hops), start])
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return " <-> ".join(component)


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "treerl.trainer" in graph  # the scan found the package
    found = cycles(graph)
    new = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(_path(graph, c) for c in new)
    stale = [sorted(c) for c in KNOWN_CYCLES if list(sorted(c)) not in found]
    assert not stale, f"these known cycles are gone: remove them from KNOWN_CYCLES: {stale}"


MAX_CLASS_LINES, MAX_MODULE_LINES = 400, 600


def oversized(src: Path = SRC) -> list[str]:
    """``path: what`` for every module over :data:`MAX_MODULE_LINES` lines and every class
    (decorators included) over :data:`MAX_CLASS_LINES` under ``src``."""
    out = []
    for path in sorted(src.rglob("*.py")):
        text, name = path.read_text(), path.relative_to(src)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            out.append(f"{name}: module of {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - min([node.lineno] + [d.lineno for d in node.decorator_list]) + 1
                if lines > MAX_CLASS_LINES:
                    out.append(f"{name}: class {node.name} of {lines} lines")
    return out


def test_no_class_over_400_lines_no_module_over_600():
    found = oversized()
    assert not found, "split these along their seams:\n" + "\n".join(found)


def test_the_size_check_counts_classes_and_modules(tmp_path):
    """The checker itself: a class one line over the limit (with its decorator) and a
    module one line over are found; ones at the limit are not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES - 2))
    (tmp_path / "a.py").write_text(f"@dataclass\nclass Big:\n{body}\n    y = 0\n")
    (tmp_path / "b.py").write_text(f"@dataclass\nclass Fits:\n{body}\n")
    (tmp_path / "c.py").write_text("\n".join(["x = 0"] * (MAX_MODULE_LINES + 1)))
    (tmp_path / "d.py").write_text("\n".join(["x = 0"] * MAX_MODULE_LINES))
    assert oversized(tmp_path) == [f"a.py: class Big of {MAX_CLASS_LINES + 1} lines",
                                   f"c.py: module of {MAX_MODULE_LINES + 1} lines"]


def test_the_scan_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: a cycle through a function-level relative import is found; a
    TYPE_CHECKING-only import is not an edge."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import B\n")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("B = 1\ndef f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    (pkg / "d.py").write_text("import p.c\n")
    graph = import_graph(tmp_path)
    assert graph["p.a"] == {"p.sub", "p.sub.b"} and graph["p.sub.b"] == {"p.a"}
    assert graph["p.c"] == set() and graph["p.d"] == {"p.c"}
    assert cycles(graph) == [["p.a", "p.sub", "p.sub.b"]]  # p.sub's __init__ imports b, too
    assert _path(graph, ["p.a", "p.sub", "p.sub.b"]) == "p.a -> p.sub.b -> p.a"
