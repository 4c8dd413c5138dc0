"""Every ``snake_strategy...`` name the README and the guide mention resolves, as a user would import it; the
old paths docs/guide/api.md lists as moved still resolve, to the same object, with a DeprecationWarning that
names the new path; and no current name goes through an old path."""
from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide"
API_PAGE = GUIDE / "api.md"
OLD_PATHS_HEADING = "## Old paths (deprecated)"

# A dotted name starting at the package (not inside a longer word or a file path such as snake_strategy/x.py).
DOTTED = re.compile(r"(?<![\w/.])snake_strategy(?:\.[A-Za-z_]\w*)+")
# ``from snake_strategy.x import a, b`` and the parenthesised multi-line form.
FROM_IMPORT = re.compile(r"from\s+(snake_strategy(?:\.\w+)*)\s+import\s+(\([^)]*\)|[\w ,]+)")
OLD_ROW = re.compile(r"^\|\s*`(snake_strategy[\w.]+)`\s*\|\s*`(snake_strategy[\w.]+)`\s*\|\s*$", re.M)


def documented_names(text: str) -> set[str]:
    names = set(DOTTED.findall(text))
    for module, imported in FROM_IMPORT.findall(text):
        names |= {f"{module}.{name.strip()}" for name in imported.strip("()").split(",") if name.strip()}
    return names


def _split_api_page() -> tuple[str, str]:
    text = API_PAGE.read_text()
    assert OLD_PATHS_HEADING in text, f"{API_PAGE} has no '{OLD_PATHS_HEADING}' section"
    current, old = text.split(OLD_PATHS_HEADING, 1)
    return current, old


def current_names() -> list[tuple[str, str]]:
    """(file, name) for every name outside the api page's old-paths section."""
    found = set()
    for path in [ROOT / "README.md", *sorted(GUIDE.glob("*.md"))]:
        text = _split_api_page()[0] if path == API_PAGE else path.read_text()
        found |= {(path.relative_to(ROOT).as_posix(), name) for name in documented_names(text)}
    return sorted(found)


def old_paths() -> list[tuple[str, str]]:
    return OLD_ROW.findall(_split_api_page()[1])


def resolve(dotted: str) -> Any:
    """What ``from a.b import c`` / ``import a.b`` give for ``dotted``: the longest importable module
    prefix, then attributes. A missing optional dependency (transformers, peft) skips, as the extras'
    own tests do; anything else missing fails."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            missing = error.name or ""
            if missing == module_name or module_name.startswith(missing + "."):
                if missing.startswith("snake_strategy"):
                    continue
            if not missing.startswith("snake_strategy"):
                pytest.skip(f"optional dependency {missing} is not installed")
            raise
        for attr in parts[end:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{dotted}: no importable prefix")


def _moved_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, DeprecationWarning) and str(w.message).startswith("snake_strategy.")]


@pytest.mark.parametrize("where,name", current_names())
def test_documented_name_resolves_without_an_old_path(where, name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            raise AssertionError(f"{where} names {name}, which does not import: {error}") from error
    assert _moved_warnings(caught) == [], f"{where} names {name} through an old path"


def test_the_docs_mention_names_and_the_scan_sees_import_forms():
    names = {name for _, name in current_names()}
    assert len(names) > 40, sorted(names)
    assert documented_names("from snake_strategy.hf import (HFCausalLM,\n    save_adapter)\nx") == {
        "snake_strategy.hf", "snake_strategy.hf.HFCausalLM", "snake_strategy.hf.save_adapter"}
    assert documented_names("`snake_strategy.sources.lora_init.save_adapter(peft_model, dir)`.") == {
        "snake_strategy.sources.lora_init.save_adapter"}
    assert documented_names("see snake_strategy/train.py and greedysnake_strategy.x") == set()


def test_a_wrong_path_fails_to_resolve():
    with pytest.raises(AttributeError):
        resolve("snake_strategy.sources.lora_init.save_adapter")
    with pytest.raises(AttributeError):
        resolve("snake_strategy.gpt.NoSuchModel")


@pytest.mark.parametrize("old,new", old_paths())
def test_old_path_warns_and_gives_the_new_object(old, new):
    new_object = resolve(new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old_object = resolve(old)
    assert old_object is new_object, f"{old} and {new} are different objects"
    messages = _moved_warnings(caught)
    assert len(messages) == 1 and new in messages[0], messages
    # The user's own `from ... import` form, warned at the user's line.
    module, name = old.rsplit(".", 1)
    with pytest.warns(DeprecationWarning, match=re.escape(new)) as record:
        exec(f"from {module} import {name}", {})
    assert record[0].filename == "<string>", "the warning should point at the importing line, not the shim"


def test_old_paths_cover_every_removed_module():
    from snake_strategy.moved import MOVED_MODULES, RENAMED
    listed = {old.rsplit(".", 1)[0] for old, _ in old_paths() if old not in RENAMED}
    assert listed == set(MOVED_MODULES)
    assert set(RENAMED) <= {old for old, _ in old_paths()}, "every renamed name has its row"
    for module in MOVED_MODULES:
        with pytest.raises(AttributeError, match="docs/guide/api.md"):
            getattr(importlib.import_module(module), "no_such_name")
