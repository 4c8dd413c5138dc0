"""``TrainedWeights``: what the weights hand-back after fit and the weights file read of an engine.

Both engines implement it (``engine/base.py``); ``engine/state/weights_file.py`` and the in-memory hand-back
(``EngineBase.export_to_module``) use nothing else, so neither reaches into an engine's unit stores or its
non-layer state. The weights come in groups: the non-layer parameters first, then one group per unit,
so that only one unit's copy is in memory at a time.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

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
