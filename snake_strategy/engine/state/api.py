"""The engine as code outside it may use it, two protocols:

- ``TrainedWeights``: what the weights hand-back after fit and the weights file read of an engine. Both
  engines implement it (``engine/base.py``); ``engine/state/weights_file.py`` and the in-memory hand-back
  (``EngineBase.export_to_module``) use nothing else, so neither reaches into an engine's unit stores or its
  non-layer state. The weights come in groups: the non-layer parameters first, then one group per unit,
  so that only one unit's copy is in memory at a time.
- ``CheckpointedEngine``: what checkpoint/ reads and writes of the training engine.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn

# (module name, dtype, shape) of one parameter as the module gets it back.
WeightSpec = tuple[str, torch.dtype, torch.Size]


class TrainedWeights(Protocol):
    """The trained value of every parameter of ``module``, by module name: trainable ones from the master
    copy (``master_dtype``), frozen ones as stored."""

    module: nn.Module

    @property
    def num_units(self) -> int: ...

    def weight_specs(self) -> list[WeightSpec]:
        """Every parameter the module gets back, in the order ``weight_groups`` yields them; nothing is read."""
        ...

    def release_working_memory(self) -> None:
        """Apply pending updates, then give the step's working buffers back: the weights arrive next."""
        ...

    def weight_groups(self) -> Iterator[list[tuple[str, Tensor]]]:
        """The non-layer parameters, then each unit's: (name, CPU tensor) pairs, one unit in memory at a time."""
        ...


class CheckpointedEngine(Protocol):
    """What checkpoint/ reads and writes of the training engine (``engine/training.py``), and nothing else: the
    unit states where they live (to pin or copy), as CPU copies (to write) and back (to load), the non-layer
    state, the optimizer's record and scalars, and the run's shape. One unit's state in memory at a time."""

    num_units: int
    world_size: int
    step_count: int
    blocks_prefix: str

    @property
    def shard_rank(self) -> int:
        """This rank's index among the ranks the optimizer state is cut over (0 when not partitioned)."""
        ...

    @property
    def partitioned(self) -> bool:
        """Each rank keeps only its shard of the optimizer state (checkpoints write per-rank shards)."""
        ...

    @property
    def master_dtype(self) -> torch.dtype: ...

    @property
    def compute_dtype(self) -> torch.dtype: ...

    @property
    def blocks_per_unit(self) -> int: ...

    @property
    def nonlayer_nbytes(self) -> int: ...

    @property
    def ssd_path(self) -> str | None: ...

    @property
    def disk_idle(self) -> Callable[[], bool] | None: ...

    def flush(self) -> None:
        """Apply pending optimizer updates: what follows reads the state after the last step."""
        ...

    def state_names(self) -> tuple[str, ...]: ...

    def unit_numel(self, u: int) -> int: ...

    def unit_state_numel(self, u: int, name: str) -> int: ...

    def unit_range(self, u: int) -> tuple[int, int]: ...

    def unit_own_lengths(self, u: int) -> dict[str, int]: ...

    def unit_tiers(self, u: int) -> dict[str, Any]: ...

    def unit_slots(self, u: int, trainable: bool | None = True) -> list[tuple[str, list[int], int, int]]: ...

    def unit_state(self, u: int) -> dict[str, Tensor]: ...

    def local_unit_state(self, u: int) -> dict[str, Tensor]: ...

    def load_unit_state(self, u: int, state: dict[str, Tensor]) -> None: ...

    def nonlayer_state(self) -> dict[str, Any]: ...

    def load_nonlayer_state(self, state: dict[str, Any]) -> None: ...

    def frozen_checksums(self) -> dict[str, Any]: ...

    def optimizer_record(self) -> dict[str, Any]: ...

    def accepts_optimizer_record(self, saved: dict[str, Any]) -> bool: ...

    def optimizer_scalars(self) -> dict[str, Any]: ...

    def merge_optimizer_scalars(self, states: list[dict[str, Any]]) -> None: ...
