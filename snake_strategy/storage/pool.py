"""Bounded pools of reusable buffers: the in-flight limit of every producer in the engine.

A pool holds at most ``capacity`` buffers of ``numel`` elements, allocated on first use and reused
afterwards (no allocator churn, no page faults on every unit). ``acquire`` blocks while all of them are
out: the producer waits for a consumer to give one back (backpressure) instead of allocating more, so
host memory stays at the planned size whatever the ratio of compute, SSD and optimizer speed. The time
spent waiting is counted (``wait_s``) and reported per step as ``perf/backpressure_wait_s``.

``pin_memory=True`` (host buffers only) makes a staging pool of page-locked buffers: the only memory
a host<->device copy can cross PCIe from asynchronously (pageable memory never crosses; the driver
would bounce it synchronously). Pinned allocations round up (``pinned_allocation_bytes``), and
``bytes_allocated`` counts the real, rounded size: that is what the host budget must cover.
"""
from __future__ import annotations

import threading
import time

import torch

from snake_strategy.storage.aligned import aligned_allocation_bytes, aligned_empty
from snake_strategy.storage.streams import DONE, Event


class BufferPool:
    def __init__(self, name: str, capacity: int, numel: int, dtype: torch.dtype, device: torch.device,
                 pin_memory: bool = False, trace=None) -> None:
        """``trace``: the engine's ``TaskTrace`` (duck-typed: storage does not import the engine); while it is
        enabled, each blocked ``acquire`` is recorded as a backpressure wait on the waiting thread."""
        if capacity < 1:
            raise AssertionError(f"pool {name} needs capacity >= 1")
        if pin_memory and device.type != "cpu":
            raise AssertionError(f"pool {name}: only host buffers can be pinned (device {device})")
        self.name, self.capacity, self.numel, self.dtype, self.device = name, capacity, numel, dtype, device
        self._trace = trace
        self.pin_memory = pin_memory
        self._free: list[tuple[torch.Tensor, Event]] = []  # with the event after which it may be rewritten
        self._allocated = 0
        self._out: set[int] = set()  # data pointers of buffers handed out (catches double releases)
        self._cond = threading.Condition()
        self.wait_s = 0.0
        self.peak_out = 0

    @property
    def buffer_bytes(self) -> int:
        """The memory one buffer really takes (page slack on the host, the pinned rounding when pinned)."""
        elem_bytes = torch.empty((), dtype=self.dtype).element_size()
        if self.device.type != "cpu":
            return self.numel * elem_bytes
        return aligned_allocation_bytes(self.numel, elem_bytes, self.pin_memory)

    @property
    def bytes_allocated(self) -> int:
        return self._allocated * self.buffer_bytes

    def _new(self) -> torch.Tensor:
        if self.device.type == "cpu":
            # page-aligned: O_DIRECT reads land in place
            return aligned_empty(self.numel, self.dtype, pin_memory=self.pin_memory)
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def acquire(self) -> torch.Tensor:
        """A whole buffer of ``numel`` elements (slice it); blocks while ``capacity`` are out, then until
        the copies that last used it have finished (the host is about to write it)."""
        buffer, ready = self.acquire_ordered()
        ready.wait()  # sync point on CUDA only: the last asynchronous copy out of / into this buffer
        return buffer

    def acquire_ordered(self) -> tuple[torch.Tensor, Event]:
        """A buffer and the event its last user released it with: a stream writing into it must wait
        for that event first (``CopyStream.issuing(after=...)``); on CPU it is always complete."""
        with self._cond:
            start_s = None
            while not self._free and self._allocated >= self.capacity:
                start_s = start_s or time.perf_counter()
                self._cond.wait()  # backpressure: a consumer releases one
            if start_s is not None:
                self.wait_s += time.perf_counter() - start_s
            if self._free:
                buffer, ready = self._free.pop()
            else:
                self._allocated += 1
                buffer, ready = self._new(), DONE
            self._out.add(id(buffer))
            self.peak_out = max(self.peak_out, len(self._out))
        if start_s is not None and self._trace is not None and self._trace.enabled:
            self._trace.span("wait", f"wait {self.name} buffer", start_s, pool=self.name, backpressure=True)
        return buffer, ready

    def release(self, buffer: torch.Tensor, ready: Event = DONE) -> None:
        """Give ``buffer`` back; ``ready``: the event after which its last (asynchronous) use is over."""
        with self._cond:
            if id(buffer) not in self._out:
                raise AssertionError(f"pool {self.name}: releasing a buffer that is not out")
            self._out.discard(id(buffer))
            if self._allocated > self.capacity:  # shrunk by ``resize`` while it was out
                self._allocated -= 1
            else:
                self._free.append((buffer, ready))
            self._cond.notify()

    def resize(self, capacity: int) -> None:
        """Hold at most ``capacity`` buffers from now on; free buffers beyond it go back to the OS (buffers out
        stay valid and are dropped when given back while the pool is over its capacity)."""
        assert capacity >= 1, f"pool {self.name} needs capacity >= 1"
        with self._cond:
            self.capacity = capacity
            while self._free and self._allocated > capacity:
                self._free.pop()
                self._allocated -= 1
            self._cond.notify_all()

    def take_wait_s(self) -> float:
        with self._cond:
            wait, self.wait_s = self.wait_s, 0.0
        return wait

    def clear(self) -> None:
        """Drop the free buffers (their memory goes back to the OS); buffers still out stay valid."""
        with self._cond:
            self._allocated -= len(self._free)
            self._free.clear()
