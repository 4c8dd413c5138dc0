"""The element-wise kind: torch.optim's optimizers whose update of element i reads only element i of the
parameter, the gradient and the state (SGD, Adam with amsgrad or maximize, Adamax, NAdam, RAdam, RMSprop,
Adagrad, Adadelta, ASGD). The user's class steps flat ranges of the unit vector, so any cut of it (chunks,
the alpha split, ranks' shards, pages) gives the same numbers: one view per run of adjacent parameters of
one group whose scalars are equal (all of a group's, unless some sat a step out). Every state tensor has the
parameter's shape; its slot is indexed by the unit's elements.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from snake_strategy.optimizers.kind import StepKind, runs, step_with_class
from snake_strategy.optimizers.probe import TensorState, probe
from snake_strategy.optimizers.stepping import ShadowOptimizer

CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
           torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD)


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer) in CLASSES


class Elementwise(StepKind):
    name = "elementwise"

    def tensor_states(self, optimizer: torch.optim.Optimizer, params: Sequence[tuple[int, tuple[int, ...]]],
                      dtype: torch.dtype, class_name: str) -> dict[tuple[int, tuple[int, ...]], TensorState]:
        shadow = ShadowOptimizer(optimizer)
        states = {}
        for g in sorted({g for g, _ in params}):
            found = probe(optimizer, shadow, optimizer.param_groups[g], (4,), dtype, class_name)
            # Every state tensor is shaped like its parameter: recorded without a shape.
            states[(g, ())] = TensorState(tuple((k, (), d) for k, _, d in found.tensors), found.scalars)
        return states

    def step(self, ctx: Any, unit: Any, lo: int, hi: int, master: Tensor, state: dict[str, Tensor], grad: Tensor,
             hps: list[dict[str, Any]], step_before: int, keep: list[tuple[int, int]]) -> None:
        u, spec = unit.layout.index, ctx.spec
        for group, items, a, b, scalars in runs(ctx, unit.layout, lo, hi, step_before, keep):
            s, e = a - lo, b - lo
            views = {slot.key: state[slot.name][s:e] for slot in spec.slots if spec.slot_numel(slot, group, ())}
            after = step_with_class(ctx, hps[group], master[s:e], grad[s:e], views, scalars)
            for i in items:
                ctx.scalars.put(u, i, step_before + 1, after)


ELEMENTWISE = Elementwise()
