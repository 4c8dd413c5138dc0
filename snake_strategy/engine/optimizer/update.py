"""The arithmetic of one chunk of a unit's update: the user's optimizer on master weights and state read
from the tiers (optimizers/spec.py says how each kind is stepped).

``ChunkUpdate.apply`` receives a chunk [lo, hi) of a unit: its master values, the gradient, and each slot's
piece of the optimizer state (``UnitStore.slot_range``), all fetched into the worker's scratch; it steps them in
place, as the optimizer would have stepped the parameters of that chunk:

- FUSED_ADAM: torch's fused Adam kernel, one flat range per parameter group (optimizers/adam.py);
- ELEMENTWISE: the user's class on one flat view per parameter group (element i of the update depends on
  element i only, so any cut of the vector gives the same numbers);
- PER_TENSOR: the user's class on each whole parameter, viewed in its real shape, its state pieces viewed in
  theirs; a parameter without a gradient is skipped, as torch skips it.

Per-parameter scalars (``step``, ``mu_product`` ...) live in ``ScalarStates``, versioned by the step they
precede, so a redo of a step (a wrong speculation) starts from the same values as the first try.
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


class ScalarStates:
    """Per (unit, item) the optimizer's scalar state before step s, for the last two steps: items are param
    groups (element-wise optimizers) or trainable parameters (per-tensor ones). Missing: never stepped."""

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

    def state_dict(self, step: int) -> dict[str, dict[str, Any]]:
        """The values before ``step`` (what a checkpoint at that step holds), by "u,item"."""
        return {f"{u},{item}": {k: _copy(v) for k, v in versions[step].items()}
                for (u, item), versions in self._values.items() if step in versions}

    def load_state_dict(self, state: dict[str, dict[str, Any]], step: int) -> None:
        self._values = {}
        for key, values in state.items():
            u, item = (int(x) for x in key.split(","))
            self.put(u, item, step, values)


class ChunkUpdate:
    """Steps chunks of units with the user's optimizer (``optimizer``) as ``spec`` says."""

    def __init__(self, spec: OptimizerSpec, optimizer: torch.optim.Optimizer | None) -> None:
        self.spec = spec
        self.scalars = ScalarStates()
        self._shadow = ShadowOptimizer(optimizer) if spec.kind != FUSED_ADAM else None

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
        are left as they were."""
        grad = grad.to(master.device, non_blocking=True)
        if self.spec.per_tensor:
            self._per_tensor(unit, lo, hi, master, state, grad, hps, step_before, keep)
            return
        kept = [(a, b, [t[a - lo:b - lo].clone() for t in (master, *state.values())]) for a, b in keep]
        u = unit.layout.index
        for group, start, end in unit.layout.group_ranges:
            s, e = max(start, lo) - lo, min(end, hi) - lo
            if s >= e:
                continue
            if self.spec.kind == FUSED_ADAM:
                adam_step([master[s:e]], [grad[s:e]], [state["exp_avg"][s:e]], [state["exp_avg_sq"][s:e]],
                          step_before, AdamHyperParams.of(hps[group]))
                continue
            assert self.spec.kind == ELEMENTWISE, self.spec.kind
            views = {slot.key: state[slot.name][s:e] for slot in self.spec.slots
                     if self.spec.slot_numel(slot, group, ())}
            self._step_one(u, group, hps[group], master[s:e], grad[s:e], views, step_before)
        for a, b, values in kept:
            for t, v in zip((master, *state.values()), values):
                t[a - lo:b - lo].copy_(v)

    def _per_tensor(self, unit: UnitStore, lo: int, hi: int, master: Tensor, state: dict[str, Tensor], grad: Tensor,
                    hps: list[dict[str, Any]], step_before: int, keep: list[tuple[int, int]]) -> None:
        u, layout = unit.layout.index, unit.layout
        bases = {slot.name: unit.slot_range(slot.name, lo, hi)[0] for slot in self.spec.slots}
        for i, s in enumerate(layout.trainable_slots):
            if not lo <= s.offset < hi:
                continue
            group = layout.group_of(s)
            if any(a <= s.offset and s.offset + s.numel <= b for a, b in keep):  # no gradient: not stepped
                values = self.scalars.get(u, i, step_before)
                if values is not None:
                    self.scalars.put(u, i, step_before + 1, values)
                continue
            tensors = self.spec.state_of(group, s.shape).tensors
            views = {}
            for key, shape, dtype in tensors:
                slot = next(x for x in self.spec.slots if x.key == key and x.dtype == dtype)
                start = unit.slot_offsets[slot.name][i] - bases[slot.name]
                views[key] = state[slot.name][start:start + math.prod(shape)].view(shape)
            a = s.offset - lo
            self._step_one(u, i, hps[group], master[a:a + s.numel].view(s.shape),
                           grad[a:a + s.numel].view(s.shape), views, step_before)

    def _step_one(self, u: int, item: int, group: dict[str, Any], param: Tensor, grad: Tensor,
                  views: dict[str, Tensor], step_before: int) -> None:
        """The user's class steps ``param`` with the state ``views`` (+ the item's scalars); what it leaves
        in its state is copied back into the views."""
        scalars = self.scalars.get(u, item, step_before)
        state = None if scalars is None else {**views, **scalars}
        after = self._shadow.step(group, [param], [grad], [state])[0]
        for key, view in views.items():
            value = after.get(key)
            if value is not None and value is not view:
                view.copy_(value.reshape(view.shape))
        self.scalars.put(u, item, step_before + 1, {k: v for k, v in after.items() if k not in views and v is not None})


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value
