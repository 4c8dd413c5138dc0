"""Test hooks of the engine (delay and fault injection through a public object, never used in production)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class EngineHooks:
    """Test hooks that slow parts of the engine down deterministically (delay injection, never used in
    production): ``before_optimizer_chunk(unit)`` runs on the optimizer worker before each chunk step,
    ``before_ssd_transfer(direction, num_bytes)`` on an I/O thread before each SSD chunk."""

    before_optimizer_chunk: Callable[[int], None] | None = None
    before_ssd_transfer: Callable[[str, int], None] | None = None
