"""The greedysnake precision plugin: which dtypes the engine stores and computes in.

| precision    | compute weights | master, moments, grads | stages run under  |
|--------------|-----------------|------------------------|-------------------|
| "32-true"    | fp32 (= master) | fp32                   | fp32              |
| "64-true"    | fp64 (= master) | fp64                   | fp64              |
| "bf16-mixed" | fp32 (= master) | fp32                   | autocast(bf16)    |
| "bf16-true"  | bf16            | fp32 (separate copy)   | bf16              |
| "16-mixed"   | fp32 (= master) | fp32                   | autocast(fp16), dynamic loss scale |

16-mixed skips an overflowing step exactly (no weight, moment or step-counter change) and halves the
scale. On a CPU-only machine Lightning turns ``Trainer(precision="16-mixed")`` into "bf16-mixed"
before the strategy sees it; pass ``GreedySnakeStrategy(precision_plugin=GreedySnakePrecision("16-mixed"))``
to get fp16 there.

Gradients are produced by the engine's schedule, so ``backward`` does nothing; the ``pre_backward`` /
``post_backward`` hooks are kept so ``on_before_backward`` / ``on_after_backward`` still fire.
"""
from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from snake_strategy.engine import DtypePolicy

_POLICIES = {
    "32-true": DtypePolicy(compute=torch.float32, master=torch.float32),
    "64-true": DtypePolicy(compute=torch.float64, master=torch.float64),
    "bf16-mixed": DtypePolicy(compute=torch.float32, master=torch.float32, autocast=torch.bfloat16),
    "bf16-true": DtypePolicy(compute=torch.bfloat16, master=torch.float32),
    "16-mixed": DtypePolicy(compute=torch.float32, master=torch.float32, autocast=torch.float16, loss_scaling=True),
}
SUPPORTED_PRECISIONS = tuple(_POLICIES)


class GreedySnakePrecision(Precision):
    def __init__(self, precision: str = "32-true") -> None:
        precision = str(precision)
        if precision not in _POLICIES:
            raise ValueError(
                f"Trainer(precision='{precision}') is not supported by strategy='greedysnake'; use one of "
                f"{SUPPORTED_PRECISIONS}"
            )
        self.precision = precision
        self.dtypes = _POLICIES[precision]

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
        """No-op here: the engine clips (exactly, see engine._clip_nonlayer_and_scale); the optimizer's
        parameters hold no gradients."""

    @override
    def convert_input(self, data: Any) -> Any:
        # Integer token batches pass through; floating inputs follow the compute dtype.
        compute = self.dtypes.compute
        return _map_floats(data, lambda t: t.to(compute))


def _map_floats(data: Any, fn) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data) if data.is_floating_point() else data
    if isinstance(data, dict):
        return {k: _map_floats(v, fn) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_map_floats(v, fn) for v in data)
    return data
