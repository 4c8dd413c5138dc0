"""The fused Adam kind: torch's fused kernel over flat ranges of a unit's master vector.

For Adam and AdamW (without amsgrad or maximize) the engine does not build the user's optimizer per chunk
(optimizers/stepping.py): it calls ``torch.optim.adam.adam(..., fused=True)`` on contiguous ranges of each
unit's flat master vector, one view per parameter with that parameter's own step count and its group's
hyper-parameters. It is the same arithmetic as torch's Adam, and the fastest kernel torch has for it on a
CPU (benchmarks/results/optimizer_kernels/). Its state: the slots ``exp_avg`` and ``exp_avg_sq`` in the
master dtype, and a step count per parameter.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam as functional_adam

from snake_strategy.optimizers.kind import StepKind, runs
from snake_strategy.optimizers.probe import TensorState


@dataclass(frozen=True)
class AdamHyperParams:
    """A snapshot of one parameter group's hyper-parameters."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW (True) or Adam with L2 weight decay (False)

    @classmethod
    def of(cls, group: dict) -> AdamHyperParams:
        """From a param group of torch.optim.Adam or AdamW (AdamW's groups say decoupled_weight_decay=True)."""
        return cls(lr=float(group["lr"]), beta1=float(group["betas"][0]), beta2=float(group["betas"][1]),
                   eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                   decoupled=bool(group.get("decoupled_weight_decay", False)))


def adam_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps_before: list[int],
    hp: AdamHyperParams,
) -> None:
    """One in-place Adam(W) update of ``params``, parameter k taking its ``steps_before[k]+1``-th step (bias
    correction counts each parameter's own steps, as torch does: a parameter that sat a step out without a
    gradient was not stepped, so its count is behind the others')."""
    assert len(steps_before) == len(params), (len(steps_before), len(params))
    if not params:
        return
    # The fused kernel increments the step tensors itself, one per parameter.
    steps = [torch.tensor(float(n), dtype=torch.float32, device=p.device) for p, n in zip(params, steps_before)]
    functional_adam(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        fused=True, amsgrad=False, beta1=hp.beta1, beta2=hp.beta2, lr=hp.lr,
        weight_decay=hp.weight_decay, eps=hp.eps, maximize=False,
        decoupled_weight_decay=hp.decoupled,
    )


def is_fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Adam or AdamW themselves (not a subclass) without amsgrad or maximize: the kernel is their step."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and not any(
        g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups)


class FusedAdam(StepKind):
    name = "fused_adam"
    own_kernel = True
    nonlayer_vectors = ("exp_avg", "exp_avg_sq")

    def tensor_states(self, optimizer: torch.optim.Optimizer, params: Sequence[tuple[int, tuple[int, ...]]],
                      dtype: torch.dtype, class_name: str) -> dict[tuple[int, tuple[int, ...]], TensorState]:
        adam = TensorState((("exp_avg", (), dtype), ("exp_avg_sq", (), dtype)), ("step",))
        return {(g, ()): adam for g in {g for g, _ in params}}

    def step(self, ctx: Any, unit: Any, lo: int, hi: int, master: Tensor, state: dict[str, Tensor], grad: Tensor,
             hps: list[dict[str, Any]], step_before: int, keep: list[tuple[int, int]]) -> None:
        """One kernel call per group over every run's range, each with its own step count."""
        u = unit.layout.index
        by_group: dict[int, list[tuple[list[int], int, int, int]]] = {}
        for group, items, a, b, scalars in runs(ctx, unit.layout, lo, hi, step_before, keep):
            by_group.setdefault(group, []).append((items, a - lo, b - lo, 0 if scalars is None else scalars["step"]))
        for group, ranges in by_group.items():
            adam_step([master[s:e] for _, s, e, _ in ranges], [grad[s:e] for _, s, e, _ in ranges],
                      [state["exp_avg"][s:e] for _, s, e, _ in ranges],
                      [state["exp_avg_sq"][s:e] for _, s, e, _ in ranges],
                      [n for *_, n in ranges], AdamHyperParams.of(hps[group]))
            for items, _, _, n in ranges:
                for i in items:
                    ctx.scalars.put(u, i, step_before + 1, {"step": n + 1})

    def initial_state(self, master: Tensor) -> dict[str, Any]:
        return {"step": 0, "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}

    def step_params(self, ctx: Any, hp: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                    states: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
        states = [s if s is not None else self.initial_state(p) for p, s in zip(params, states)]
        adam_step(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                  [int(s["step"]) for s in states], AdamHyperParams.of(hp))
        return [{**s, "step": int(s["step"]) + 1} for s in states]

    def convert_scalars(self, state: dict[str, Any], step: int, layouts: Sequence[Any]) -> dict[str, Any]:
        """An older checkpoint kept no counts: every parameter was stepped at every step, the global one."""
        if step == 0:
            return {}
        return {f"{layout.index},{i}": {"step": step} for layout in layouts for i, _ in enumerate(layout.trainable_slots)}


FUSED_ADAM = FusedAdam()
