"""The import rules of ``src/llmgw`` (docs/architecture.md, "The process").

1. No import circles: every import that runs counts (module level, inside
   functions, under ``if``/``try``); only ``if TYPE_CHECKING:`` bodies are left
   out. ``select("x")`` from :mod:`llmgw._accel` counts as an import of
   ``llmgw._fast.x_py`` (the pure twin, which imports what the compiled one does).
2. ``llmgw._fast`` is the bottom layer: it imports the standard library,
   third-party packages, ``llmgw.errors``, ``llmgw.log``, ``llmgw._accel`` and its
   own siblings, never the public modules built on top of it.

The modules are read with :mod:`ast`, never imported.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = "llmgw"

@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def module_names(src: Path = SRC) -> dict[str, Path]:
    """Every module under ``src/llmgw``: dotted name -> file (packages by their ``__init__``)."""
    out: dict[str, Path] = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``<anything>.TYPE_CHECKING`` (``typing.TYPE_CHECKING``, ``t.TYPE_CHECKING``)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return False


def _is_not_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _is_type_checking(test.operand)


def runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that can run, leaving out the bodies of ``if TYPE_CHECKING:`` (their ``else:`` runs)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(reversed(node.orelse))
            continue
        if isinstance(node, ast.If) and _is_not_type_checking(node.test):
            stack.extend(reversed(node.body))
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve_from(node: ast.ImportFrom, name: str, path: Path) -> str:
    if node.level == 0:
        return node.module or ""
    base = _package_of(name, path).split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _with_parents(target: str) -> list[str]:
    """``a.b.c`` imports ``a``, ``a.b`` and ``a.b.c``."""
    parts = target.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _literal(call: ast.Call) -> str | None:
    if len(call.args) == 1 and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names, else ``None``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _callee(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _ancestors(name: str, path: Path) -> set[str]:
    """The packages whose ``__init__`` has started before ``name`` runs (and ``name`` itself)."""
    parts = name.split(".")
    return {".".join(parts[: i + 1]) for i in range(len(parts))}


def imports_of(name: str, path: Path, source: str | None = None, modules: set[str] | None = None) -> list[Edge]:
    """The modules ``name`` imports when it runs (any module, in llmgw or not), in source order.

    Importing ``a.b.c`` imports ``a``, ``a.b`` and ``a.b.c``; the packages that
    ``name`` lies in are left out (they are already being imported when it runs).
    ``from pkg import x`` imports the submodule ``pkg.x`` when there is one, else
    reads ``x`` off ``pkg``: with ``modules`` (every module name) only the one
    that applies is kept; without it, both.
    """
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    own = _ancestors(name, path)
    edges: list[Edge] = []
    selects: set[str] = set()  # local names of llmgw._accel.select
    accels: set[str] = {"llmgw._accel"}  # local (dotted) names of the llmgw._accel module
    calls: list[ast.Call] = []

    def add(target: str, line: int, *, itself: bool = True) -> None:
        parents = _with_parents(target)
        if not itself:
            parents.pop()
        edges.extend(Edge(name, t, line) for t in parents if t and t not in own)

    for node in runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
                if alias.name == "llmgw._accel" and alias.asname:
                    accels.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, name, path)
            for a in node.names:
                if base == "llmgw._accel" and a.name == "select":
                    selects.add(a.asname or a.name)
                elif base == "llmgw" and a.name == "_accel":
                    accels.add(a.asname or a.name)
            names = [a.name for a in node.names]
            subs = [f"{base}.{n}" for n in names if n != "*" and (modules is None or f"{base}.{n}" in modules)]
            reads_base = modules is None or len(subs) < len(names)
            add(base, node.lineno, itself=False)
            if reads_base and base:
                # the package's own namespace is read: its __init__ must have run, even from inside it
                edges.append(Edge(name, base, node.lineno))
            edges.extend(Edge(name, s, node.lineno) for s in subs)
        elif isinstance(node, ast.Call):
            calls.append(node)
    for call in calls:
        callee, arg = _callee(call), _literal(call)
        if arg is None:
            continue
        if callee == "import_module":
            add(arg, call.lineno)
        elif _dotted(call.func) in selects or (
            isinstance(call.func, ast.Attribute) and call.func.attr == "select" and _dotted(call.func.value) in accels
        ):
            # llmgw._accel.select("x"): the compiled llmgw._fast.x or its twin x_py, which imports the same
            add(f"llmgw._fast.{arg}_py", call.lineno)
    return edges


def module_graph(src: Path = SRC) -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """Module -> the llmgw modules it imports at run time, and the first line of each edge."""
    mods = module_names(src)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    lines: dict[tuple[str, str], int] = {}
    for m, path in mods.items():
        for e in imports_of(m, path, modules=set(mods)):
            if e.target in mods and e.target != m:
                graph[m].add(e.target)
                lines.setdefault((m, e.target), e.line)
    return graph, lines


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    work: list[tuple[str, Iterator[str]]] = []  # the DFS path: (node, its successors not yet seen)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        work.append((v, iter(sorted(graph.get(v, ())))))

    for root in sorted(graph):
        if root in index:
            continue
        visit(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    visit(w)
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
                if low[v] == index[v]:
                    comp: list[str] = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in graph.get(v, ()):
                        out.append(sorted(comp))
    return sorted(out)


def a_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One concrete circle through the first module of ``comp`` (for the failure message)."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def describe_cycles(graph: dict[str, set[str]], lines: dict[tuple[str, str], int]) -> list[str]:
    out = []
    for comp in strongly_connected(graph):
        cyc = a_cycle(graph, comp)
        steps = " -> ".join(
            f"{a} (line {lines[(a, b)]})" for a, b in itertools.pairwise(cyc)
        ) + f" -> {cyc[-1]}"
        out.append(f"{len(comp)} modules: {', '.join(comp)}\n    e.g. {steps}")
    return out


def test_no_import_cycles() -> None:
    graph, lines = module_graph()
    found = describe_cycles(graph, lines)
    assert not found, "import circles in src/llmgw (calls and imports go downward only):\n  " + "\n  ".join(found)


# -- the bottom layer --

_FAST = "llmgw._fast"
_FAST_MAY_IMPORT = {"llmgw", "llmgw.errors", "llmgw.log", "llmgw._accel"}


def fast_violations() -> list[str]:
    """``<module> (line N) imports <target>`` for each import out of the bottom layer."""
    mods = module_names()
    out = []
    for m, path in mods.items():
        if not (m == _FAST or m.startswith(_FAST + ".")):
            continue
        for e in imports_of(m, path, modules=set(mods)):
            t = e.target
            if t.split(".")[0] != ROOT or t in _FAST_MAY_IMPORT or t == _FAST or t.startswith(_FAST + "."):
                continue
            if t not in mods and t.rpartition(".")[0] in _FAST_MAY_IMPORT:
                continue  # ``from llmgw.errors import X``: X is a name, not a module
            out.append(f"{m} (line {e.line}) imports {t}")
    return sorted(set(out))


def test_fast_modules_import_only_the_bottom_layer() -> None:
    found = fast_violations()
    assert not found, (
        "llmgw._fast imports only the standard library, third-party packages, llmgw.errors, llmgw.log, "
        "llmgw._accel and its own siblings:\n  " + "\n  ".join(found)
    )


# -- the walker itself --


def _edges(source: str, name: str = "llmgw.pkg.mod", file: str = "llmgw/pkg/mod.py") -> set[str]:
    return {e.target for e in imports_of(name, Path(file), source)}


def test_walker_counts_every_runtime_import() -> None:
    src = '''
import a.b.c
from . import sibling
from .x import (one, two)
from ..up import thing
from .. import top
try:
    import in_try
except ImportError:
    import in_except
if cond:
    import in_if
else:
    from .in_else import z

def f():
    from .deferred import g
    import in_function

class C:
    def m(self):
        import in_method

from typing import TYPE_CHECKING
import typing
if TYPE_CHECKING:
    import hidden_1
else:
    import shown_else
if typing.TYPE_CHECKING:
    import hidden_2
if not TYPE_CHECKING:
    import shown_not
else:
    import hidden_3
'''
    got = _edges(src)
    for want in (
        "a", "a.b", "a.b.c",
        "llmgw.pkg", "llmgw.pkg.sibling",
        "llmgw.pkg.x", "llmgw.pkg.x.one", "llmgw.pkg.x.two",
        "llmgw.up", "llmgw.up.thing",
        "llmgw.top",
        "in_try", "in_except", "in_if", "llmgw.pkg.in_else",
        "llmgw.pkg.deferred", "in_function", "in_method",
        "shown_else", "shown_not",
    ):
        assert want in got, want
    for hidden in ("hidden_1", "hidden_2", "hidden_3"):
        assert hidden not in got, hidden


def test_walker_resolves_relative_imports_in_a_package_init() -> None:
    got = _edges("from . import sub\nfrom .other import x\n", "llmgw.pkg", "llmgw/pkg/__init__.py")
    assert {"llmgw.pkg.sub", "llmgw.pkg.other"} <= got


def test_walker_follows_accel_select_and_import_module() -> None:
    src = '''
from typing import TYPE_CHECKING
from .._accel import select
from llmgw._accel import select as pick
from .. import _accel
import llmgw._accel
import llmgw._accel as acc
import importlib
if TYPE_CHECKING:
    from .._fast.hidden_py import X
    select("hidden2")
else:
    _impl = select("dataplane")
pick("one")
_accel.select("two")
llmgw._accel.select("three")
acc.select("four")
other.select("not_a_module")
select(name_not_a_literal)

def later():
    return importlib.import_module("llmgw.lazy")
'''
    got = _edges(src)
    for want in ("dataplane", "one", "two", "three", "four"):
        assert f"llmgw._fast.{want}_py" in got, want
    assert "llmgw.lazy" in got
    for hidden in ("hidden", "hidden2", "not_a_module"):
        assert f"llmgw._fast.{hidden}_py" not in got, hidden


def test_tarjan_finds_each_circle_once() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": {"g"}}
    assert strongly_connected(graph) == [["a", "b", "c"], ["d", "e"], ["g"]]
    assert a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
