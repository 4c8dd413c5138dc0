"""The package's shape: one concept per module (at most 500 lines), an import graph without cycles,
Hydra only in train.py, and no reference to a document outside the repository."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "snake_strategy"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, package: str) -> set[str]:
    """Module-level imports of snake_strategy modules (TYPE_CHECKING blocks and function bodies excluded)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("snake_strategy")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("snake_strategy"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_no_module_over_500_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > 500} == {}


def test_import_graph_has_no_cycle():
    modules = _modules()
    graph = {name: {m for m in _imports(path, name) if m in modules and m != name} for name, path in modules.items()}
    # A package's __init__ importing its own submodules is not a cycle of concepts: skip package -> child.
    graph = {n: {m for m in deps if not m.startswith(n + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_hydra_only_in_train_and_no_outside_documents():
    for name, path in _modules().items():
        text = path.read_text()
        if name != "snake_strategy.train":
            assert "import hydra" not in text and "from hydra" not in text, name
        assert "greedysnake.md" not in text and "shared/design" not in text, name
