"""A flat 1-D tensor whose elements are split over the device, host and SSD tiers.

Layout of one TieredTensor of ``numel`` elements:

    [0, device_end)          resident on the compute device
    [device_end, host_end)   host memory (pinned when the device is CUDA)
    [host_end, numel)        an SSD file; host_end is rounded to a page boundary so the SSD segment of
                             a page-aligned working buffer is itself page-aligned (O_DIRECT reads land
                             straight in it on CPU, no bounce copy)

``fetch`` assembles the whole tensor into a working buffer on the device; ``evict`` writes one back.
A tensor that lives entirely on the device is handed out in place (``resident``), with no copy at all.
"""
from __future__ import annotations

import torch

from snake_strategy.storage.aligned import PAGE_BYTES, aligned_empty, padded_bytes, round_up
from snake_strategy.storage.counters import TrafficCounters
from snake_strategy.storage.io_engine import DONE, IOEngine, SsdDirectory, Ticket
from snake_strategy.config import TierSplit


class _Joined(Ticket):
    def __init__(self, tickets: list[Ticket], keepalive: tuple = ()) -> None:
        super().__init__([f for t in tickets for f in t._futures])
        self._keepalive = keepalive  # buffers that must outlive the transfer


class TieredTensor:
    def __init__(
        self,
        name: str,
        state: str,
        numel: int,
        dtype: torch.dtype,
        split: TierSplit,
        device: torch.device,
        counters: TrafficCounters,
        io: IOEngine | None = None,
        ssd: SsdDirectory | None = None,
    ) -> None:
        self.name, self.state, self.numel, self.dtype, self.device = name, state, numel, dtype, device
        self.elem_bytes = torch.empty((), dtype=dtype).element_size()
        self._counters, self._io = counters, io
        elems_per_page = PAGE_BYTES // self.elem_bytes
        self.device_end = min(numel, round(split.device * numel))
        host_end = min(numel, self.device_end + round(split.host * numel))
        if host_end < numel:
            # Page-align the SSD segment's start (it may take a few more elements than its share).
            host_end = (host_end // elems_per_page) * elems_per_page
            host_end = max(host_end, (self.device_end // elems_per_page) * elems_per_page)
            self.device_end = min(self.device_end, host_end)
        self.host_end = host_end
        pin = device.type == "cuda"
        self._device_seg = torch.empty(self.device_end, dtype=dtype, device=device)
        self._host_seg = aligned_empty(self.host_end - self.device_end, dtype, pin_memory=pin)
        self._fd = None
        ssd_numel = numel - self.host_end
        self.ssd_bytes = round_up(ssd_numel * self.elem_bytes) if ssd_numel else 0
        if ssd_numel:
            if ssd is None or io is None:
                raise AssertionError("an SSD share needs an SsdDirectory and an IOEngine")
            self._fd = ssd.open(f"{state}/{name}.bin", self.ssd_bytes)
            self.ssd_path = f"{ssd.path}/{state}/{name}.bin"

    @property
    def resident(self) -> bool:
        """True when every element lives on the device: use ``device_tensor()`` in place."""
        return self.device_end == self.numel

    def device_tensor(self) -> torch.Tensor:
        if not self.resident:
            raise AssertionError(f"{self.name} is not fully device-resident")
        return self._device_seg

    def new_buffer(self) -> torch.Tensor:
        """A working buffer the tensor can be fetched into (page-aligned on CPU)."""
        if self.device.type == "cpu":
            return aligned_empty(self.numel, self.dtype)
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def start_fetch(self, out: torch.Tensor) -> Ticket:
        """Begin filling ``out`` (numel elements on the device); the SSD part runs on the I/O threads."""
        a, b, n = self.device_end, self.host_end, self.numel
        es = self.elem_bytes
        out[:a].copy_(self._device_seg)
        self._counters.add("device", self.state, "read", a * es)
        out[a:b].copy_(self._host_seg, non_blocking=True)
        self._counters.add("host", self.state, "read", (b - a) * es)
        if b == n:
            return DONE
        self._counters.add("ssd", self.state, "read", self.ssd_bytes)
        if out.device.type == "cpu":
            return self._io.submit_read(self._fd, 0, padded_bytes(out[b:]))
        # CUDA: the SSD part lands in a pinned bounce buffer, then crosses the host link. This copy is
        # issued after the read completes, inside wait(); see _StagedFetch.
        staging = aligned_empty(n - b, self.dtype, pin_memory=True)
        return _StagedFetch(self._io.submit_read(self._fd, 0, padded_bytes(staging)), staging, out[b:])

    def start_evict(self, src: torch.Tensor) -> Ticket:
        """Begin writing ``src`` back; ``src`` must stay untouched until the ticket is waited on."""
        a, b, n = self.device_end, self.host_end, self.numel
        es = self.elem_bytes
        if not (self.resident and src.data_ptr() == self._device_seg.data_ptr()):
            self._device_seg.copy_(src[:a])
            self._counters.add("device", self.state, "write", a * es)
        self._host_seg.copy_(src[a:b])
        self._counters.add("host", self.state, "write", (b - a) * es)
        if b == n:
            return DONE
        self._counters.add("ssd", self.state, "write", self.ssd_bytes)
        if src.device.type == "cpu" and src[b:].data_ptr() % PAGE_BYTES == 0 and _storage_reaches(src[b:]):
            return _Joined([self._io.submit_write(self._fd, 0, padded_bytes(src[b:]))], keepalive=(src,))
        staging = aligned_empty(n - b, self.dtype, pin_memory=src.device.type == "cuda")
        staging.copy_(src[b:])  # a sync point on CUDA: the D2H copy must finish before the write starts
        return _Joined([self._io.submit_write(self._fd, 0, padded_bytes(staging))], keepalive=(staging,))

    def fetch(self, out: torch.Tensor) -> torch.Tensor:
        self.start_fetch(out).wait()
        return out

    def evict(self, src: torch.Tensor) -> None:
        self.start_evict(src).wait()

    def read_full(self) -> torch.Tensor:
        """A fresh CPU copy of the whole tensor (tests, consolidation)."""
        return self.fetch(self.new_buffer()).cpu()


class _StagedFetch(Ticket):
    def __init__(self, read: Ticket, staging: torch.Tensor, dst: torch.Tensor) -> None:
        super().__init__(read._futures)
        self._staging, self._dst = staging, dst

    def wait(self) -> None:
        super().wait()
        if self._staging is not None:
            self._dst.copy_(self._staging, non_blocking=True)
            self._staging = None


def _storage_reaches(t: torch.Tensor) -> bool:
    start = t.storage_offset() * t.element_size()
    return start + round_up(t.numel() * t.element_size()) <= t.untyped_storage().nbytes()
