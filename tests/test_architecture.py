"""The package's layers: no import cycle among cupyconv's modules, imports inside functions included."""
import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cupyconv"


def module_names(package: Path) -> Dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(current: str, is_package: bool, level: int, target: str) -> str:
    if not level:
        return target
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph(package: Path) -> Dict[str, Set[str]]:
    """module -> the package's modules it imports, at module level or inside functions."""
    modules = module_names(package)
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module or "")
                # "from package import module" imports the module; "from module import name" the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_imports(package: Path):
    """(importing module, imported module, names) of every import of the package's own modules."""
    modules = module_names(package)
    root = package.name
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == root:
                        yield name, alias.name, ()
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module or "")
                if base.split(".")[0] == root:
                    yield name, base, tuple(a.name for a in node.names)


def test_every_import_of_the_package_resolves():
    """Imports inside functions run late: a wrong one would only fail when its function runs."""
    import importlib

    modules = module_names(PACKAGE)
    checked = 0
    for importer, target, names in package_imports(PACKAGE):
        assert target in modules, f"{importer} imports {target}, which is not a module of the package"
        if names:
            loaded = importlib.import_module(target)
            for n in names:
                assert f"{target}.{n}" in modules or hasattr(loaded, n), f"{importer}: {target} has no {n}"
        checked += 1
    assert checked > 50


def test_no_import_cycle_in_the_package():
    graph = import_graph(PACKAGE)
    assert len(graph) > 20 and graph["cupyconv.engine"], "the import graph was not read"
    assert cycles(graph) == []


def test_the_tuner_never_imports_the_engine_or_the_plans():
    graph = import_graph(PACKAGE)
    for name in ("cupyconv.tuning.variants", "cupyconv.tuning.store", "cupyconv.tuning.decide"):
        assert not {m for m in graph[name] if m == "cupyconv.engine" or m.startswith("cupyconv.plans")}, name


def test_the_core_imports_nothing_above_it():
    graph = import_graph(PACKAGE)
    for name, targets in graph.items():
        if name.startswith("cupyconv.core"):
            assert all(t.startswith("cupyconv.core") for t in targets), (name, targets)


@pytest.mark.parametrize("inside_function", [False, True])
def test_the_check_finds_a_cycle(tmp_path, inside_function):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    body = "def f():\n    from .. import a\n" if inside_function else "from ..a import something\n"
    (pkg / "sub" / "b.py").write_text(body)
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
