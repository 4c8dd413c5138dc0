"""What the user's optimizer keeps per parameter, and which kind steps it (docs/design.md, "Any optimizer").

The user's ``configure_optimizers`` returns any ``torch.optim.Optimizer``; it stays the holder of the
hyper-parameters and param groups (LR schedulers and ``LearningRateMonitor`` keep working). Its state is
moved onto the tiers as *slots*: one flat vector per unit per state key (``exp_avg``, ``momentum_buffer``,
``state1``, ``row_var`` ...), in that state's own dtype. ``step_kind`` picks how a unit is stepped
(optimizers/kind.py, the protocol; one module per kind): ``adam.FUSED_ADAM`` for Adam/AdamW without amsgrad
or maximize, ``elementwise.ELEMENTWISE`` for torch.optim's element-wise classes, ``per_tensor.PER_TENSOR``
for every other class. ``OptimizerSpec`` is the class, its kind, its slots and the state of every (group,
shape) of the model's trainable parameters.

Per-parameter scalars (``step``, NAdam's ``mu_product``, ASGD's ``eta``/``mu``) are kept on the host by the
stepping code (engine/optimizer/update.py), not in slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from snake_strategy.optimizers.adam import FUSED_ADAM, is_fused_adam
from snake_strategy.optimizers.elementwise import ELEMENTWISE, is_elementwise
from snake_strategy.optimizers.kind import StepKind
from snake_strategy.optimizers.per_tensor import PER_TENSOR
from snake_strategy.optimizers.probe import TensorState
from snake_strategy.optimizers.stepping import ShadowOptimizer
_REFUSED = {
    torch.optim.LBFGS: "it re-evaluates the loss through a closure several times per step, and the engine runs "
                       "one forward and backward per step",
    torch.optim.SparseAdam: "it needs sparse gradients, and the engine accumulates dense ones",
}


def step_kind(optimizer: torch.optim.Optimizer) -> StepKind:
    """The kind that steps this optimizer (FUSED_ADAM, ELEMENTWISE or PER_TENSOR); refuses what cannot be
    stepped exactly."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"configure_optimizers returned {name}, not a torch.optim.Optimizer; greedysnake steps "
                         "the offloaded parameters with the optimizer's own step, so return one")
    for cls, why in _REFUSED.items():
        if isinstance(optimizer, cls):
            raise ValueError(f"strategy='greedysnake' cannot step with {name}: {why}. Return another optimizer "
                             "from configure_optimizers (e.g. torch.optim.AdamW)")
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("capturable", "differentiable"):
            if group.get(flag):
                raise ValueError(f"optimizer param_groups[{i}] sets {flag}=True, which greedysnake does not support; "
                                 f"construct {name} with {flag}=False")
        for key in ("lr", "weight_decay", "eps"):
            if isinstance(group.get(key), torch.Tensor):
                raise ValueError(f"optimizer param_groups[{i}]['{key}'] is a Tensor; pass a float")
    if is_fused_adam(optimizer):
        return FUSED_ADAM
    if is_elementwise(optimizer):
        return ELEMENTWISE
    return PER_TENSOR


@dataclass(frozen=True)
class Slot:
    """One flat vector per unit: state ``key`` of every trainable parameter that has it, in ``dtype``."""

    name: str  # the file/tier name: the key, with the dtype added where parameters keep it in several dtypes
    key: str
    dtype: torch.dtype


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer class, its kind, its slots and the per-parameter state of every (group, shape)."""

    class_name: str  # module-qualified, what a checkpoint records
    kind: StepKind
    slots: tuple[Slot, ...]
    # The state of a parameter by ``kind.state_key(group, shape)``: per (group, shape) for kinds that keep
    # each tensor's own shape, per group (shape ()) for the flat kinds.
    states: tuple[tuple[tuple[int, tuple[int, ...]], TensorState], ...]

    def state_of(self, group: int, shape: Sequence[int]) -> TensorState:
        return dict(self.states)[self.kind.state_key(group, shape)]

    def slot_numel(self, slot: Slot, group: int, shape: Sequence[int]) -> int:
        """Elements of ``slot`` a parameter of this group and shape keeps (0: it has none)."""
        return self.kind.slot_numel(self.state_of(group, shape), slot.key, slot.dtype, shape)

    def bytes_per_elem(self, shapes: Sequence[tuple[int, Sequence[int]]]) -> float:
        """Bytes of optimizer state per trainable element over these (group, shape) parameters."""
        numel = sum(math.prod(s) for _, s in shapes)
        if not numel:
            return float(sum(slot.dtype.itemsize for slot in self.slots))
        total = sum(slot.dtype.itemsize * self.slot_numel(slot, g, s) for g, s in shapes for slot in self.slots)
        return total / numel

    def record(self) -> dict[str, Any]:
        """What a checkpoint records of the optimizer: its class, its kind and its slots with their dtypes."""
        return {"class": self.class_name, "kind": self.kind.name,
                "slots": {slot.name: str(slot.dtype).removeprefix("torch.") for slot in self.slots}}

    def accepts(self, saved: dict[str, Any]) -> bool:
        """Whether a checkpoint's optimizer record holds state this optimizer continues from: the same kind and
        slots, and the same class, unless the kind steps with a kernel of its own (Adam's and AdamW's moments
        are the same state)."""
        mine = self.record()
        return (saved["slots"] == mine["slots"] and saved["kind"] == mine["kind"]
                and (saved["class"] == mine["class"] or self.kind.own_kernel))

    def describe(self, bytes_per_elem: float, elems: int = 0, adam_bytes_per_elem: float = 0.0,
                 step_s: float | None = None) -> str:
        """e.g. 'optimizer state 2.03 B/param (FastAdamW8bit: exp_avg_codes int8, ...), 38.7 GB less than Adam's
        moments, its step 53.5 s per training step'. ``elems``: the elements with state;
        ``adam_bytes_per_elem``: two moments in the master dtype (what the saving is against); ``step_s``: the
        optimizer step's seconds per training step (the prediction's)."""
        parts = ", ".join(f"{slot.name} {str(slot.dtype).removeprefix('torch.')}" for slot in self.slots)
        text = f"optimizer state {bytes_per_elem:.3g} B/param ({self.class_name.rsplit('.', 1)[-1]}: {parts or 'none'})"
        if elems and adam_bytes_per_elem > bytes_per_elem:
            text += f", {elems * (adam_bytes_per_elem - bytes_per_elem) / 1e9:.3g} GB less than Adam's moments"
        if step_s is not None:
            text += f", its step {step_s:.3g} s per training step"
        return text


def legacy_record(master_dtype: str) -> dict[str, Any]:
    """The optimizer record of a checkpoint from before records: AdamW's two moments in its master dtype."""
    dtype = master_dtype.removeprefix("torch.")
    return {"class": "torch.optim.adamw.AdamW", "kind": FUSED_ADAM.name, "slots": {"exp_avg": dtype, "exp_avg_sq": dtype}}


def inspect_optimizer(optimizer: torch.optim.Optimizer, kind: StepKind, params: Sequence[tuple[int, Sequence[int]]],
                      dtype: torch.dtype) -> OptimizerSpec:
    """The spec of ``optimizer`` over these trainable (param group, shape) parameters, stepped in ``dtype``.

    The state's keys, shapes and dtypes come from the kind (one step of the user's class on a stand-in
    parameter, on the meta device where the class allows it: no memory, no compute). A class stepped with
    twins of itself is also checked for values it keeps on the object or changes in its groups
    (``ShadowOptimizer.check_nothing_lost``)."""
    cls = type(optimizer)
    class_name = f"{cls.__module__}.{cls.__qualname__}"
    states = kind.tensor_states(optimizer, [(g, tuple(s)) for g, s in params], dtype, class_name)
    if not kind.own_kernel:
        shadow = ShadowOptimizer(optimizer)
        for g in sorted({g for g, _ in params}):
            shadow.check_nothing_lost(optimizer, g, dtype, class_name)
    dtypes_of: dict[str, list[torch.dtype]] = {}
    for state in states.values():
        for key, _, d in state.tensors:
            if d not in dtypes_of.setdefault(key, []):
                dtypes_of[key].append(d)
    slots = tuple(Slot(key if len(ds) == 1 else f"{key}.{str(d).removeprefix('torch.')}", key, d)
                  for key, ds in dtypes_of.items() for d in ds)
    return OptimizerSpec(class_name, kind, slots, tuple(sorted(states.items())))

