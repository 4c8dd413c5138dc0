"""Activation checkpoints: the input of every unit for every micro-batch, kept between the forward
and the backward pass, on the host or in one SSD file per unit (one page-aligned slot per micro-batch).

Following greedysnake.md section 3, the first and last ``host_ends`` micro-batches of each unit stay in
memory: they are the schedule's turning points, where the next task needs the tensor at once and an
SSD round trip could not be hidden. The SSD fraction applies to the micro-batches in between.
"""
from __future__ import annotations

import os
import time

import torch
from torch import Tensor

from snake_strategy.config import TierSplit
from snake_strategy.storage import IOEngine, SsdDirectory, TrafficCounters, aligned_empty, round_up
from snake_strategy.storage.aligned import padded_bytes
from snake_strategy.storage.io_engine import Ticket


class ActivationStore:
    STATE = "checkpoints"

    def __init__(
        self,
        split: TierSplit,
        host_ends: int,
        num_micro: int,
        device: torch.device,
        counters: TrafficCounters,
        io: IOEngine | None,
        ssd: SsdDirectory | None,
    ) -> None:
        self._device, self._counters, self._io, self._ssd = device, counters, io, ssd
        middle = [m for m in range(num_micro) if host_ends <= m < num_micro - host_ends]
        num_ssd = min(len(middle), round(split.ssd * num_micro))
        num_device = min(len(middle) - num_ssd, round(split.device * num_micro))
        self._ssd_micro = set(middle[len(middle) - num_ssd:]) if num_ssd else set()
        # On a GPU, "device" checkpoints stay in GPU memory; "host" ones move to (pinned) host memory.
        self._device_micro = set(middle[:num_device])
        self._in_memory: dict[tuple[int, int], Tensor] = {}
        self._on_ssd: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = {}
        self._files: dict[int, tuple[int, int]] = {}  # unit -> (fd, slot bytes)
        self._writes: dict[tuple[int, int], tuple[Ticket, Tensor]] = {}  # in flight, with their staging
        self._reads: dict[tuple[int, int], tuple[Ticket, Tensor]] = {}  # prefetches in flight
        self.wait_s = 0.0  # main-thread time blocked on checkpoint I/O

    def tier_of(self, micro: int) -> str:
        if micro in self._ssd_micro:
            return "ssd"
        return "device" if micro in self._device_micro else "host"

    def put(self, unit: int, micro: int, hidden: Tensor) -> None:
        """Keep ``hidden`` as the checkpoint of (unit, micro). SSD writes are asynchronous."""
        hidden = hidden.detach()
        num_bytes = hidden.numel() * hidden.element_size()
        tier = self.tier_of(micro)
        self._counters.add(tier, self.STATE, "write", num_bytes)
        key = (unit, micro)
        if tier == "device":
            self._in_memory[key] = hidden
        elif tier == "host":
            # On CPU the host tier is the same memory: keep the tensor, count the bytes.
            self._in_memory[key] = hidden if self._device.type == "cpu" else hidden.to("cpu")
        else:
            fd, slot_bytes = self._file(unit, num_bytes)
            staging = aligned_empty(hidden.numel(), hidden.dtype)
            staging.copy_(hidden.reshape(-1))  # a copy into a page-aligned buffer (O_DIRECT needs it)
            ticket = self._io.submit_write(fd, micro * slot_bytes, padded_bytes(staging))
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
        buffer = aligned_empty(shape.numel(), dtype)
        self._counters.add("ssd", self.STATE, "read", shape.numel() * buffer.element_size())
        self._reads[key] = (self._io.submit_read(fd, micro * slot_bytes, padded_bytes(buffer)), buffer)

    def get(self, unit: int, micro: int) -> Tensor:
        key = (unit, micro)
        if key in self._in_memory:
            hidden = self._in_memory[key]
            self._counters.add(self.tier_of(micro), self.STATE, "read", hidden.numel() * hidden.element_size())
            return hidden.to(self._device, non_blocking=True)
        self.prefetch(unit, micro)
        ticket, buffer = self._reads.pop(key)
        start_s = time.perf_counter()
        ticket.wait()  # sync point: exposed I/O when the prefetch was too late (or never issued)
        self.wait_s += time.perf_counter() - start_s
        shape, _ = self._on_ssd[key]
        return buffer.view(shape).to(self._device)

    def drop(self, unit: int, micro: int) -> None:
        key = (unit, micro)
        self._in_memory.pop(key, None)
        self._finish_write(key)
        if key in self._reads:
            self._reads.pop(key)[0].wait()
        self._on_ssd.pop(key, None)

    def clear(self) -> None:
        for key in list(self._writes):
            self._finish_write(key)
        for ticket, _ in self._reads.values():
            ticket.wait()
        self._reads.clear()
        self._in_memory.clear()
        self._on_ssd.clear()

    def _finish_write(self, key: tuple[int, int]) -> None:
        if key in self._writes:
            ticket, _staging = self._writes.pop(key)
            start_s = time.perf_counter()
            ticket.wait()  # the staging buffer may be freed only once the write is done
            self.wait_s += time.perf_counter() - start_s

    def _file(self, unit: int, num_bytes: int) -> tuple[int, int]:
        slot_bytes = round_up(num_bytes)
        num_slots = max(self._ssd_micro) + 1
        if unit not in self._files:
            if self._ssd is None or self._io is None:
                raise AssertionError("SSD checkpoints need an SsdDirectory and an IOEngine")
            self._files[unit] = (self._ssd.open(f"{self.STATE}/unit{unit:05d}.bin", slot_bytes * num_slots), slot_bytes)
        fd, known = self._files[unit]
        if known != slot_bytes:
            if any(key[0] == unit for key in self._on_ssd):
                raise ValueError(f"unit {unit} produced activations of {num_bytes} bytes after {known}-byte ones in "
                                 "the same step; all micro-batches of a step must have the same shape")
            # A new step with another shape (a smaller last batch, another sequence length): resize the file.
            os.ftruncate(fd, slot_bytes * num_slots)
            self._files[unit] = (fd, slot_bytes)
        return fd, slot_bytes
