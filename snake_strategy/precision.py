"""The greedysnake precision plugin: which dtypes the engine stores and computes in, and the loss scaler.

| precision    | compute weights | master, moments, grads | stages run under  |
|--------------|-----------------|------------------------|-------------------|
| "32-true"    | fp32 (= master) | fp32                   | fp32              |
| "64-true"    | fp64 (= master) | fp64                   | fp64              |
| "bf16-mixed" | matmul weights bf16, the rest fp32 | fp32 (separate copy) | autocast(bf16) |
| "bf16-true"  | bf16            | fp32 (separate copy)   | bf16              |
| "16-mixed"   | matmul weights fp16, the rest fp32 | fp32 (separate copy) | autocast(fp16), dynamic loss scale |

In the mixed precisions the matmul weights (Linear/conv ``weight``) are stored in the autocast dtype
(``half_weights=True``, the default): autocast would round them to it before every product anyway, so
the numbers are autocast's and the weight traffic halves. ``half_weights=False``: fp32 compute weights
(= master), as before.

16-mixed skips an overflowing step exactly (no weight, moment or step-counter change) and halves the
scale; the scaler's state is part of every checkpoint. On a CPU-only machine Lightning turns
``Trainer(precision="16-mixed")`` into "bf16-mixed" before the strategy sees it; pass
``GreedySnakeStrategy(precision_plugin=GreedySnakePrecision("16-mixed"))`` to get fp16 there.

Gradients are produced by the engine's schedule, so ``backward`` does nothing; the ``pre_backward`` /
``post_backward`` hooks are kept so ``on_before_backward`` / ``on_after_backward`` still fire.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override


@dataclass(frozen=True)
class DtypePolicy:
    """Which dtypes the engine stores and computes in."""

    compute: torch.dtype  # the weights the blocks run with
    master: torch.dtype  # master weights, moments and gradient accumulators
    autocast: torch.dtype | None = None  # mixed precision: run the stages under autocast
    loss_scaling: bool = False  # 16-mixed: dynamic loss scaling, overflowing steps skipped exactly
    # Mixed precision: the blocks' matmul weights are stored and moved in this dtype (the autocast one),
    # the rest of the block weights in ``compute``, the master copy separately (engine/state/half_weights.py).
    half_weights: torch.dtype | None = None

    @property
    def weights(self) -> torch.dtype:
        """The dtype of a unit's stored compute-weight vector."""
        return self.half_weights or self.compute

    def bytes_per(self, which: str) -> int:
        return torch.empty((), dtype=getattr(self, which)).element_size()


class LossScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's policy and defaults.

    ``scale`` multiplies the loss before the backward. After each step, ``update(found_inf)`` halves the
    scale on overflow (the step is skipped) and doubles it after ``growth_interval`` clean steps in a
    row. Disabled (scale 1, never skips) for every precision but 16-mixed.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if enabled and (init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1):
            raise ValueError(f"loss scaler settings init_scale={init_scale}, growth_factor={growth_factor}, "
                             f"backoff_factor={backoff_factor}, growth_interval={growth_interval} are invalid: "
                             "need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> bool:
        """Advance after a step whose gradients were (not) finite; True when the step must be skipped."""
        if not self.enabled:
            return False
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return True
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


_POLICIES = {
    "32-true": DtypePolicy(compute=torch.float32, master=torch.float32),
    "64-true": DtypePolicy(compute=torch.float64, master=torch.float64),
    "bf16-mixed": DtypePolicy(compute=torch.float32, master=torch.float32, autocast=torch.bfloat16,
                              half_weights=torch.bfloat16),
    "bf16-true": DtypePolicy(compute=torch.bfloat16, master=torch.float32),
    "16-mixed": DtypePolicy(compute=torch.float32, master=torch.float32, autocast=torch.float16, loss_scaling=True,
                            half_weights=torch.float16),
}
SUPPORTED_PRECISIONS = tuple(_POLICIES)


class GreedySnakePrecision(Precision):
    """Args:
        precision: one of ``SUPPORTED_PRECISIONS``.
        init_scale, growth_interval: the 16-mixed loss scaler's start value and clean steps per doubling
            (torch.amp.GradScaler's defaults).
        half_weights: in bf16-mixed / 16-mixed, store and move the blocks' matmul weights in the autocast
            dtype (half the weight traffic; the same numbers as autocast, engine/state/half_weights.py). False
            keeps them in fp32 (then the compute copy is the master copy, stored once).
    """

    def __init__(self, precision: str = "32-true", init_scale: float = 2.0**16, growth_interval: int = 2000,
                 half_weights: bool = True) -> None:
        precision = str(precision)
        if precision not in _POLICIES:
            raise ValueError(
                f"Trainer(precision='{precision}') is not supported by strategy='greedysnake'; use one of "
                f"{SUPPORTED_PRECISIONS}"
            )
        self.precision = precision
        self.dtypes = _POLICIES[precision]
        if not half_weights:
            self.dtypes = dataclasses.replace(self.dtypes, half_weights=None)
        self.init_scale, self.growth_interval = init_scale, growth_interval
        self.make_scaler()  # validates the settings now, not at the first step

    def make_scaler(self) -> LossScaler:
        return LossScaler(self.dtypes.loss_scaling, init_scale=self.init_scale, growth_interval=self.growth_interval)

    @override
    @contextlib.contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        # Parameters are created (on the meta device) in the master dtype; the engine makes the
        # compute copy. 64-true therefore initialises in fp64, exactly like Lightning's DoublePrecision.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtypes.master)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # the engine places every parameter in its dtype and tier

    @override
    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """No-op: the schedule already produced every gradient inside ``training_step``."""

    @override
    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """No-op here: the engine clips exactly (engine/step/gradients.py); the optimizer's parameters hold no
        gradients."""

    @override
    def convert_input(self, data: Any) -> Any:
        # Integer token batches pass through; floating inputs follow the compute dtype.
        compute = self.dtypes.compute
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(compute) if t.is_floating_point() else t)
