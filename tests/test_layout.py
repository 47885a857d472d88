"""The package's layout rules (shared/STYLE.md), read from the source with ``ast``: nothing here imports perfmon.

Imports are counted wherever they are written: at the top, under ``if TYPE_CHECKING:``, and inside functions
(a local import still ties two modules together, and hides a cycle from a reader).
"""

from __future__ import annotations

import ast
import io
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "perfmon"

#: A module over MAX_MODULE_LINES lines must say why in its first MARKER_WITHIN lines, in a comment or in its
#: docstring: a line holding MARKER followed by the reason.
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
MARKER = "over 500 lines:"
MARKER_WITHIN = 40


def _name(path: Path) -> str:
    """The dotted module name of a file under perfmon/ (a package's ``__init__.py`` is the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    """Every perfmon module, by dotted name."""
    return {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imports(name: str) -> set[str]:
    """The perfmon modules that module ``name`` imports anywhere in its source, relative imports resolved.

    ``from X import y`` imports ``X.y`` when that is a module (``from . import routes``), else ``X``; an import
    of a package's module does not count as importing the packages above it (they are already loaded)."""
    modules = _modules()
    path = modules[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            continue
        for target in targets:
            # `import perfmon.agent.clocks as c` names the module itself; a dotted name that is not a module
            # is an attribute of the deepest module it starts with.
            while target and target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

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
    return out


def _path_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest cycle through the component's first module (a -> b -> ... -> a), to name in a failure."""
    members = set(component)
    start = component[0]
    parent: dict[str, str | None] = {start: None}
    queue = [start]
    for v in queue:
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while (up := parent[path[-1]]) is not None:
                    path.append(up)
                return [*reversed(path), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return component  # not reached: a strongly connected component leads back to its start


def test_no_import_cycle_among_perfmon_modules() -> None:
    """No perfmon modules import each other, directly or in a circle, counting TYPE_CHECKING and local imports."""
    graph = {name: _imports(name) for name in _modules()}
    cycles = [" -> ".join(_path_within(graph, c)) + f"  (component: {', '.join(c)})" for c in _cycles(graph)]
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_nothing_under_http_imports_the_monitor() -> None:
    """No module under perfmon/http/ imports perfmon.monitor or the name Monitor: HTTP knows an Agent, not Monitor."""
    bad = []
    for name, path in _modules().items():
        if not name.startswith("perfmon.http."):
            continue
        if "perfmon.monitor" in _imports(name):
            bad.append(f"{name} imports perfmon.monitor")
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and any(a.name == "Monitor" for a in node.names):
                bad.append(f"{name} imports Monitor (line {node.lineno})")
    assert bad == []


def _marker_lines(path: Path) -> list[str]:
    """The comment and docstring lines among the first MARKER_WITHIN lines of a module."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    out = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT and tok.start[0] <= MARKER_WITHIN]
    body = _tree(path).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        first, last = body[0].lineno, body[0].end_lineno or body[0].lineno
        out += lines[first - 1: min(last, MARKER_WITHIN)]
    return out


def test_no_module_over_500_lines_without_a_reason() -> None:
    """A perfmon module over 500 lines carries `over 500 lines: <reason>` in a comment or its docstring near the top."""
    bad = []
    for path in _modules().values():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n <= MAX_MODULE_LINES:
            continue
        reasons = [line.split(MARKER, 1)[1].strip(" #\"'") for line in _marker_lines(path) if MARKER in line]
        if not any(reasons):
            bad.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert bad == [], f"modules over {MAX_MODULE_LINES} lines with no '{MARKER} <reason>' in their first " \
                      f"{MARKER_WITHIN} lines:\n" + "\n".join(bad)


def _class_lines(node: ast.ClassDef) -> int:
    """A class's length in lines, decorators included."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return (node.end_lineno or node.lineno) - first + 1


def test_no_class_over_300_lines() -> None:
    """No class in perfmon (nested ones included) spans more than 300 lines."""
    bad = []
    for path in _modules().values():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef) and _class_lines(node) > MAX_CLASS_LINES:
                bad.append(f"{path.relative_to(ROOT)}: class {node.name} is {_class_lines(node)} lines")
    assert bad == [], "\n".join(bad)


def test_monitor_is_under_300_lines() -> None:
    """perfmon/monitor.py's Monitor, the composition root, is under 300 lines: wiring, start/stop, fork, no more."""
    tree = _tree(PACKAGE / "monitor.py")
    monitor = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Monitor"]
    assert len(monitor) == 1, "perfmon/monitor.py defines no class Monitor at its top level"
    assert _class_lines(monitor[0]) < MAX_CLASS_LINES


def test_no_test_reads_the_monitors_hub() -> None:
    """No test reads a monitor's private hub (an attribute `_hub`): tests go through the public surface."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            named = (isinstance(node, ast.Attribute) and node.attr == "_hub") or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and node.args[1].value == "_hub")
            if named:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == [], "tests reading _hub:\n" + "\n".join(bad)
