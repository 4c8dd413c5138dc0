"""What an optimizer keeps per parameter, found by stepping its class on a stand-in parameter.

``probe`` steps the user's class once on a parameter of the wanted shape (on the meta device where every op of
its step has a meta kernel: no memory, no compute) and reads the state it leaves: tensors (key, shape, dtype)
and scalar keys. ``check_uncoupled`` refuses a class whose step of one parameter depends on another's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from snake_strategy.optimizers.stepping import ShadowOptimizer


@dataclass(frozen=True)
class TensorState:
    """One parameter's state as the optimizer keeps it: tensors (key, shape, dtype) and scalar keys."""

    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    scalars: tuple[str, ...]


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
