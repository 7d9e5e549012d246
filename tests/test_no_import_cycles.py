"""No import circle in lightning_accel: its modules' import-time imports form a graph without cycles (issue 34).

Read statically (ast), so it costs no import. What counts as module ``A`` depending on ``B``
is what Python runs when ``A`` is imported: the imports of its module body (``if``, ``try``
and ``with`` blocks included; not ``if TYPE_CHECKING:``, not imports inside functions). A
name taken from a package, ``from P import x``, depends on ``P``'s ``__init__`` (the name
is read from its namespace, which that ``__init__`` may still be filling: the package-init
loop, ``P/__init__`` importing ``P.m`` which imports ``from P import ...``), and on the
module ``x`` really comes from: ``P.x`` when it is a submodule, else the module ``P``'s
``__init__`` re-exports it from. ``import P.m`` depends on ``P.m`` only.

``python tests/test_no_import_cycles.py`` lists the cycles, each with its edges.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module name -> the modules of ``package`` (under ``root``) that importing it runs or reads from."""
    modules: dict[str, tuple[ast.Module, bool]] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (ast.parse(path.read_text()), is_package)

    def absolute(module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        anchor = (module if modules[module][1] else module.rpartition(".")[0]).split(".")
        anchor = anchor[: len(anchor) - node.level + 1]
        return ".".join(anchor + ([node.module] if node.module else []))

    def origin(base: str, name: str, seen: frozenset[tuple[str, str]] = frozenset()) -> str:
        """The module that defines ``base.name``: a submodule, or where a package's ``__init__`` imports it from."""
        if f"{base}.{name}" in modules:
            return f"{base}.{name}"
        if base in modules and modules[base][1] and (base, name) not in seen:
            for node in _import_time(modules[base][0].body):
                if isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        if (alias.asname or alias.name) == name:
                            return origin(absolute(base, node), alias.name, seen | {(base, name)})
        return base

    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, (tree, _) in modules.items():
        for node in _import_time(tree.body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = absolute(module, node)
                targets = [origin(base, alias.name) for alias in node.names] + [base]
            graph[module].update(t for t in targets if t in modules and t != module)
    return graph


def _import_time(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module body runs."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = node.test
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                yield from _import_time(node.orelse)
            else:
                yield from _import_time(node.body)
                yield from _import_time(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _import_time(block)
        elif isinstance(node, ast.With):
            yield from _import_time(node.body)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    lines = []
    for component in found:
        lines.append(" <-> ".join(component))
        lines += [f"    {m} -> {', '.join(sorted(graph[m] & set(component)))}" for m in component]
    return "\n".join(lines)


def test_lightning_accel_has_no_import_cycle() -> None:
    graph = import_graph(ROOT, "lightning_accel")
    assert len(graph) > 100  # the package was found and read
    found = cycles(graph)
    assert not found, "import cycles (break them by moving code where it belongs):\n" + describe(graph, found)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_package_init_loop_and_a_re_export_loop_are_found(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from pkg import b\nA = 1\n",  # pkg -> pkg.a -> pkg (its namespace): the package-init loop
        "pkg/b.py": "",
        "pkg/sub/__init__.py": "from .c import C\n",
        "pkg/sub/c.py": "from pkg.d import D\nC = 1\n",
        "pkg/d.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.b import B\nfrom pkg.sub import C\nD = 1\n",
        "pkg/e.py": "def f():\n    from pkg.a import A\n",  # at call time: no edge
    })
    graph = import_graph(tmp_path, "pkg")
    assert cycles(graph) == [["pkg", "pkg.a"], ["pkg.d", "pkg.sub", "pkg.sub.c"]]
    assert graph["pkg.e"] == set() and graph["pkg.d"] == {"pkg.sub", "pkg.sub.c"}


def test_importing_a_submodule_by_its_full_name_reads_no_package_namespace(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "import pkg.b as b\nfrom pkg.b import B\nA = 1\n",  # the fix for the loop above
        "pkg/b.py": "B = 1\n",
    })
    assert cycles(import_graph(tmp_path, "pkg")) == []


if __name__ == "__main__":
    package_graph = import_graph(ROOT, "lightning_accel")
    print(describe(package_graph, cycles(package_graph)) or "no import cycles")
    sys.exit(1 if cycles(package_graph) else 0)
