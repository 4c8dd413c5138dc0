"""Import paths that moved when the package was split into layers (planning/, checkpoint/, hf/) and when
planning/ was given one role per module: each old module is a shim that still resolves its public names for
one release, warning with the new path.

A user's script written against an old path keeps running and is told where the name lives now; the
object returned is the new one itself (no wrapper), so ``is`` comparisons and isinstance checks hold.
docs/guide/api.md lists every public name at its one path and these old paths beside their new ones."""
from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

# The old planner module is the time model but for the placement search, the unit timing and the names it
# imported (which resolved through it too).
_PLANNER_ELSEWHERE = {**dict.fromkeys(("Placement", "choose_alpha", "memory_inputs", "PREFETCH_FROM_MEMORY",
                                       "PREFETCH_FROM_SSD", "prefetch_depth", "plan", "kept_activations"),
                                      "snake_strategy.planning.placement"),
                      "UnitTiming": "snake_strategy.planning.calibration",
                      "MemoryInputs": "snake_strategy.planning.memory_model",
                      "host_plan": "snake_strategy.planning.memory_model", "ScheduleConfig": "snake_strategy.config"}
# The old autoplan module is the run plan but for the batch the setup prediction is made from and the names it
# imported that the run plan no longer does.
_AUTOPLAN_ELSEWHERE = {"example_batch": "snake_strategy.planning.run_prediction",
                       "plan": "snake_strategy.planning.placement", "format_bytes": "snake_strategy.progress"}

# old module -> (the module most of its public names moved to, {name: module} for those that went elsewhere)
MOVED_MODULES: dict[str, tuple[str, dict[str, str]]] = {
    "snake_strategy.adapters": ("snake_strategy.hf", {}),
    "snake_strategy.autoplan": ("snake_strategy.planning.run_plan", _AUTOPLAN_ELSEWHERE),
    "snake_strategy.checkpoint_weights": ("snake_strategy.checkpoint", {"export_hf_checkpoint": "snake_strategy.hf"}),
    "snake_strategy.memory": ("snake_strategy.planning.memory_model", {}),
    "snake_strategy.planner": ("snake_strategy.planning.time_model", _PLANNER_ELSEWHERE),
    "snake_strategy.planning.autoplan": ("snake_strategy.planning.run_plan", _AUTOPLAN_ELSEWHERE),
    "snake_strategy.planning.hardware": ("snake_strategy.planning.machine", {}),
    "snake_strategy.planning.host_memory": ("snake_strategy.planning.machine", {}),
    "snake_strategy.planning.memory": ("snake_strategy.planning.memory_model", {}),
    "snake_strategy.planning.planner": ("snake_strategy.planning.time_model", _PLANNER_ELSEWHERE),
    "snake_strategy.planning.prediction": ("snake_strategy.planning.run_prediction", {}),
}


# public names renamed, or moved out of a module that stays: old dotted path -> new dotted path (the old name
# resolves in its module, warning)
RENAMED: dict[str, str] = {
    "snake_strategy.TierSplit": "snake_strategy.TierShares",
    "snake_strategy.config.TierSplit": "snake_strategy.config.TierShares",
    "snake_strategy.planning.calibration.Knee": "snake_strategy.planning.time_model.Knee",
    "snake_strategy.planning.calibration.knee": "snake_strategy.planning.time_model.knee",
}


def renamed(module_name: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of a module that keeps an old name of one of its public names for one
    release: the object under its new name, with a DeprecationWarning naming it."""

    def __getattr__(name: str) -> Any:
        target = RENAMED.get(f"{module_name}.{name}")
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        new_module, new_name = target.rsplit(".", 1)
        warnings.warn(f"{module_name}.{name} is now {target}: the old name works for this release only",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__


def new_path(old_module: str, name: str) -> str:
    """Where ``old_module.name`` lives now (the module, dotted, with the name)."""
    default, elsewhere = MOVED_MODULES[old_module]
    return f"{elsewhere.get(name, default)}.{name}"


def forwarding(old_module: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of the shim at ``old_module``. The new module is imported at
    the first attribute access, not when the shim is, so an old path to an optional extra (``adapters`` ->
    ``hf`` needs transformers) costs nothing until used."""
    default, elsewhere = MOVED_MODULES[old_module]

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # the import system probes dunders (__path__, __spec__ ...): not moved names
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        target = new_path(old_module, name)
        module_name = target.rsplit(".", 1)[0]
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}: the module moved to "
                                 f"{default!r}, which has no {name!r} either (docs/guide/api.md lists the "
                                 "public names)")
        warnings.warn(f"{old_module}.{name} moved to {target}; import it from {module_name}: the old path "
                      "works for this release only", DeprecationWarning, stacklevel=2)
        return getattr(module, name)

    def __dir__() -> list[str]:
        return sorted(set(dir(importlib.import_module(default))) | set(elsewhere))

    return __getattr__, __dir__
