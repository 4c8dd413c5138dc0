"""What the user's optimizer keeps per parameter, and how the engine steps it (docs/design.md, "Any
optimizer").

The user's ``configure_optimizers`` returns any ``torch.optim.Optimizer``; it stays the holder of the
hyper-parameters and param groups (LR schedulers and ``LearningRateMonitor`` keep working). Its state is
moved onto the tiers as *slots*: one flat vector per unit per state key (``exp_avg``, ``momentum_buffer``,
``state1``, ``row_var`` ...), in that state's own dtype. How a unit is stepped depends on the class:

- ``FUSED_ADAM``: Adam/AdamW without amsgrad or maximize; torch's fused kernel on flat ranges
  (optimizers/adam.py), slots ``exp_avg`` and ``exp_avg_sq``.
- ``ELEMENTWISE``: torch.optim's element-wise optimizers (``ELEMENTWISE_CLASSES``): element i of the update
  reads only element i of the parameter, gradient and state, so the user's class steps flat chunks of the
  unit vector, one view per parameter group; every state tensor has the parameter's shape.
- ``PER_TENSOR``: every other optimizer (Muon, Adafactor, 8-bit optimizers, the user's own): the user's class
  steps one whole parameter tensor at a time, with its real shape; each state tensor keeps its own shape and
  dtype (found by stepping a stand-in of the parameter's shape once, ``probe``), and the unit layout starts
  every trainable parameter on a page (units.build_layouts) so a matrix is never cut by a chunk, the alpha
  split or an SSD transfer.

Per-parameter scalars (``step``, NAdam's ``mu_product``, ASGD's ``eta``/``mu``) are kept on the host by the
stepping code (optimizers/stepping.py), not in slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from snake_strategy.optimizers.stepping import ShadowOptimizer

FUSED_ADAM, ELEMENTWISE, PER_TENSOR = "fused_adam", "elementwise", "per_tensor"
ELEMENTWISE_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                       torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
                       torch.optim.ASGD)
# Optimizers of torch.optim whose state is per parameter by construction (no coupling probe needed).
TORCH_PER_TENSOR = tuple(c for c in (getattr(torch.optim, "Adafactor", None), getattr(torch.optim, "Muon", None)) if c)
_REFUSED = {
    torch.optim.LBFGS: "it re-evaluates the loss through a closure several times per step, and the engine runs "
                       "one forward and backward per step",
    torch.optim.SparseAdam: "it needs sparse gradients, and the engine accumulates dense ones",
}


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """FUSED_ADAM, ELEMENTWISE or PER_TENSOR for this optimizer; refuses what cannot be stepped exactly."""
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
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and not any(
            g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups):
        return FUSED_ADAM
    if type(optimizer) in ELEMENTWISE_CLASSES:
        return ELEMENTWISE
    return PER_TENSOR


@dataclass(frozen=True)
class TensorState:
    """One parameter's state as the optimizer keeps it: tensors (key, shape, dtype) and scalar keys."""

    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    scalars: tuple[str, ...]


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
    kind: str
    slots: tuple[Slot, ...]
    # PER_TENSOR: the state of a parameter, by (param group, shape); element-wise kinds: by group, shape ().
    states: tuple[tuple[tuple[int, tuple[int, ...]], TensorState], ...]

    @property
    def per_tensor(self) -> bool:
        return self.kind == PER_TENSOR

    def state_of(self, group: int, shape: Sequence[int]) -> TensorState:
        key = (group, tuple(shape) if self.per_tensor else ())
        return dict(self.states)[key]

    def slot_numel(self, slot: Slot, group: int, shape: Sequence[int]) -> int:
        """Elements of ``slot`` a parameter of this group and shape keeps (0: it has none)."""
        numel = math.prod(shape)
        for key, s, dtype in self.state_of(group, shape).tensors:
            if key == slot.key and dtype == slot.dtype:
                return math.prod(s) if self.per_tensor else numel
        return 0

    def bytes_per_elem(self, shapes: Sequence[tuple[int, Sequence[int]]]) -> float:
        """Bytes of optimizer state per trainable element over these (group, shape) parameters."""
        numel = sum(math.prod(s) for _, s in shapes)
        if not numel:
            return float(sum(slot.dtype.itemsize for slot in self.slots))
        total = sum(slot.dtype.itemsize * self.slot_numel(slot, g, s) for g, s in shapes for slot in self.slots)
        return total / numel

    def describe(self, bytes_per_elem: float) -> str:
        """e.g. 'optimizer state 2.03 B/param (AdamW8bit: state1 uint8, state2 uint8, absmax1 float32, ...)'."""
        parts = ", ".join(f"{slot.name} {str(slot.dtype).removeprefix('torch.')}" for slot in self.slots)
        return f"optimizer state {bytes_per_elem:.3g} B/param ({self.class_name.rsplit('.', 1)[-1]}: {parts or 'none'})"


def inspect_optimizer(optimizer: torch.optim.Optimizer, kind: str, params: Sequence[tuple[int, Sequence[int]]],
                      dtype: torch.dtype) -> OptimizerSpec:
    """The spec of ``optimizer`` over these trainable (param group, shape) parameters, stepped in ``dtype``.

    The state's keys, shapes and dtypes come from one step of the user's class on a stand-in parameter
    (on the meta device where the class allows it: no memory, no compute). A PER_TENSOR class outside
    torch.optim is also checked for state that couples parameters: two parameters stepped together must
    give what each gives stepped alone, bitwise."""
    cls = type(optimizer)
    class_name = f"{cls.__module__}.{cls.__qualname__}"
    shadow = ShadowOptimizer(optimizer)
    states: dict[tuple[int, tuple[int, ...]], TensorState] = {}
    if kind == FUSED_ADAM:
        adam = TensorState((("exp_avg", (), dtype), ("exp_avg_sq", (), dtype)), ("step",))
        states = {(g, ()): adam for g in {g for g, _ in params}}
    else:
        wanted = {(g, tuple(s) if kind == PER_TENSOR else ()) for g, s in params}
        for g, shape in sorted(wanted):
            states[(g, shape)] = probe(optimizer, shadow, optimizer.param_groups[g], shape if shape else (4,), dtype, class_name)
            if kind == ELEMENTWISE:
                states[(g, shape)] = TensorState(tuple((k, (), d) for k, _, d in states[(g, shape)].tensors),
                                                 states[(g, shape)].scalars)
        if kind == PER_TENSOR and not isinstance(optimizer, TORCH_PER_TENSOR):
            check_uncoupled(shadow, optimizer, dtype, class_name)
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


def probe(optimizer: torch.optim.Optimizer, shadow: ShadowOptimizer, group: dict, shape: tuple[int, ...], dtype: torch.dtype,
          class_name: str) -> TensorState:
    """The state the optimizer keeps for one parameter of ``shape`` after a step."""
    hps = {k: v for k, v in group.items() if k != "params"}
    state = None
    for device in ("meta", "cpu"):  # meta: free where every op of the step has a meta kernel
        try:
            p = torch.zeros(shape, dtype=dtype, device=device)
            g = torch.full(shape, 1e-3, dtype=dtype, device=device)
            # A throwaway twin on meta: what the class caches while failing there must not reach the real one.
            stepper = ShadowOptimizer(optimizer) if device == "meta" else shadow
            state = stepper.step(hps, [p], [g], [None])[0]
            break
        except Exception as error:  # noqa: BLE001 - any failure on meta means: try for real
            if device == "cpu":
                raise ValueError(f"{class_name} cannot step a {dtype} parameter of shape {list(shape)} on this "
                                 f"device: {type(error).__name__}: {error}") from error
    tensors, scalars = [], []
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter):
            # A tensor subclass (torchao's quantized optimizer states) is not the bytes it reports.
            raise ValueError(f"{class_name} keeps state['{key}'] as a {type(value).__name__} tensor subclass; "
                             "greedysnake stores plain tensors only. Return another optimizer from configure_optimizers "
                             "(for 8-bit AdamW: bitsandbytes' AdamW8bit or snake_strategy.optimizers.FusedAdamW8bit)")
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            tensors.append((key, tuple(value.shape), value.dtype))
        elif isinstance(value, (torch.Tensor, int, float, bool)):
            scalars.append(key)
        elif value is not None:
            raise ValueError(f"{class_name} keeps state['{key}'] as {type(value).__name__}; greedysnake stores "
                             "optimizer state that is a tensor or a number per parameter only: return another "
                             "optimizer from configure_optimizers")
    return TensorState(tuple(tensors), tuple(scalars))


def check_uncoupled(shadow: ShadowOptimizer, optimizer: torch.optim.Optimizer, dtype: torch.dtype,
                    class_name: str) -> None:
    """Refuse an optimizer whose step of one parameter depends on another (the engine steps a unit's
    parameters apart from the rest of the model)."""
    hps = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 96), (96, 64)]
    inits = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(2)]

    def run(indices: list[int]) -> list[torch.Tensor]:
        params = [inits[i].clone() for i in indices]
        states = [None] * len(indices)
        for step_grads in grads:
            states = shadow.step(hps, params, [step_grads[i].clone() for i in indices], states)
        return params

    together = run([0, 1])
    alone = [run([0])[0], run([1])[0]]
    if not all(torch.equal(a, b) for a, b in zip(together, alone)):
        raise ValueError(f"{class_name}'s step of one parameter depends on the others stepped with it (state that "
                         "couples parameters); greedysnake steps each unit's parameters apart from the rest of the "
                         "model, so it cannot reproduce it. Use an optimizer whose state is per parameter")
