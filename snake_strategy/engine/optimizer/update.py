"""One chunk of a unit's update: the user's optimizer on master weights and state read from the tiers.

``ChunkUpdate.apply`` receives a chunk [lo, hi) of a unit: its master values, the gradient, and each slot's
piece of the optimizer state (``UnitStore.slot_range``), all fetched into the worker's scratch; the
optimizer's kind (optimizers/kind.py: fused Adam, element-wise, per tensor) steps them in place, as the
optimizer would have stepped the parameters of that chunk. ``ChunkUpdate`` is the context the kinds step in:
the per-parameter scalars and the twins of the user's class.

In every kind a parameter without a gradient in the step is skipped, as torch skips it: no update, no
state change, no step count. Per-parameter scalars (``step``, ``mu_product`` ...) live in ``ScalarStates``,
versioned by the step they precede, so a redo of a step (a wrong speculation) starts from the same values as
the first try.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from snake_strategy.engine.state.stores import UnitStore
from snake_strategy.optimizers.kind import pieces
from snake_strategy.optimizers.spec import OptimizerSpec
from snake_strategy.optimizers.stepping import ShadowOptimizer
from snake_strategy.units import UnitLayout


class ScalarStates:
    """Per (unit, trainable parameter) the optimizer's scalar state before step s, for the last two steps.
    Missing: never stepped. Every kind counts per parameter, as torch does: a parameter that sat a step
    out (no gradient) keeps its values, so its ``step`` falls behind the others'."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}

    def get(self, u: int, item: int, step: int) -> dict[str, Any] | None:
        values = self._values.get((u, item), {}).get(step)
        return None if values is None else {k: _copy(v) for k, v in values.items()}

    def put(self, u: int, item: int, step: int, values: dict[str, Any]) -> None:
        versions = self._values.setdefault((u, item), {})
        versions[step] = {k: _copy(v) for k, v in values.items()}
        for old in [s for s in versions if s < step - 1]:
            del versions[old]

    def carry(self, u: int, item: int, step_before: int) -> None:
        """Item ``(u, item)`` sat step ``step_before`` out: its values before the next step are these."""
        values = self._values.get((u, item), {}).get(step_before)
        if values is not None:
            self.put(u, item, step_before + 1, values)

    def state_dict(self, step: int) -> dict[str, Any]:
        """The values before ``step`` (what a checkpoint at that step holds), by "u,item"."""
        return {ITEMS_KEY: ITEMS_PER_PARAMETER,
                **{f"{u},{item}": {k: _copy(v) for k, v in versions[step].items()}
                   for (u, item), versions in self._values.items() if step in versions}}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        self._values = {}
        self.merge(state, step)

    def merge(self, state: dict[str, Any], step: int) -> None:
        """Add the values of ``state`` (a ``state_dict``; another rank's of partitioned state)."""
        for key, values in state.items():
            if key != ITEMS_KEY:
                u, item = (int(x) for x in key.split(","))
                self.put(u, item, step, values)


# A checkpoint's scalars name their items: per trainable parameter (older checkpoints: per param group for
# element-wise optimizers, none for fused Adam, whose count was the global step).
ITEMS_KEY, ITEMS_PER_PARAMETER = "__items__", "parameter"


class ChunkUpdate:
    """Steps chunks of units with the user's optimizer (``optimizer``) as ``spec``'s kind says."""

    def __init__(self, spec: OptimizerSpec, optimizer: torch.optim.Optimizer | None) -> None:
        self.spec = spec
        self.scalars = ScalarStates()
        self.shadow = ShadowOptimizer(optimizer) if not spec.kind.own_kernel else None

    def scalars_state(self, step: int) -> dict[str, Any]:
        return self.scalars.state_dict(step)

    def load_scalars(self, state: dict[str, Any], step: int, layouts: list[UnitLayout]) -> None:
        """Restore the scalars a checkpoint at ``step`` holds; an older checkpoint's, kept per param group or
        not at all, are converted by the kind."""
        if state.get(ITEMS_KEY) != ITEMS_PER_PARAMETER:
            state = self.spec.kind.convert_scalars(state, step, layouts)
        self.scalars.load_state_dict(state, step)

    def chunks(self, unit: UnitStore, lo: int, hi: int, chunk_elems: int) -> list[tuple[int, int]]:
        """The chunks the worker steps [lo, hi) in (the kind's cut)."""
        return self.spec.kind.chunks(unit.layout, lo, hi, chunk_elems)

    @torch.no_grad()
    def apply(self, unit: UnitStore, lo: int, hi: int, master: Tensor, state: dict[str, Tensor], grad: Tensor,
              hps: list[dict[str, Any]], step_before: int, keep: list[tuple[int, int]]) -> None:
        """One step of unit elements [lo, hi) in place; parameters inside ``keep`` (no gradient this step)
        are not stepped: their values, state and scalars stay as they were."""
        grad = grad.to(master.device, non_blocking=True)
        self.spec.kind.step(self, unit, lo, hi, master, state, grad, hps, step_before, keep)

    def sit_out(self, unit: UnitStore, lo: int, hi: int, step_before: int) -> None:
        """Unit elements [lo, hi) hold parameters without a gradient this step that the worker does not fetch:
        their scalars stay as they were, as if ``apply`` had kept them."""
        for i, *_ in pieces(unit.layout, lo, hi):
            self.scalars.carry(unit.layout.index, i, step_before)


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value
