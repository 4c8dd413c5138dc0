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
        # The optimizer's attributes at setup, for twins stepped without a snapshot of the step's own
        # (``hyper_params`` takes one per step; the planner's probes step without).
        self._attrs = attributes(optimizer)
        # torch.optim classes take every hyper-parameter in a param group dict: a fresh instance initialises
        # state the way the class's constructor does (Adagrad's ``sum``), which ``step`` alone would not.
        self._constructs = self._cls.__module__.startswith("torch.optim")

    def _twin(self, group: dict[str, Any], params: list[torch.Tensor], fresh: bool) -> torch.optim.Optimizer:
        attrs = group.get(ATTRS, self._attrs)
        group = {k: v for k, v in group.items() if k != ATTRS}
        if fresh and self._constructs:
            # The constructor's own arguments too: Adagrad reads initial_accumulator_value from them, not the group.
            accepted = inspect.signature(self._cls.__init__).parameters
            return self._cls([{**group, "params": params}], **{k: v for k, v in group.items() if k in accepted})
        twin = object.__new__(self._cls)
        # Its own copy: a library caches things in its attributes as it steps (bitsandbytes moves its
        # quantization maps to the parameters' device), and no twin may see another's changes.
        twin.__dict__.update(_snapshot(attrs))
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

    def check_nothing_lost(self, optimizer: torch.optim.Optimizer, group: int, dtype: torch.dtype,
                           class_name: str) -> None:
        """Refuse a class whose ``step`` changes its own attributes or its param group in a way the engine
        cannot carry.

        The user's optimizer object still takes every step (Lightning calls its ``step`` with the closure, in
        which the engine trains), over parameters that hold no gradient; each step's twins start from its
        attributes and groups as the closure found them (``hyper_params``). A counter ``self.t += 1`` or a decay
        kept in ``group`` is therefore carried as plain Lightning's object carries it, and a checkpoint restores
        what Lightning's restores (the param groups, not the attributes). What depends on the gradients (a
        running norm kept on ``self``), or changes before the closure runs, is not: so this emulates both on a
        stand-in parameter for three steps, plain Lightning's object and the engine's object plus twins, and
        refuses unless the parameters agree bitwise and the groups alike."""
        gen = torch.Generator().manual_seed(0)
        start = torch.randn(8, 8, generator=gen, dtype=dtype)
        grads = [torch.randn(8, 8, generator=gen, dtype=dtype) for _ in range(3)]
        hps = step_view(optimizer, group)
        plain_param, own_param, stepped = start.clone(), start.clone(), start.clone()
        plain = self._twin(hps, [plain_param], fresh=True)  # plain Lightning's optimizer object
        own = self._twin(hps, [own_param], fresh=True)  # the user's object under greedysnake: never a gradient
        state = None
        for step, grad in enumerate(grads, start=1):
            plain_before = step_view(plain)
            with torch.no_grad():
                plain_param.grad = grad.clone()
                plain.step()
                seen: list[dict[str, Any]] = []
                try:
                    own.step(lambda: seen.append(step_view(own)))  # the closure: where the engine takes its snapshot
                except Exception as error:  # noqa: BLE001 - Lightning would call it so at every step
                    raise ValueError(f"{class_name}.step(closure) fails on parameters without a gradient, as "
                                     f"Lightning calls it under greedysnake: {type(error).__name__}: {error}") from error
                snapshot = seen[0] if seen else hps
                state = self.step(snapshot, [stepped], [grad.clone()], [state])[0]
            differs = _differences(step_view(plain), step_view(own), group, "{} in plain Lightning, {} here")
            if not differs and not torch.equal(stepped, plain_param):
                # The copies started from other values than plain Lightning's object had before the step.
                differs = _differences(plain_before, snapshot, group, "changed before the closure runs")
            if differs or not torch.equal(stepped, plain_param):
                what = "; ".join(differs) or "what its step computes"
                raise ValueError(
                    f"{class_name}.step() keeps something besides self.state[p] that greedysnake cannot carry: "
                    f"after step {step} of a stand-in run, {what}. greedysnake steps the offloaded parameters on "
                    "copies of the optimizer, while the optimizer object itself steps parameters without a "
                    "gradient, so the run would silently differ from plain Lightning. Keep per-parameter values "
                    "in self.state[p] (carried exactly and checkpointed), or change attributes only from what "
                    "does not depend on the gradients, inside or after the closure")


def _differences(a: dict[str, Any], b: dict[str, Any], group: int, how: str) -> list[str]:
    """The entries in which two ``step_view``s differ, named as a user reads them; ``how`` is formatted with
    the two values."""
    out = []
    for where, x, y in (("attribute '{}'", a[ATTRS], b[ATTRS]),
                        (f"param_groups[{group}]['{{}}']", {k: v for k, v in a.items() if k != ATTRS},
                         {k: v for k, v in b.items() if k != ATTRS})):
        out += [f"{where.format(k)} ({how.format(_short(x.get(k)), _short(y.get(k)))})"
                for k in sorted(set(x) | set(y)) if not _equal(x.get(k), y.get(k))]
    return out


def _snapshot(values: dict[str, Any]) -> dict[str, Any]:
    """Copies of ``values`` that later in-place changes cannot reach (a value that cannot be copied is kept
    by identity: it is compared by identity then)."""
    out = {}
    for key, value in values.items():
        try:
            out[key] = copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - a handle (a lock, a CUDA stream): compared by identity
            out[key] = value
    return out


def _equal(a: Any, b: Any, depth: int = 0) -> bool:
    """Equal values: tensors element-wise, containers item by item, plain objects (no ``__eq__`` of their own,
    a library's settings namespace) attribute by attribute, a few levels deep."""
    if a is b:
        return True
    if depth > 4:
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], depth + 1) for k in a)
    if type(a) is type(b) and type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return _equal(vars(a), vars(b), depth + 1)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a type whose == is not a bool: unequal unless identical
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# The key under which a group snapshot carries the optimizer's attributes of that step (``hyper_params``).
ATTRS = "__optimizer_attributes__"


def attributes(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's own attributes, as a twin takes them: not ``state`` nor ``param_groups``, and not an
    instance attribute that shadows a method (a patch bound to the user's object: an LR scheduler wraps
    ``optimizer.step``; a twin runs its class's own method). Copies."""
    cls = type(optimizer)
    return _snapshot({k: v for k, v in optimizer.__dict__.items()
                      if k not in ("state", "param_groups") and not callable(getattr(cls, k, None))})


def step_view(optimizer: torch.optim.Optimizer, group: int = 0) -> dict[str, Any]:
    """What a twin starts from: param group ``group``'s entries (but ``params``) and, under ``ATTRS``, the
    optimizer's attributes (copies)."""
    return {**{k: v for k, v in optimizer.param_groups[group].items() if k != "params"}, ATTRS: attributes(optimizer)}


def hyper_params(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A snapshot of every param group's hyper-parameters (everything but ``params``), each carrying the
    optimizer's attributes of this step under ``ATTRS`` (one copy, shared). torch 2.13's AdamW groups say
    ``decoupled_weight_decay=True``; in older releases (pyproject allows torch>=2.4) only the class said it,
    so it is added here, where the fused path (``AdamHyperParams.of``) reads it."""
    implied = {"decoupled_weight_decay": True} if isinstance(optimizer, torch.optim.AdamW) else {}
    attrs = attributes(optimizer)
    return [{**implied, **{k: v for k, v in group.items() if k != "params"}, ATTRS: attrs}
            for group in optimizer.param_groups]
