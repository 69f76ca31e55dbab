"""ops/ stays a leaf layer: it imports only kvlearn.errors and other ops modules, with no import cycle; no kvlearn
module imports another module's private (``_name``) function; and kvlearn's modules import each other in no circle."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def kvlearn_imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, imported names)`` for every ``kvlearn`` import of one file, relative imports resolved."""
    package = list(path.relative_to(SRC).with_suffix("").parts)[:-1]  # the package the file belongs to
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []  # level 1: this package
            module = ".".join(base + ([node.module] if node.module else []))
            if module.startswith("kvlearn"):
                out.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("kvlearn")]
    return out


def ops_graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted((SRC / "kvlearn" / "ops").glob("*.py")):
        deps = set()
        for module, names in kvlearn_imports(path):
            deps.add(module)
            deps.update(f"{module}.{n}" for n in names if (SRC / module.replace(".", "/") / f"{n}.py").is_file())
        graph[f"kvlearn.ops.{path.stem}"] = deps
    return graph


def assert_no_cycle(graph: dict[str, set[str]]) -> None:
    """Depth-first walk of ``graph`` (module -> imported modules); fails naming the first circle it finds."""
    done, active = set(), []

    def visit(module):
        assert module not in active, f"import cycle: {' -> '.join(active[active.index(module):] + [module])}"
        if module in done or module not in graph:
            return
        active.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        active.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_ops_imports_only_errors_and_ops():
    for module, deps in ops_graph().items():
        outside = sorted(d for d in deps if d != "kvlearn.errors" and not d.startswith("kvlearn.ops"))
        assert not outside, f"{module} imports {outside}"


def test_ops_has_no_import_cycle():
    assert_no_cycle(ops_graph())


def test_no_private_name_crosses_modules():
    crossing = [f"{path.relative_to(SRC)}: from {module} import {name}"
                for path in sorted((SRC / "kvlearn").rglob("*.py"))
                for module, names in kvlearn_imports(path)
                for name in names if name.startswith("_") and not name.startswith("__")]
    assert not crossing, crossing


def package_graph() -> dict[str, set[str]]:
    """Every kvlearn module (a package is its ``__init__``) -> the kvlearn modules it imports, function-level
    imports included."""
    graph = {}
    for path in sorted((SRC / "kvlearn").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps = set()
        for module, names in kvlearn_imports(path):
            deps.add(module)
            deps.update(f"{module}.{n}" for n in names if (SRC / module.replace(".", "/") / f"{n}.py").is_file())
        graph[name] = deps - {name}
    return graph


def test_kvlearn_has_no_import_cycle():
    """No circle of imports among kvlearn's modules, lazy (function-level) imports included; the top-level package,
    which only re-exports the public API, is left out."""
    graph = {m: {d for d in deps if d != "kvlearn"} for m, deps in package_graph().items() if m != "kvlearn"}
    assert_no_cycle(graph)


def top_level_graph() -> dict[str, set[str]]:
    """kvlearn's top-level packages and modules (``kvpop``, ``train``, ``hf``, ...) -> those their modules import,
    function-level imports included; the top-level package itself (it only re-exports) is left out."""
    def top(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    graph: dict[str, set[str]] = {}
    for module, deps in package_graph().items():
        if module != "kvlearn":
            graph.setdefault(top(module), set()).update(top(d) for d in deps if d != "kvlearn")
    return {name: deps - {name} for name, deps in graph.items()}


def test_top_level_packages_import_each_other_in_no_circle():
    """The packages stand in layers (ops at the bottom, then cache and testbed, hf, the methods, kaizen and eval,
    checkpoint, train, cli): a lower one never imports a higher one, not even inside a function, so each layer can
    be read and tested without the ones above it. Two such imports once ran back up (``hf`` -> ``kvpop`` for the
    sparse chunk attention, ``kaizen`` -> ``train`` for the KD loss): both functions are pure tensor functions and
    now live in ``ops`` (``docs/DESIGN.md`` section 2)."""
    graph = top_level_graph()
    assert {"ops", "cache", "hf", "kvpop", "kaizen", "train", "cli"} <= set(graph)  # the walk sees the packages
    assert_no_cycle(graph)


def test_a_circle_of_packages_is_found():
    """The check above fails on a circle two packages apart (the shape the old ``hf`` -> ``kvpop`` import made)."""
    with pytest.raises(AssertionError, match="import cycle: hf -> kvpop -> hf"):
        assert_no_cycle({"hf": {"kvpop", "ops"}, "kvpop": {"hf"}, "ops": set()})
