"""The one typed view of a running engine that code outside the engine may use.

The training engine (``SnakeEngine``) and the evaluation engine (``EvalEngine``) hold a model whose block
weights live in their tiers, not in the module. Everything outside ``engine/`` that needs those weights
or the step's figures (HF export, peft adapters, generation, telemetry, the CLI of a notebook) goes
through ``EngineView``, reached with ``running_engine``; nothing reads an engine's attributes directly.

- ``named_weights()``: every parameter by its module name, trained values (the master copy; frozen ones
  as stored), one unit in memory at a time.
- ``trainable_named_weights()``: the same for the trainable parameters only (a LoRA adapter's values).
- ``stream_blocks(hiddens, sides[, outputs])``: every unit over each hidden state, weights read-only
  (with ``outputs``, the blocks' outputs for the loss, per micro-batch).
- ``last_step``: a ``StepStats`` of the latest training step (an empty one for evaluation).
- ``counters``: cumulative bytes per tier/state/direction since the engine was built.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from snake_strategy.storage.counters import TrafficCounters


@dataclass
class StepStats:
    """What one training step measured (``EngineView.last_step``). Times in seconds, traffic in bytes
    per ``tier/state/direction``."""

    train_s: float = 0.0  # forward + backward tasks of the step
    io_wait_s: float = 0.0  # compute waiting for weights or checkpoints
    backpressure_wait_s: float = 0.0  # producers waiting for a free pooled buffer
    weight_grad_products: int = 0  # split backward: one per Linear call site
    kept_tasks: int = 0  # backward tasks that used a kept forward graph
    recomputed_tasks: int = 0  # backward tasks that recomputed their forward
    traffic: dict[str, int] = field(default_factory=dict)  # moved by the step's tasks
    optimizer_s: float = 0.0  # the optimizer step after the backward (the last backward parts)
    optimizer_wait_s: float = 0.0
    optimizer_busy_s: float = 0.0  # the optimizer worker's busy time during the step
    ssd_busy_s: float = 0.0  # seconds the SSD moved any chunk, from the last step's end to this one's
    optimizer_traffic: dict[str, int] = field(default_factory=dict)  # moved by the optimizer worker
    # Master weights + optimizer state of parameters that sat the step out (no gradient): neither read nor
    # written by the worker (each byte would otherwise have been read once and written once). Counted, like
    # optimizer_busy_s, over the worker's work since the previous step's report.
    optimizer_skipped_bytes: int = 0
    loss_scale: float | None = None  # fp16: the scale this step's loss was multiplied by
    skipped: bool = False  # fp16: an inf/nan gradient; no parameter changed
    grad_norm: float | None = None  # norm clipping: the global gradient norm (unscaled)
    clip_factor: float | None = None  # norm clipping: min(1, max_norm / (norm + 1e-6))
    # The speculative step (norm clipping / fp16, engine/optimizer/rollback.py): was this step speculative, was it
    # rolled back (its backward parts redone at the next forward, or restored), rollbacks so far.
    speculation: bool = False
    rolled_back: bool = False
    rollbacks: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready): one record of a benchmark or a test's history."""
        return dataclasses.asdict(self)

    def step_traffic(self) -> dict[str, int]:
        """The step's bytes per ``tier/state/direction``: its tasks' plus the optimizer worker's (counted
        apart because the worker overlaps the next step)."""
        out: dict[str, int] = defaultdict(int)
        for part in (self.traffic, self.optimizer_traffic):
            for key, value in part.items():
                out[key] += int(value)
        return dict(out)


@runtime_checkable
class EngineView(Protocol):
    """What both engines offer to code outside ``engine/`` (see the module docstring)."""

    counters: TrafficCounters
    last_step: StepStats
    master_dtype: torch.dtype  # of the trained values named_weights() yields

    @property
    def num_units(self) -> int: ...

    def flush(self) -> None: ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]: ...

    def trainable_named_weights(self) -> Iterator[tuple[str, Tensor]]: ...

    def stream_blocks(self, hiddens: list[Tensor], sides: list[dict[str, Any]],
                      outputs: list[list[Tensor]] | None = None) -> list[Tensor]: ...

    @property
    def autocast_dtype(self) -> torch.dtype | None: ...


def running_engine(owner: Any) -> EngineView | None:
    """The engine that holds ``owner``'s weights right now: ``owner`` is a ``Trainer``, a strategy or a
    LightningModule attached to a trainer. None outside greedysnake or before setup / after teardown."""
    if hasattr(owner, "strategy"):  # a Trainer
        strategy = owner.strategy
    elif hasattr(owner, "_trainer"):  # a LightningModule (its ``trainer`` property raises when detached)
        strategy = owner._trainer.strategy if owner._trainer is not None else None
    else:  # a strategy
        strategy = owner
    engine = getattr(strategy, "engine", None)
    return engine if isinstance(engine, EngineView) else None
