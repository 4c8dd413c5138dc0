"""The fast path for Adam/AdamW: torch's fused kernel over flat ranges of a unit's master vector.

For Adam and AdamW (without amsgrad or maximize) the engine does not build the user's optimizer per chunk
(optimizers/stepping.py): it calls ``torch.optim.adam.adam(..., fused=True)`` on contiguous ranges of each
unit's flat master vector, one view per parameter with that parameter's own step count and its group's
hyper-parameters. It is the same arithmetic as torch's Adam, and the fastest kernel torch has for it on a
CPU (benchmarks/results/optimizer_kernels/).
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
