"""AdamW over flat buffers, driven by the hyper-parameters of the user's optimizer.

The user's ``configure_optimizers`` still returns an ordinary ``torch.optim.AdamW`` (or ``Adam``); the
strategy keeps it only as the holder of hyper-parameters (``param_groups``: lr, betas, eps,
weight_decay), so Lightning LR schedulers and ``LearningRateMonitor`` keep working. The arithmetic is
torch's own fused Adam kernel (``torch.optim.adam.adam(..., fused=True)``), applied to contiguous
ranges of each unit's flat master vector, one range per parameter group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adam import adam as functional_adam


@dataclass(frozen=True)
class AdamHyperParams:
    """A snapshot of one parameter group's hyper-parameters."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW (True) or Adam with L2 weight decay (False)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose math the flat engine does not reproduce, naming the fix."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(
            f"strategy='greedysnake' steps the offloaded parameters with Adam/AdamW; configure_optimizers "
            f"returned {type(optimizer).__name__}. Return torch.optim.AdamW (or Adam) instead"
        )
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag):
                raise ValueError(f"optimizer param_groups[{i}] sets {flag}=True, which greedysnake does not support")
        for key in ("lr", "weight_decay", "eps"):
            if isinstance(group.get(key), torch.Tensor):
                raise ValueError(f"optimizer param_groups[{i}]['{key}'] is a Tensor; pass a float")


def snapshot_hyper_params(optimizer: torch.optim.Optimizer) -> list[AdamHyperParams]:
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    return [
        AdamHyperParams(
            lr=float(g["lr"]), beta1=float(g["betas"][0]), beta2=float(g["betas"][1]),
            eps=float(g["eps"]), weight_decay=float(g["weight_decay"]), decoupled=decoupled,
        )
        for g in optimizer.param_groups
    ]


def adam_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step_before: int,
    hp: AdamHyperParams,
) -> None:
    """One in-place Adam(W) update of ``params`` (the ``step_before+1``-th step, for bias correction)."""
    if not params:
        return
    # The fused kernel increments the step tensors itself, one per parameter.
    steps = [torch.tensor(float(step_before), dtype=torch.float32, device=p.device) for p in params]
    functional_adam(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        fused=True, amsgrad=False, beta1=hp.beta1, beta2=hp.beta2, lr=hp.lr,
        weight_decay=hp.weight_decay, eps=hp.eps, maximize=False,
        decoupled_weight_decay=hp.decoupled,
    )
