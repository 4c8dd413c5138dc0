"""The protocol every optimizer kind implements: how its state is laid out, stepped, cut into chunks,
partitioned across ranks and read back from older checkpoints. The engine, the planner and the checkpoint
code ask the kind (``OptimizerSpec.kind``), never its name.

Three kinds, each in its own module: ``adam.FusedAdam`` (torch's fused kernel for Adam/AdamW),
``elementwise.Elementwise`` (the user's class on flat ranges: element i reads element i only) and
``per_tensor.PerTensor`` (the user's class on each whole parameter, in its real shape). ``spec.step_kind``
picks one for an optimizer.

A ``unit`` here is anything with the engine's ``UnitStore`` surface the stepping reads: ``layout`` (a
``units.UnitLayout``), ``slot_offsets`` and ``slot_range``. ``ctx`` is the engine's ``ChunkUpdate``: the
per-parameter scalars (``ctx.scalars``: get/put/carry, versioned by step) and the twins of the user's class
(``ctx.shadow``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from snake_strategy.optimizers.probe import TensorState


class StepKind:
    """One way of stepping an optimizer's offloaded state (see the module docstring)."""

    name: ClassVar[str]  # recorded in checkpoints and plans
    # Parameters start on pages and are never cut: chunks, the alpha split and skipped runs fall on parameter
    # starts, and each state tensor keeps its own shape (its slot is indexed by its own elements).
    whole_tensors: ClassVar[bool] = False
    # Steps with a kernel of its own rather than the user's class (its host speed is the machine probe's).
    own_kernel: ClassVar[bool] = False
    # The per-parameter state vectors a checkpoint of the non-layer state writes as raw files (else their
    # states are pickled whole).
    nonlayer_vectors: ClassVar[tuple[str, ...]] = ()

    # One instance per kind (the modules' constants): copies and unpickling give it back, equality is the kind's.
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __deepcopy__(self, memo: dict) -> StepKind:
        return self

    def __reduce__(self) -> tuple:
        return type(self), ()

    def __repr__(self) -> str:
        return self.name

    # ------------------------------------------------------------------ the state's layout
    def tensor_states(self, optimizer: torch.optim.Optimizer, params: Sequence[tuple[int, tuple[int, ...]]],
                      dtype: torch.dtype, class_name: str) -> dict[tuple[int, tuple[int, ...]], TensorState]:
        """The state of each (param group, shape) of ``params`` (keys as ``state_key`` gives them)."""
        raise NotImplementedError

    def state_key(self, group: int, shape: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        return group, ()

    def slot_numel(self, state: TensorState, key: str, dtype: torch.dtype, shape: Sequence[int]) -> int:
        """Elements of slot (``key``, ``dtype``) a parameter of ``shape`` with ``state`` keeps (0: none)."""
        return math.prod(shape) if any(k == key and d == dtype for k, _, d in state.tensors) else 0

    def slot_offsets(self, spec: Any, slot: Any, layout: Any) -> tuple[tuple[int, ...], int] | None:
        """(each trainable parameter's start in the slot, the slot's length) when the slot is indexed by its
        own elements; None when it is indexed by the unit's elements (its length: the unit's trainable part)."""
        return None

    def shard_refusal(self, class_name: str) -> str | None:
        """Why the state cannot be cut into element ranges across ranks, or None when it can."""
        return None

    # ------------------------------------------------------------------ cutting a unit
    def chunks(self, layout: Any, lo: int, hi: int, chunk_elems: int) -> list[tuple[int, int]]:
        """The chunks the worker steps [lo, hi) in: fixed-size pieces."""
        return [(a, min(hi, a + chunk_elems)) for a in range(lo, hi, chunk_elems)]

    def forward_cut(self, layout: Any, end: int) -> int:
        """The end of a unit's forward part, given the alpha split's ``end``."""
        return end

    def skippable(self, runs: list[tuple[int, int]], lo: int, hi: int, align: int) -> list[tuple[int, int]]:
        """Of ``runs`` (parameters without a gradient, in [lo, hi)), the ranges the worker may leave untouched
        when the state reaches the SSD, whose transfers start and end on ``align``-element boundaries: each
        run cut to them (the partial pages at its ends are stepped, keeping their parameters as they were)."""
        out = []
        for a, b in runs:
            a = a if a == lo else -(-a // align) * align
            b = b if b == hi else b // align * align
            if a < b:
                out.append((a, b))
        return out

    # ------------------------------------------------------------------ stepping
    def step(self, ctx: Any, unit: Any, lo: int, hi: int, master: Tensor, state: dict[str, Tensor], grad: Tensor,
             hps: list[dict[str, Any]], step_before: int, keep: list[tuple[int, int]]) -> None:
        """One step of unit elements [lo, hi) in place; parameters inside ``keep`` (no gradient) are not
        stepped and keep their scalars."""
        raise NotImplementedError

    def initial_state(self, master: Tensor) -> dict[str, Any] | None:
        """A non-layer parameter's state before its first step (None: created by the first step)."""
        return None

    def step_params(self, ctx: Any, hp: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                    states: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
        """One step of whole parameters (the non-layer ones) in place, each with its state; returns the
        states after it."""
        return ctx.shadow.step(hp, params, grads, states)

    # ------------------------------------------------------------------ older checkpoints
    def convert_scalars(self, state: dict[str, Any], step: int, layouts: Sequence[Any]) -> dict[str, Any]:
        """A checkpoint's scalars saved per param group ("u,group"), as per-parameter items ("u,item")."""
        converted: dict[str, Any] = {}
        for layout in layouts:
            for i, s in enumerate(layout.trainable_slots):
                saved = state.get(f"{layout.index},{layout.group_of(s)}")
                if saved is not None:
                    converted[f"{layout.index},{i}"] = saved
        return converted


# ---------------------------------------------------------------------- shared by the flat kinds
def pieces(layout: Any, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """(parameter index, start, end, param group) of each trainable parameter's part inside [lo, hi)."""
    out = []
    for i, s in enumerate(layout.trainable_slots):
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a < b:
            out.append((i, a, b, layout.group_of(s)))
    return out


def runs(ctx: Any, layout: Any, lo: int, hi: int, step_before: int, keep: list[tuple[int, int]]
         ) -> list[tuple[int, list[int], int, int, dict[str, Any] | None]]:
    """Runs of adjacent parameter pieces of one group with the same scalars: (group, parameter indices,
    start, end, scalars), each stepped as one flat range. A piece inside ``keep`` is left out, its scalars
    carried to the next step."""
    u = layout.index
    out: list[tuple[int, list[int], int, int, dict[str, Any] | None]] = []
    for i, a, b, group in pieces(layout, lo, hi):
        if any(x <= a and b <= y for x, y in keep):  # no gradient: not stepped, its count stays
            ctx.scalars.carry(u, i, step_before)
            continue
        scalars = ctx.scalars.get(u, i, step_before)
        if out and out[-1][0] == group and out[-1][3] == a and same_scalars(out[-1][4], scalars):
            g, items, start, _, values = out[-1]
            out[-1] = (g, items + [i], start, b, values)
        else:
            out.append((group, [i], a, b, scalars))
    return out


def same_scalars(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two parameters' scalars are equal (then stepping them as one flat range is exact)."""
    if a is None or b is None:
        return a is None and b is None
    return a.keys() == b.keys() and all(_scalar(a[k]) == _scalar(b[k]) for k in a)


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, Tensor) and value.numel() == 1 else value


def step_with_class(ctx: Any, group: dict[str, Any], param: Tensor, grad: Tensor, views: dict[str, Tensor],
                    scalars: dict[str, Any] | None) -> dict[str, Any]:
    """The user's class steps ``param`` with the state ``views`` (+ ``scalars``, None: never stepped); what
    it leaves in its state is copied back into the views; returns the scalars after the step."""
    state = None if scalars is None else {**views, **scalars}
    after = ctx.shadow.step(group, [param], [grad], [state])[0]
    for key, view in views.items():
        value = after.get(key)
        if value is not None and value is not view:
            view.copy_(value.reshape(view.shape))
    return {k: v for k, v in after.items() if k not in views and v is not None}


# ---------------------------------------------------------------------- slots indexed by their own elements
def slot_span(offsets: Sequence[int], numel: int, layout: Any, lo: int, hi: int) -> tuple[int, int]:
    """The elements of a slot indexed by its own elements (``offsets``: each trainable parameter's start,
    ``numel``: its length) that hold the state of unit elements [lo, hi), bounds on parameter starts."""
    starts = [s.offset for s in layout.trainable_slots]

    def at(x: int) -> int:
        i = next((i for i, start in enumerate(starts) if start >= x), len(starts))
        return offsets[i] if i < len(offsets) else numel

    return at(lo), at(hi)


def scratch_elems(spec: Any, layouts: Sequence[Any], ranges: Sequence[tuple[int, int]], chunk_elems: int
                  ) -> tuple[int, dict[str, int]]:
    """The optimizer worker's scratch: the elements of its largest chunk (master weights, gradient) and of
    each slot's largest piece of a chunk, over the kind's chunks of each unit's range [lo, hi)."""
    kind = spec.kind
    chunk, per_slot = 1, {slot.name: 1 for slot in spec.slots}
    for layout, (lo, hi) in zip(layouts, ranges):
        own = {slot.name: kind.slot_offsets(spec, slot, layout) for slot in spec.slots}
        for a, b in kind.chunks(layout, lo, hi, chunk_elems):
            chunk = max(chunk, b - a)
            for slot in spec.slots:
                where = own[slot.name]
                x, y = (a, b) if where is None else slot_span(where[0], where[1], layout, a, b)
                per_slot[slot.name] = max(per_slot[slot.name], y - x)
    return chunk, per_slot
