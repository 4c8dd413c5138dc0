"""The package's shape: one concept per module (about 500 lines; a longer one is named here, says why in
the first line of its docstring, and stays under 800), an import graph without cycles (every import
counts, function-level ones too; only ``TYPE_CHECKING`` blocks are annotations), Hydra only in train.py,
and no reference to a document outside the repository."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "snake_strategy"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, package: str) -> set[str]:
    """Every import of a snake_strategy module, at any depth (function bodies included): an import inside a
    function is a dependency all the same, made at the first call. ``if TYPE_CHECKING:`` blocks are skipped:
    they are annotations, never executed."""
    found = set()
    pending = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("snake_strategy")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("snake_strategy"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


SIZE_GUIDE_LINES = 500  # one concept per module is about this long at most
SIZE_LIMIT_LINES = 800  # past the guide a module says why at its top; nothing is longer than this
# The modules past the guide. Each one's docstring opens with a one-line reason (a whole sentence on the
# first line); a new long module is split, or gets its reason and its name here, where a review sees both.
LONGER_THAN_THE_GUIDE = {"snake_strategy.engine.training"}


def _first_docstring_line(path: Path) -> str:
    return (ast.get_docstring(ast.parse(path.read_text()), clean=False) or "").split("\n")[0].strip()


def test_module_sizes_follow_the_guide():
    modules = _modules()
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules.items()}
    assert {n: s for n, s in sizes.items() if s > SIZE_LIMIT_LINES} == {}
    over = {n for n, s in sizes.items() if s > SIZE_GUIDE_LINES}
    assert over <= LONGER_THAN_THE_GUIDE, (
        f"modules over {SIZE_GUIDE_LINES} lines: {sorted(over - LONGER_THAN_THE_GUIDE)}; split them, or open "
        "the module docstring with a one-line reason and add the name to LONGER_THAN_THE_GUIDE")
    unexplained = {n: _first_docstring_line(modules[n]) for n in over}
    unexplained = {n: line for n, line in unexplained.items() if not line.endswith(".")}
    assert unexplained == {}, "the first docstring line of a long module is its reason: one whole sentence"


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
