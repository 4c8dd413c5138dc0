"""The arithmetic of one chunk of a unit's update: the user's optimizer on master weights and state read
from the tiers (optimizers/spec.py says how each kind is stepped).

``ChunkUpdate.apply`` receives a chunk [lo, hi) of a unit: its master values, the gradient, and each slot's
piece of the optimizer state (``UnitStore.slot_range``), all fetched into the worker's scratch; it steps them in
place, as the optimizer would have stepped the parameters of that chunk:

- FUSED_ADAM: torch's fused Adam kernel, one view per parameter with its own step count (optimizers/adam.py);
- ELEMENTWISE: the user's class on flat views (element i of the update depends on element i only, so any
  cut of the vector gives the same numbers): one view per run of adjacent parameters of one group whose
  scalars are equal (all of a group's, unless some sat a step out);
- PER_TENSOR: the user's class on each whole parameter, viewed in its real shape, its state pieces viewed in
  theirs.

In every kind a parameter without a gradient in the step is skipped, as torch skips it: no update, no
state change, no step count. Per-parameter scalars (``step``, ``mu_product`` ...) live in ``ScalarStates``,
versioned by the step they precede, so a redo of a step (a wrong speculation) starts from the same values as
the first try.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from snake_strategy.engine.state.stores import UnitStore
from snake_strategy.optimizers.adam import AdamHyperParams, adam_step
from snake_strategy.optimizers.spec import ELEMENTWISE, FUSED_ADAM, OptimizerSpec
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
    """Steps chunks of units with the user's optimizer (``optimizer``) as ``spec`` says."""

    def __init__(self, spec: OptimizerSpec, optimizer: torch.optim.Optimizer | None) -> None:
        self.spec = spec
        self.scalars = ScalarStates()
        self._shadow = ShadowOptimizer(optimizer) if spec.kind != FUSED_ADAM else None

    def scalars_state(self, step: int) -> dict[str, Any]:
        return self.scalars.state_dict(step)

    def load_scalars(self, state: dict[str, Any], step: int, layouts: list[UnitLayout]) -> None:
        """Restore the scalars a checkpoint at ``step`` holds; an older checkpoint's are converted (fused Adam:
        every parameter stepped at every step, the count the engine kept then; element-wise: a group's values
        for each of its parameters)."""
        if state.get(ITEMS_KEY) == ITEMS_PER_PARAMETER or self.spec.per_tensor:
            self.scalars.load_state_dict(state, step)
            return
        converted: dict[str, Any] = {}
        for layout in layouts:
            for i, s in enumerate(layout.trainable_slots):
                if self.spec.kind == FUSED_ADAM and step > 0:
                    converted[f"{layout.index},{i}"] = {"step": step}
                elif f"{layout.index},{layout.group_of(s)}" in state:
                    converted[f"{layout.index},{i}"] = state[f"{layout.index},{layout.group_of(s)}"]
        self.scalars.load_state_dict(converted, step)

    def chunks(self, unit: UnitStore, lo: int, hi: int, chunk_elems: int) -> list[tuple[int, int]]:
        """The chunks the worker steps [lo, hi) in: fixed-size pieces, or runs of whole parameters (per-tensor
        optimizers; one parameter larger than ``chunk_elems`` is a chunk of its own)."""
        if not self.spec.per_tensor:
            return [(a, min(hi, a + chunk_elems)) for a in range(lo, hi, chunk_elems)]
        starts = [s.offset for s in unit.layout.trainable_slots if lo <= s.offset < hi]
        out: list[tuple[int, int]] = []
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else hi
            if out and end - out[-1][0] <= chunk_elems:
                out[-1] = (out[-1][0], end)
            else:
                out.append((start, end))
        assert not starts or (starts[0] == lo and out[-1][1] == hi), "per-tensor ranges start on parameters"
        return out

    @torch.no_grad()
    def apply(self, unit: UnitStore, lo: int, hi: int, master: Tensor, state: dict[str, Tensor], grad: Tensor,
              hps: list[dict[str, Any]], step_before: int, keep: list[tuple[int, int]]) -> None:
        """One step of unit elements [lo, hi) in place; parameters inside ``keep`` (no gradient this step)
        are not stepped: their values, state and scalars stay as they were."""
        grad = grad.to(master.device, non_blocking=True)
        if self.spec.per_tensor:
            self._per_tensor(unit, lo, hi, master, state, grad, hps, step_before, keep)
            return
        u = unit.layout.index
        # Runs of adjacent parameter pieces of one group with the same scalars, stepped as one flat range.
        runs: list[tuple[int, list[int], int, int, dict[str, Any] | None]] = []
        for i, a, b, group in _pieces(unit, lo, hi):
            if any(x <= a and b <= y for x, y in keep):  # no gradient: not stepped, its count stays
                self.scalars.carry(u, i, step_before)
                continue
            scalars = self.scalars.get(u, i, step_before)
            if runs and runs[-1][0] == group and runs[-1][3] == a and _same(runs[-1][4], scalars):
                g, items, start, _, values = runs[-1]
                runs[-1] = (g, items + [i], start, b, values)
            else:
                runs.append((group, [i], a, b, scalars))
        if self.spec.kind == FUSED_ADAM:
            self._fused_adam(u, lo, runs, master, state, grad, hps, step_before)
            return
        assert self.spec.kind == ELEMENTWISE, self.spec.kind
        for group, items, a, b, scalars in runs:
            s, e = a - lo, b - lo
            views = {slot.key: state[slot.name][s:e] for slot in self.spec.slots
                     if self.spec.slot_numel(slot, group, ())}
            after = self._step_one(hps[group], master[s:e], grad[s:e], views, scalars)
            for i in items:
                self.scalars.put(u, i, step_before + 1, after)

    def sit_out(self, unit: UnitStore, lo: int, hi: int, step_before: int) -> None:
        """Unit elements [lo, hi) hold parameters without a gradient this step that the worker does not fetch:
        their scalars stay as they were, as if ``apply`` had kept them."""
        for i, *_ in _pieces(unit, lo, hi):
            self.scalars.carry(unit.layout.index, i, step_before)

    def _fused_adam(self, u: int, lo: int, runs: list, master: Tensor, state: dict[str, Tensor], grad: Tensor,
                    hps: list[dict[str, Any]], step_before: int) -> None:
        """torch's fused kernel, one call per group over every run's range, each with its own step count."""
        by_group: dict[int, list[tuple[list[int], int, int, int]]] = {}
        for group, items, a, b, scalars in runs:
            by_group.setdefault(group, []).append((items, a - lo, b - lo, 0 if scalars is None else scalars["step"]))
        for group, ranges in by_group.items():
            adam_step([master[s:e] for _, s, e, _ in ranges], [grad[s:e] for _, s, e, _ in ranges],
                      [state["exp_avg"][s:e] for _, s, e, _ in ranges],
                      [state["exp_avg_sq"][s:e] for _, s, e, _ in ranges],
                      [n for *_, n in ranges], AdamHyperParams.of(hps[group]))
            for items, _, _, n in ranges:
                for i in items:
                    self.scalars.put(u, i, step_before + 1, {"step": n + 1})

    def _per_tensor(self, unit: UnitStore, lo: int, hi: int, master: Tensor, state: dict[str, Tensor], grad: Tensor,
                    hps: list[dict[str, Any]], step_before: int, keep: list[tuple[int, int]]) -> None:
        u, layout = unit.layout.index, unit.layout
        bases = {slot.name: unit.slot_range(slot.name, lo, hi)[0] for slot in self.spec.slots}
        for i, s in enumerate(layout.trainable_slots):
            if not lo <= s.offset < hi:
                continue
            group = layout.group_of(s)
            if any(a <= s.offset and s.offset + s.numel <= b for a, b in keep):  # no gradient: not stepped
                self.scalars.carry(u, i, step_before)
                continue
            tensors = self.spec.state_of(group, s.shape).tensors
            views = {}
            for key, shape, dtype in tensors:
                slot = next(x for x in self.spec.slots if x.key == key and x.dtype == dtype)
                start = unit.slot_offsets[slot.name][i] - bases[slot.name]
                views[key] = state[slot.name][start:start + math.prod(shape)].view(shape)
            a = s.offset - lo
            after = self._step_one(hps[group], master[a:a + s.numel].view(s.shape), grad[a:a + s.numel].view(s.shape),
                                   views, self.scalars.get(u, i, step_before))
            self.scalars.put(u, i, step_before + 1, after)

    def _step_one(self, group: dict[str, Any], param: Tensor, grad: Tensor, views: dict[str, Tensor],
                  scalars: dict[str, Any] | None) -> dict[str, Any]:
        """The user's class steps ``param`` with the state ``views`` (+ ``scalars``, None: never stepped); what
        it leaves in its state is copied back into the views; returns the scalars after the step."""
        state = None if scalars is None else {**views, **scalars}
        after = self._shadow.step(group, [param], [grad], [state])[0]
        for key, view in views.items():
            value = after.get(key)
            if value is not None and value is not view:
                view.copy_(value.reshape(view.shape))
        return {k: v for k, v in after.items() if k not in views and v is not None}


def _pieces(unit: UnitStore, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """(parameter index, start, end, param group) of each trainable parameter's part inside [lo, hi)."""
    layout = unit.layout
    out = []
    for i, s in enumerate(layout.trainable_slots):
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a < b:
            out.append((i, a, b, layout.group_of(s)))
    return out


def _same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two parameters' scalars are equal (then stepping them as one flat range is exact)."""
    if a is None or b is None:
        return a is None and b is None
    return a.keys() == b.keys() and all(_scalar(a[k]) == _scalar(b[k]) for k in a)


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, Tensor) and value.numel() == 1 else value


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value
