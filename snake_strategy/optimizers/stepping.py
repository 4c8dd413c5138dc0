"""Step tensors with the user's optimizer class: the state comes from the tiers, the math is the class's own.

``ShadowOptimizer`` is a shallow twin of the user's optimizer (same class, same attributes: a library's own
settings such as bitsandbytes' ``args`` come along) whose ``param_groups`` hold the views being stepped, with
the hyper-parameters snapshotted from the user's group, and whose ``state`` holds the values read from the
tiers. ``step`` calls the class's ``step``; the state it leaves is what goes back to the tiers. Nothing of
the user's optimizer object is changed, so ``optimizer.state_dict()`` stays what Lightning expects.

A parameter whose state is None has never been stepped: the class initialises it, lazily in ``step`` as
torch's optimizers do, or (Adagrad) in its constructor, which ``step`` then runs on the views.
"""
from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from typing import Any

import torch


class ShadowOptimizer:
    """Runs ``type(optimizer).step`` on given tensors, with given state, never touching ``optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._cls = type(optimizer)
        # The twins' own copy of the optimizer's attributes: a library may cache things in them as it steps
        # (bitsandbytes moves its quantization maps to the parameters' device), never in the user's object.
        # Instance attributes that shadow a method are patches bound to the user's object (an LR scheduler
        # wraps ``optimizer.step``): a twin runs its class's own method instead.
        self._attrs = {k: copy.deepcopy(v) for k, v in optimizer.__dict__.items()
                       if k not in ("state", "param_groups") and not callable(getattr(self._cls, k, None))}
        # torch.optim classes take every hyper-parameter in a param group dict: a fresh instance initialises
        # state the way the class's constructor does (Adagrad's ``sum``), which ``step`` alone would not.
        self._constructs = self._cls.__module__.startswith("torch.optim")

    def _twin(self, group: dict[str, Any], params: list[torch.Tensor], fresh: bool) -> torch.optim.Optimizer:
        if fresh and self._constructs:
            # The constructor's own arguments too: Adagrad reads initial_accumulator_value from them, not the group.
            accepted = inspect.signature(self._cls.__init__).parameters
            return self._cls([{**group, "params": params}], **{k: v for k, v in group.items() if k in accepted})
        twin = object.__new__(self._cls)
        twin.__dict__.update(self._attrs)
        twin.state = defaultdict(dict)
        twin.param_groups = [{**group, "params": params}]
        return twin

    @torch.no_grad()
    def step(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor | None],
             states: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
        """Step ``params`` in place with ``grads`` (None: not stepped, as torch skips a parameter without a
        gradient) under ``group``'s hyper-parameters; returns each parameter's state after the step."""
        twin = self._twin(group, params, fresh=any(s is None for s in states))
        for p, g, state in zip(params, grads, states):
            if state is not None:
                twin.state[p] = dict(state)
            p.grad = g
        try:
            twin.step()
        finally:
            for p in params:
                p.grad = None
        return [dict(twin.state[p]) for p in params]


def hyper_params(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A snapshot of every param group's hyper-parameters (everything but ``params``). torch 2.13's AdamW
    groups say ``decoupled_weight_decay=True``; in older releases (pyproject allows torch>=2.4) only the
    class said it, so it is added here, where the fused path (``AdamHyperParams.of``) reads it."""
    implied = {"decoupled_weight_decay": True} if isinstance(optimizer, torch.optim.AdamW) else {}
    return [{**implied, **{k: v for k, v in group.items() if k != "params"}} for group in optimizer.param_groups]
