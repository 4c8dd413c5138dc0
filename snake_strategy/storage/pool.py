"""Bounded pools of reusable buffers: the in-flight limit of every producer in the engine.

A pool holds at most ``capacity`` buffers of ``numel`` elements, allocated on first use and reused
afterwards (no allocator churn, no page faults on every unit). ``acquire`` blocks while all of them are
out: the producer waits for a consumer to give one back (backpressure) instead of allocating more, so
host memory stays at the planned size whatever the ratio of compute, SSD and optimizer speed. The time
spent waiting is counted (``wait_s``) and reported per step as ``perf/backpressure_wait_s``.
"""
from __future__ import annotations

import threading
import time

import torch

from snake_strategy.storage.aligned import aligned_empty


class BufferPool:
    def __init__(self, name: str, capacity: int, numel: int, dtype: torch.dtype, device: torch.device,
                 trace=None) -> None:
        """``trace``: the engine's ``TaskTrace`` (duck-typed: storage does not import the engine); while it is
        enabled, each blocked ``acquire`` is recorded as a backpressure wait on the waiting thread."""
        if capacity < 1:
            raise AssertionError(f"pool {name} needs capacity >= 1")
        self.name, self.capacity, self.numel, self.dtype, self.device = name, capacity, numel, dtype, device
        self._trace = trace
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._out: set[int] = set()  # data pointers of buffers handed out (catches double releases)
        self._cond = threading.Condition()
        self.wait_s = 0.0
        self.peak_out = 0

    @property
    def bytes_allocated(self) -> int:
        return self._allocated * self.numel * torch.empty((), dtype=self.dtype).element_size()

    def _new(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return aligned_empty(self.numel, self.dtype)  # page-aligned: O_DIRECT reads land in place
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def acquire(self) -> torch.Tensor:
        """A whole buffer of ``numel`` elements (slice it); blocks while ``capacity`` are out."""
        with self._cond:
            start_s = None
            while not self._free and self._allocated >= self.capacity:
                start_s = start_s or time.perf_counter()
                self._cond.wait()  # backpressure: a consumer releases one
            if start_s is not None:
                self.wait_s += time.perf_counter() - start_s
            if self._free:
                buffer = self._free.pop()
            else:
                self._allocated += 1
                buffer = self._new()
            self._out.add(id(buffer))
            self.peak_out = max(self.peak_out, len(self._out))
        if start_s is not None and self._trace is not None and self._trace.enabled:
            self._trace.span("wait", f"wait {self.name} buffer", start_s, pool=self.name, backpressure=True)
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        with self._cond:
            if id(buffer) not in self._out:
                raise AssertionError(f"pool {self.name}: releasing a buffer that is not out")
            self._out.discard(id(buffer))
            self._free.append(buffer)
            self._cond.notify()

    def take_wait_s(self) -> float:
        with self._cond:
            wait, self.wait_s = self.wait_s, 0.0
        return wait

    def clear(self) -> None:
        """Drop the free buffers (their memory goes back to the OS); buffers still out stay valid."""
        with self._cond:
            self._allocated -= len(self._free)
            self._free.clear()
