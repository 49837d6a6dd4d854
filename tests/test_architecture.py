"""The shape of the `hyperpipe` package, read with `ast` (nothing is imported).

- no import cycle between modules (every `import` counts: function-level ones and those
  under `if TYPE_CHECKING:` included, relative ones resolved);
- the package order of docs/architecture.md's table: a module of package P imports only
  modules of P or of packages listed before P; `exec` takes from `sim` only the modules
  in EXEC_MAY_USE_FROM_SIM; `hyperpipe/__init__.py` and `__main__.py` sit on top (any
  module may read the top package's own attributes, such as `__version__`);
- schedule-kind names appear as string literals only in SCHEDULE_KIND_HOMES;
- no "issue N" and no "DESIGN.md" anywhere under hyperpipe/;
- every package's `__init__.py` has a docstring.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "hyperpipe"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"

# The modules where a schedule kind's name may be written as a string literal: the
# registry of schedule kinds and the generators of hyperpipe/plan.
SCHEDULE_KIND_HOMES = frozenset({
    "hyperpipe/plan/kinds.py",
    "hyperpipe/plan/generators_loop.py",
    "hyperpipe/plan/generators_v.py",
})
SCHEDULE_KIND_NAMES = frozenset({
    "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v", "synth"})

# The only modules of `sim` that `exec` may import: the cost model and its calibration.
EXEC_MAY_USE_FROM_SIM = frozenset({"hyperpipe.sim.costmodel", "hyperpipe.sim.calibrate"})

# Modules above every package: they may import anything.
TOP_MODULES = frozenset({"hyperpipe", "hyperpipe.__main__"})

PACKAGE_ROW = re.compile(r"^\|\s*`hyperpipe/(\w+)")
FORBIDDEN_TEXT = re.compile(r"\bissue \d|DESIGN\.md", re.IGNORECASE)


class Import(NamedTuple):
    """One import statement's target, as a module name, and where it was written."""

    importer: str       # dotted module name of the importing file
    target: str         # dotted module name imported (a module or a package)
    line: int


def module_name(path: Path) -> str:
    """`hyperpipe/sim/costmodel.py` -> `hyperpipe.sim.costmodel`; a package's
    `__init__.py` is named by its package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    """Every module under hyperpipe/, by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of hyperpipe, or None when `name`
    lies outside hyperpipe (the standard library, torch, ...)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _base_of_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if level > 1:
        package = package[: len(package) - (level - 1)]
    return ".".join(package + ([module] if module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every hyperpipe module that the file imports, wherever the statement stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (node.module or "") if node.level == 0 else _base_of_relative(
                name, is_package, node.level, node.module)
            # `from pkg import sub` imports the module pkg.sub when there is one.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        else:
            continue
        for target in names:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != name:
                found.append(Import(name, resolved, node.lineno))
    return found


def import_graph() -> dict[str, list[Import]]:
    modules = source_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, list[Import]]) -> list[tuple[list[str], list[str]]]:
    """One cycle per strongly connected component of more than one module (Tarjan),
    written as the module path that closes on itself, with the component's modules."""
    edges = {m: sorted({i.target for i in imps}) for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, []):
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
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [(_cycle_within(set(c), edges), c) for c in components]


def _cycle_within(component: set[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest cycle through the component's first module, by breadth-first search."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in edges[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in component and w not in parent:
                    parent[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def package_of(module: str) -> str | None:
    """`hyperpipe.sim.costmodel` -> `sim`; None for the top modules."""
    if module in TOP_MODULES:
        return None
    return module.split(".")[1]


def package_order() -> list[str]:
    """The packages in the order of docs/architecture.md's table, lowest first."""
    if not ARCHITECTURE_DOC.exists():
        pytest.fail(f"{ARCHITECTURE_DOC.relative_to(ROOT)} is missing: its package table "
                    "(rows starting with | `hyperpipe/<package>`) gives the package order")
    order = [m.group(1) for line in ARCHITECTURE_DOC.read_text(encoding="utf-8").splitlines()
             if (m := PACKAGE_ROW.match(line))]
    if not order:
        pytest.fail(f"{ARCHITECTURE_DOC.relative_to(ROOT)} has no package table "
                    "(rows starting with | `hyperpipe/<package>`)")
    return list(dict.fromkeys(order))


def layering_violations(graph: dict[str, list[Import]], order: list[str]) -> list[str]:
    rank = {package: i for i, package in enumerate(order)}
    problems = []
    for importer, imps in sorted(graph.items()):
        own = package_of(importer)
        if own is None:
            continue
        for imp in imps:
            theirs = package_of(imp.target)
            where = f"{importer} (line {imp.line}) imports {imp.target}"
            if imp.target == "hyperpipe":
                continue        # the top package's own attributes (__version__), always loaded
            if theirs is None:
                problems.append(f"{where}: the top of the package, above every package")
            elif theirs == own:
                continue
            elif rank[theirs] > rank[own]:
                problems.append(f"{where}: {theirs} comes after {own} in the package order")
            elif (own == "exec" and theirs == "sim"
                  and imp.target not in EXEC_MAY_USE_FROM_SIM):
                problems.append(f"{where}: exec may use from sim only "
                                f"{sorted(EXEC_MAY_USE_FROM_SIM)}")
    return problems


def _docstring_nodes(tree: ast.AST) -> set[ast.Constant]:
    """The string constants that are docstrings (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                found.add(body[0].value)
    return found


def schedule_kind_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docstrings = _docstring_nodes(tree)
    return [f"line {node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in SCHEDULE_KIND_NAMES and node not in docstrings]


# ------------------------------------------------------------------ the checks


def test_the_graph_sees_every_kind_of_import():
    """The reader resolves relative, function-level and TYPE_CHECKING imports."""
    graph = import_graph()
    targets = {i.target for imps in graph.values() for i in imps}
    assert "hyperpipe.core.errors" in targets
    assert len(graph) > 50 and all(name.startswith("hyperpipe") for name in graph)


def test_no_import_cycle_between_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(
        f"{' -> '.join(cycle)}   (modules in the cycle: {', '.join(members)})"
        for cycle, members in cycles)


def test_packages_import_only_packages_before_them():
    graph = import_graph()
    order = package_order()
    present = sorted({p for m in graph if (p := package_of(m)) is not None})
    missing = [p for p in present if p not in order]
    assert not missing, (f"packages not in {ARCHITECTURE_DOC.relative_to(ROOT)}'s table: "
                         f"{missing} (table: {order})")
    problems = layering_violations(graph, order)
    assert not problems, "imports against the package order:\n" + "\n".join(problems)


def test_schedule_kind_names_live_in_the_registry_and_generators():
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in SCHEDULE_KIND_HOMES:
            continue
        found += [f"{relative} {hit}" for hit in schedule_kind_literals(path)]
    assert not found, ("schedule-kind names written outside "
                       f"{sorted(SCHEDULE_KIND_HOMES)}:\n" + "\n".join(found))


def test_no_issue_numbers_or_design_md_in_the_package():
    found = []
    for path in sorted(p for p in PACKAGE_DIR.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                  for n, line in enumerate(text.splitlines(), 1)
                  if FORBIDDEN_TEXT.search(line)]
    assert not found, "history belongs in commit messages:\n" + "\n".join(found)


def test_every_package_init_has_a_docstring():
    problems = []
    folders = sorted({p.parent for p in PACKAGE_DIR.rglob("*.py")})
    for folder in folders:
        init = folder / "__init__.py"
        if not init.exists():
            problems.append(f"{folder.relative_to(ROOT)}: no __init__.py")
        elif not ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))):
            problems.append(f"{init.relative_to(ROOT)}: no docstring")
    assert not problems, "\n".join(problems)


def test_the_cycle_finder_finds_cycles():
    def graph(edges: dict[str, list[str]]) -> dict[str, list[Import]]:
        return {m: [Import(m, t, 1) for t in ts] for m, ts in edges.items()}

    assert find_cycles(graph({"a": ["b"], "b": ["c"], "c": []})) == []
    assert find_cycles(graph({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]})) == [
        (["a", "b", "c", "a"], ["a", "b", "c"])]


def test_relative_imports_resolve_from_the_importing_module():
    assert _base_of_relative("hyperpipe.sim.program", False, 1, "simulator") == (
        "hyperpipe.sim.simulator")
    assert _base_of_relative("hyperpipe.sim", True, 1, "costmodel") == "hyperpipe.sim.costmodel"
    assert _base_of_relative("hyperpipe.search.peers.amp", False, 2, "space") == (
        "hyperpipe.search.space")
    assert _base_of_relative("hyperpipe.sim.program", False, 2, None) == "hyperpipe"


def test_the_layering_check_flags_upward_imports():
    def graph(edges: dict[str, list[str]]) -> dict[str, list[Import]]:
        return {m: [Import(m, t, 1) for t in ts] for m, ts in edges.items()}

    order = ["core", "plan", "sim", "exec", "cli"]
    assert layering_violations(graph({
        "hyperpipe.sim.a": ["hyperpipe.core.b", "hyperpipe.plan.c", "hyperpipe.sim.d"],
        "hyperpipe.exec.e": ["hyperpipe.sim.costmodel", "hyperpipe.sim.calibrate"],
        "hyperpipe.cli.f": ["hyperpipe", "hyperpipe.exec.e"]}), order) == []
    problems = layering_violations(graph({
        "hyperpipe.plan.a": ["hyperpipe.sim.b"],
        "hyperpipe.exec.c": ["hyperpipe.sim.simulator"],
        "hyperpipe.core.d": ["hyperpipe.__main__"]}), order)
    assert len(problems) == 3                 # sorted by importer: core, exec, plan
    assert "top of the package" in problems[0] and "exec may use" in problems[1]
    assert "sim comes after plan" in problems[2]


def test_docstrings_are_not_kind_literals(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""1f1b"""\n\n\ndef f():\n    """gpipe"""\n    return "zb-v", "zb-v-ish"\n')
    assert schedule_kind_literals(path) == ["line 6: 'zb-v'"]
