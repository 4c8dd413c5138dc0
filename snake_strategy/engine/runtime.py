"""What the caller supplies to run an engine besides the plan: the process's runtime (precision, device,
clipping, ranks, the weights to start from, progress) and the test hooks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from snake_strategy.precision import DtypePolicy, LossScaler
from snake_strategy.progress import Progress


@dataclass
class EngineHooks:
    """Test hooks that slow parts of the engine down deterministically (delay injection, never used in
    production): ``before_optimizer_chunk(unit)`` runs on the optimizer worker before each chunk step,
    ``before_ssd_transfer(direction, num_bytes)`` on an I/O thread before each SSD chunk."""

    before_optimizer_chunk: Callable[[int], None] | None = None
    before_ssd_transfer: Callable[[str, int], None] | None = None


@dataclass
class EngineRuntime:
    """How this process runs a plan: what the planner does not decide."""

    dtypes: DtypePolicy
    device: torch.device
    clip: tuple[str, float] | None = None  # (algorithm, value) from Trainer(gradient_clip_val=...)
    scaler: LossScaler | None = None  # 16-mixed: the precision plugin's loss scaler
    pretrained: str | None = None  # a state-dict / checkpoint / safetensors source streamed in per unit
    hooks: EngineHooks | None = None
    progress: Progress | None = None
    world_size: int = 1
    rank: int = 0
    shard_optimizer: bool = False  # data parallel: each rank keeps 1/N of the moments (ZeRO-1)
    trace: bool = False  # record timed spans for a timeline (``TaskTrace.enabled``; the strategy's trace_path)
