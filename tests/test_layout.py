"""The shape of the tree: layers, import direction, no cycles, files short enough to read.

The import graph is read from the source (ast), every import statement counted wherever it
stands: at module level, inside a function, or under `if TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "registry", "models_jax", "runtime")
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that `name` (a module or a module attribute) refers to."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                out.add(target)
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "runtime" and len(parts) > 1 else parts[0]


def test_no_file_is_longer_than_a_sitting():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
            connect(v)
    return found


def test_the_import_graph_has_no_cycle():
    cycles = _cycles(GRAPH)
    assert not cycles, "modules that import each other (directly or around a loop): " + "; ".join(
        " <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("layer, allowed", [
    ("runtime.ops", {"runtime.ops"}),
    ("runtime.engine", {"runtime.engine", "runtime.ops"}),
    ("models_jax", {"models_jax", "runtime.ops"}),
    ("registry", {"registry", "models_jax", "runtime.ops"}),
    ("app", {"app", "registry", "runtime", "runtime.engine", "runtime.ops"}),
])
def test_imports_point_one_way(layer, allowed):
    wrong = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if _layer(m) == layer
                   for t in targets if _layer(t) not in allowed)
    assert not wrong, f"{layer} may import only {sorted(allowed)}: {wrong}"


def test_the_runner_knows_neither_the_scheduler_nor_the_request_class():
    runner = [m for m in GRAPH if m.startswith("runtime.engine.runner") or m == "runtime.engine.programs"]
    assert "runtime.engine.runner" in runner
    for module in runner:
        assert not GRAPH[module] & {"runtime.engine.scheduler", "runtime.engine.request"}, module


def test_the_layout_test_sees_a_cycle_and_a_wrong_direction():
    """The checks above would fail on a tree that breaks them (guards against a reader that sees nothing)."""
    assert "runtime.ops.step" in GRAPH["models_jax.llama"]
    assert "runtime.engine.scheduler" in GRAPH["runtime.engine.core"]
    assert _resolve("runtime.ops.step.StepInput") == "runtime.ops.step"
    assert _layer("runtime.engine.core") == "runtime.engine" and _layer("runtime") == "runtime"
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
