"""Activation checkpoints: the input of every unit for every micro-batch, kept between the forward and
the backward pass, in memory or in one SSD file per unit (one page-aligned slot per micro-batch).

Which micro-batches go to the SSD is ``memory_model.checkpoint_tiers`` (the turning points stay in memory).
SSD writes are asynchronous from a bounded staging pool: when every staging buffer is in flight, ``put``
waits for the oldest write (backpressure) instead of allocating more.

On CUDA, host checkpoints go device->host into pinned buffers on the copy stream (``storage/streams.py``),
asynchronously: the copy stream waits for the compute event that produced the tensor, and the compute
stream waits for the copy's event before the bytes come back. Pinned buffers are kept for reuse (their
count is bounded by the checkpoints a step holds, which ``memory_model.host_plan`` counts at their pinned size).
On CPU the host tier is the same memory: the tensor is kept as it is, and every event is complete.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict

import torch
from torch import Tensor

from snake_strategy.config import StorageConfig
from snake_strategy.planning.memory_model import checkpoint_tiers
from snake_strategy.storage import IOEngine, SsdDirectory, TrafficCounters, aligned_empty, round_up
from snake_strategy.storage.aligned import padded_bytes
from snake_strategy.storage.io_engine import Ticket
from snake_strategy.storage.streams import DONE, CopyStream, Event, copy_stream


class ActivationStore:
    STATE = "checkpoints"

    def __init__(self, storage: StorageConfig, num_micro: int, num_units: int, staging_buffers: int,
                 device: torch.device, counters: TrafficCounters, io: IOEngine | None, ssd: SsdDirectory | None,
                 trace=None, copies: CopyStream | None = None) -> None:
        self._device, self._counters, self._io, self._ssd = device, counters, io, ssd
        # The engine's TaskTrace (duck-typed: importing the engine package from here would be circular);
        # while it is enabled, the waits below are recorded as timeline spans.
        self._trace = trace
        self._copies = copy_stream(device) if copies is None else copies
        self._pin = device.type == "cuda"  # host buffers that cross PCIe are pinned
        self._num_units, self._staging_limit = num_units, max(1, staging_buffers)
        self.set_num_micro(storage, num_micro)
        self._in_memory: dict[tuple[int, int], Tensor] = {}
        self._on_ssd: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = {}
        self._files: dict[int, tuple[int, int]] = {}  # unit -> (fd, slot bytes)
        self._writes: OrderedDict[tuple[int, int], tuple[Ticket, Tensor]] = OrderedDict()  # in flight, oldest first
        self._spare: list[Tensor] = []  # staging buffers whose write finished, for reuse
        # CUDA host checkpoints: key -> (pinned buffer, event of its device->host copy); and pinned
        # buffers free for reuse, with the compute event after which they may be overwritten.
        self._pinned: dict[tuple[int, int], tuple[Tensor, Event]] = {}
        self._pinned_spare: list[tuple[Tensor, Event]] = []
        self._reads: dict[tuple[int, int], tuple[Ticket, Tensor]] = {}  # prefetches in flight
        self._space_checked = False
        self.wait_s = 0.0  # main-thread time blocked on checkpoint I/O
        self.backpressure_s = 0.0  # of which: waiting for a staging buffer

    def set_num_micro(self, storage: StorageConfig, num_micro: int) -> None:
        """The tier of every micro-batch for steps of ``num_micro`` micro-batches (a short last batch has fewer)."""
        self._tiers = checkpoint_tiers(storage, num_micro)

    def _tracing(self) -> bool:
        return self._trace is not None and self._trace.enabled

    def tier_of(self, micro: int) -> str:
        return self._tiers[micro]

    def put(self, unit: int, micro: int, hidden: Tensor) -> None:
        """Keep ``hidden`` as the checkpoint of (unit, micro). SSD writes are asynchronous."""
        hidden = hidden.detach()
        num_bytes = hidden.numel() * hidden.element_size()
        tier = self.tier_of(micro)
        self._counters.add(tier, self.STATE, "write", num_bytes)
        key = (unit, micro)
        if tier == "device":
            self._in_memory[key] = hidden
        elif tier == "host" and not self._pin:
            self._in_memory[key] = hidden  # on CPU the host tier is the same memory: count the bytes
        elif tier == "host":
            # The copy stream starts once compute has produced ``hidden``; that compute event also
            # covers the buffer's own reuse event (an earlier event of the same stream).
            buffer, _ = self._pinned_buffer(hidden.numel(), hidden.dtype)
            event = self._copies.copy_async(buffer, hidden.reshape(-1), after=self._copies.record())
            self._pinned[key] = (buffer.view(hidden.shape), event)
        else:
            fd, slot_bytes = self._file(unit, num_bytes)
            staging = self._staging(hidden.numel(), hidden.dtype)
            # Into a page-aligned buffer (O_DIRECT needs it); pinned on CUDA, via the copy stream.
            copied = self._copies.copy_async(staging, hidden.reshape(-1), after=self._copies.record())
            copied.wait()  # sync point on CUDA: the SSD write reads these host bytes
            ticket = self._io.submit_write(fd, micro * slot_bytes, padded_bytes(staging), self.STATE)
            self._writes[key] = (ticket, staging)
            self._on_ssd[key] = (hidden.shape, hidden.dtype)

    def prefetch(self, unit: int, micro: int) -> None:
        """Start reading an SSD checkpoint that a coming task needs (no-op for in-memory ones)."""
        key = (unit, micro)
        if key not in self._on_ssd or key in self._reads:
            return
        self._finish_write(key)
        shape, dtype = self._on_ssd[key]
        fd, slot_bytes = self._files[unit]
        buffer = aligned_empty(shape.numel(), dtype, pin_memory=self._pin)
        self._counters.add("ssd", self.STATE, "read", shape.numel() * buffer.element_size())
        self._reads[key] = (self._io.submit_read(fd, micro * slot_bytes, padded_bytes(buffer), self.STATE), buffer)

    def get(self, unit: int, micro: int) -> Tensor:
        key = (unit, micro)
        if key in self._in_memory:
            hidden = self._in_memory[key]
            self._counters.add(self.tier_of(micro), self.STATE, "read", hidden.numel() * hidden.element_size())
            return hidden.to(self._device, non_blocking=True)
        if key in self._pinned:
            buffer, copied = self._pinned[key]
            self._counters.add("host", self.STATE, "read", buffer.numel() * buffer.element_size())
            self._copies.wait_event(copied)  # the compute stream, not the host, waits for the D2H copy
            return buffer.to(self._device, non_blocking=True)  # on the compute stream: needed now
        self.prefetch(unit, micro)
        ticket, buffer = self._reads.pop(key)
        start_s = time.perf_counter()
        ticket.wait()  # sync point: exposed I/O when the prefetch was too late (or never issued)
        self.wait_s += time.perf_counter() - start_s
        if self._tracing():
            self._trace.span("wait", "wait checkpoint read", start_s, unit=unit, micro=micro)
        shape, _ = self._on_ssd[key]
        return buffer.view(shape).to(self._device, non_blocking=self._pin)  # pinned: the allocator tracks it

    def drop(self, unit: int, micro: int) -> None:
        key = (unit, micro)
        self._in_memory.pop(key, None)
        self._drop_pinned(key)
        self._finish_write(key)
        if key in self._reads:
            self._reads.pop(key)[0].wait()
        self._on_ssd.pop(key, None)

    def clear(self) -> None:
        """Forget every checkpoint; waits for the I/O in flight. Raises the first I/O error, after
        everything has been waited on (teardown relies on it)."""
        first_error: BaseException | None = None
        for key in list(self._writes):
            try:
                self._finish_write(key)
            except BaseException as err:  # keep draining: a later write must not outlive its buffer
                first_error = first_error or err
        for ticket, _ in self._reads.values():
            try:
                ticket.wait()
            except BaseException as err:
                first_error = first_error or err
        self._reads.clear()
        for key in list(self._pinned):
            self._drop_pinned(key)  # kept for the next step: pinned memory is slow to allocate
        self._in_memory.clear()
        self._on_ssd.clear()
        self._spare.clear()
        if first_error is not None:
            raise first_error

    def _drop_pinned(self, key: tuple[int, int]) -> None:
        if key in self._pinned:
            buffer, _ = self._pinned.pop(key)
            # Reusable once every kernel issued so far (the host->device copy out of it) has run.
            self._pinned_spare.append((buffer.reshape(-1), self._copies.record()))

    def _pinned_buffer(self, numel: int, dtype: torch.dtype) -> tuple[Tensor, Event]:
        for i, (buffer, ready) in enumerate(self._pinned_spare):
            if buffer.dtype == dtype and buffer.numel() == numel:
                del self._pinned_spare[i]
                return buffer, ready
        if self._pinned_spare:
            self._pinned_spare.pop(0)  # a size no longer used (a short batch): bounded, not hoarded
        return aligned_empty(numel, dtype, pin_memory=True), DONE

    def _staging(self, numel: int, dtype: torch.dtype) -> Tensor:
        if len(self._writes) >= self._staging_limit:
            start_s = time.perf_counter()
            self._finish_write(next(iter(self._writes)))  # backpressure: the oldest write must land first
            self.backpressure_s += time.perf_counter() - start_s
            if self._tracing():
                self._trace.span("wait", "wait checkpoint staging", start_s, backpressure=True)
        while self._spare:
            buffer = self._spare.pop()
            if buffer.dtype == dtype and buffer.numel() >= numel:
                return buffer[:numel]
        return aligned_empty(numel, dtype, pin_memory=self._pin)

    def _finish_write(self, key: tuple[int, int]) -> None:
        if key in self._writes:
            ticket, staging = self._writes.pop(key)
            start_s = time.perf_counter()
            blocks = self._tracing() and not ticket.done()  # timed only when tracing and not yet landed
            try:
                ticket.wait()  # the staging buffer may be reused only once the write is done
            finally:
                self.wait_s += time.perf_counter() - start_s
            if blocks:
                self._trace.span("wait", "wait checkpoint write", start_s, unit=key[0], micro=key[1])
            self._spare.append(staging)

    def _file(self, unit: int, num_bytes: int) -> tuple[int, int]:
        slot_bytes = round_up(num_bytes)
        num_slots = len(self._tiers)
        if unit in self._files and self._files[unit][1] >= slot_bytes:
            return self._files[unit]  # a smaller micro-batch (a short last batch) fits the slot
        if self._ssd is None or self._io is None:
            raise AssertionError("SSD checkpoints need an SsdDirectory and an IOEngine")
        if not self._space_checked:
            # Checkpoint sizes are known only now: check the free space before the first write.
            self._ssd.check_free_space(slot_bytes * num_slots * self._num_units, "activation checkpoints")
            self._space_checked = True
        if unit not in self._files:
            self._files[unit] = (self._ssd.open(f"{self.STATE}/unit{unit:05d}.bin", slot_bytes * num_slots), slot_bytes)
            return self._files[unit]
        if any(key[0] == unit for key in self._on_ssd):
            raise ValueError(f"unit {unit} produced activations of {num_bytes} bytes after {self._files[unit][1]}-byte "
                             "ones in the same step; all micro-batches of a step must have the same shape")
        fd = self._files[unit][0]
        os.ftruncate(fd, slot_bytes * num_slots)  # a new step with a longer sequence: grow the file
        self._files[unit] = (fd, slot_bytes)
        return self._files[unit]
