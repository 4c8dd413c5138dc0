"""Storage tiers: page-aligned buffers, the SSD file I/O engine, and tiered flat tensors."""
from snake_strategy.storage.aligned import PAGE_BYTES, aligned_empty, round_up
from snake_strategy.storage.counters import TrafficCounters
from snake_strategy.storage.io_engine import IOEngine
from snake_strategy.storage.ssd_directory import SsdDirectory
from snake_strategy.storage.tiered import TieredTensor

__all__ = ["PAGE_BYTES", "aligned_empty", "round_up", "TrafficCounters", "IOEngine", "SsdDirectory", "TieredTensor"]
