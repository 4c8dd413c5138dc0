"""The per-tensor kind: every other optimizer (Muon, Adafactor, 8-bit optimizers, the user's own). The user's
class steps one whole parameter tensor at a time, in its real shape; each state tensor keeps its own shape and
dtype (found by stepping a stand-in of the parameter's shape once, ``probe.probe``), so a slot is indexed by
its own elements, each parameter's piece starting on a page. The unit layout starts every trainable parameter
on a page (``units.build_layouts(align_params=True)``): a matrix is never cut by a chunk, the alpha split, a
skipped run or an SSD transfer. A class outside torch.optim is checked for state that couples parameters.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from snake_strategy.optimizers.kind import StepKind, step_with_class
from snake_strategy.optimizers.probe import TensorState, check_uncoupled, probe
from snake_strategy.optimizers.stepping import ShadowOptimizer
from snake_strategy.storage.tiered import ALIGN_ELEMS

# Optimizers of torch.optim whose state is per parameter by construction (no coupling probe needed).
TORCH_CLASSES = tuple(c for c in (getattr(torch.optim, "Adafactor", None), getattr(torch.optim, "Muon", None)) if c)


class PerTensor(StepKind):
    name = "per_tensor"
    whole_tensors = True

    def tensor_states(self, optimizer: torch.optim.Optimizer, params: Sequence[tuple[int, tuple[int, ...]]],
                      dtype: torch.dtype, class_name: str) -> dict[tuple[int, tuple[int, ...]], TensorState]:
        shadow = ShadowOptimizer(optimizer)
        states = {(g, shape): probe(optimizer, shadow, optimizer.param_groups[g], shape if shape else (4,), dtype,
                                    class_name)
                  for g, shape in sorted({(g, tuple(s)) for g, s in params})}
        if not isinstance(optimizer, TORCH_CLASSES):
            check_uncoupled(shadow, optimizer, dtype, class_name)
        return states

    def state_key(self, group: int, shape: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        return group, tuple(shape)

    def slot_numel(self, state: TensorState, key: str, dtype: torch.dtype, shape: Sequence[int]) -> int:
        return next((math.prod(s) for k, s, d in state.tensors if k == key and d == dtype), 0)

    def slot_offsets(self, spec: Any, slot: Any, layout: Any) -> tuple[tuple[int, ...], int]:
        offsets, offset = [], 0
        for s in layout.trainable_slots:
            offset = -(-offset // ALIGN_ELEMS) * ALIGN_ELEMS
            offsets.append(offset)
            offset += spec.slot_numel(slot, layout.group_of(s), s.shape)
        return tuple(offsets), -(-offset // ALIGN_ELEMS) * ALIGN_ELEMS

    def shard_refusal(self, class_name: str) -> str | None:
        return (f"shard_optimizer_state=True cuts the optimizer state into element ranges, but "
                f"{class_name.rsplit('.', 1)[-1]} steps whole tensors; pass "
                "GreedySnakeStrategy(shard_optimizer_state=False) (each rank keeps the whole state)")

    def chunks(self, layout: Any, lo: int, hi: int, chunk_elems: int) -> list[tuple[int, int]]:
        """Runs of whole parameters; one parameter larger than ``chunk_elems`` is a chunk of its own."""
        starts = [s.offset for s in layout.trainable_slots if lo <= s.offset < hi]
        out: list[tuple[int, int]] = []
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else hi
            if out and end - out[-1][0] <= chunk_elems:
                out[-1] = (out[-1][0], end)
            else:
                out.append((start, end))
        assert not starts or (starts[0] == lo and out[-1][1] == hi), "per-tensor ranges start on parameters"
        return out

    def forward_cut(self, layout: Any, end: int) -> int:
        """The alpha split moved to the nearest parameter start: a matrix is stepped on one side of it."""
        if end in (0, layout.train_end):
            return end
        bounds = [s.offset for s in layout.trainable_slots] + [layout.train_end]
        return min(bounds, key=lambda b: abs(b - end))

    def skippable(self, runs: list[tuple[int, int]], lo: int, hi: int, align: int) -> list[tuple[int, int]]:
        """A run is skipped only when it ends on a page too (its start, a parameter's, is on one): the rest of
        the range must start on a parameter."""
        return [(a, b) for a, b in runs if all(x % align == 0 or x in (lo, hi) for x in (a, b))]

    def step(self, ctx: Any, unit: Any, lo: int, hi: int, master: Tensor, state: dict[str, Tensor], grad: Tensor,
             hps: list[dict[str, Any]], step_before: int, keep: list[tuple[int, int]]) -> None:
        u, layout, spec = unit.layout.index, unit.layout, ctx.spec
        bases = {slot.name: unit.slot_range(slot.name, lo, hi)[0] for slot in spec.slots}
        for i, s in enumerate(layout.trainable_slots):
            if not lo <= s.offset < hi:
                continue
            group = layout.group_of(s)
            if any(a <= s.offset and s.offset + s.numel <= b for a, b in keep):  # no gradient: not stepped
                ctx.scalars.carry(u, i, step_before)
                continue
            views = {}
            for key, shape, dtype in spec.state_of(group, s.shape).tensors:
                slot = next(x for x in spec.slots if x.key == key and x.dtype == dtype)
                start = unit.slot_offsets[slot.name][i] - bases[slot.name]
                views[key] = state[slot.name][start:start + math.prod(shape)].view(shape)
            a = s.offset - lo
            after = step_with_class(ctx, hps[group], master[a:a + s.numel].view(s.shape),
                                    grad[a:a + s.numel].view(s.shape), views, ctx.scalars.get(u, i, step_before))
            ctx.scalars.put(u, i, step_before + 1, after)

    def convert_scalars(self, state: dict[str, Any], step: int, layouts: Sequence[Any]) -> dict[str, Any]:
        """Per-tensor scalars were always kept per parameter."""
        return {k: v for k, v in state.items() if "," in k}


PER_TENSOR = PerTensor()
