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

from dataclasses import dataclass

import torch

from snake_strategy.storage.aligned import PAGE_BYTES, aligned_empty, padded_bytes, round_up
from snake_strategy.storage.counters import TrafficCounters
from snake_strategy.storage.io_engine import DONE, IOEngine, Ticket
from snake_strategy.storage.ssd_directory import SsdDirectory
from snake_strategy.storage.versions import VersionedFile
from snake_strategy.config import StorageConfig, TierShares

# Range boundaries (the SSD segment's start, the forward/backward split of a unit) are multiples of
# this many elements: a whole number of pages for every dtype of 1 to 8 bytes.
ALIGN_ELEMS = PAGE_BYTES


def tier_bounds(numel: int, split: TierShares) -> tuple[int, int]:
    """(device_end, host_end) of a tensor of ``numel`` elements split over the tiers as ``split`` says.

    The SSD segment starts on a page boundary (it may take a few more elements than its share), so a
    page-aligned working buffer's SSD part is itself page-aligned."""
    device_end = min(numel, round(split.device * numel))
    host_end = min(numel, device_end + round(split.host * numel))
    if host_end < numel:
        host_end = (host_end // ALIGN_ELEMS) * ALIGN_ELEMS
        host_end = max(host_end, (device_end // ALIGN_ELEMS) * ALIGN_ELEMS)
        device_end = min(device_end, host_end)
    return device_end, host_end


def tier_bytes(numel: int, split: TierShares, elem_bytes: int, lo: int = 0, hi: int | None = None) -> dict[str, int]:
    """Bytes a transfer of elements [lo, hi) moves on each tier (the SSD part page-rounded, as the engine
    counts it): the traffic model's unit of account."""
    hi = numel if hi is None else hi
    device_end, host_end = tier_bounds(numel, split)

    def span(a: int, b: int) -> int:
        return max(0, min(hi, b) - max(lo, a))

    return {"device": span(0, device_end) * elem_bytes, "host": span(device_end, host_end) * elem_bytes,
            "ssd": round_up(span(host_end, numel) * elem_bytes)}


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
        split: TierShares,
        device: torch.device,
        counters: TrafficCounters,
        io: IOEngine | None = None,
        ssd: SsdDirectory | None = None,
    ) -> None:
        self.name, self.state, self.numel, self.dtype, self.device = name, state, numel, dtype, device
        self.elem_bytes = torch.empty((), dtype=dtype).element_size()
        self._counters, self._io = counters, io
        self.device_end, self.host_end = tier_bounds(numel, split)
        pin = device.type == "cuda"
        self._device_seg = torch.empty(self.device_end, dtype=dtype, device=device)
        self._host_seg = aligned_empty(self.host_end - self.device_end, dtype, pin_memory=pin)
        self.ssd_file: VersionedFile | None = None  # the SSD segment; checkpoints pin its versions
        ssd_numel = numel - self.host_end
        self.ssd_bytes = round_up(ssd_numel * self.elem_bytes) if ssd_numel else 0
        if ssd_numel:
            if ssd is None or io is None:
                raise AssertionError("an SSD share needs an SsdDirectory and an IOEngine")
            self.ssd_file = ssd.open_versioned(f"{state}/{name}.bin", self.ssd_bytes)
            self.ssd_path = f"{ssd.path}/{state}/{name}.bin"  # no such name in a temporary ssd_dir (anonymous)

    @property
    def resident(self) -> bool:
        """True when every element lives on the device: use ``device_tensor()`` in place."""
        return self.device_end == self.numel

    def device_tensor(self) -> torch.Tensor:
        if not self.resident:
            raise AssertionError(f"{self.name} is not fully device-resident")
        return self._device_seg

    def new_buffer(self, numel: int | None = None) -> torch.Tensor:
        """A working buffer (of ``numel`` elements, default all) to fetch into; page-aligned on CPU."""
        numel = self.numel if numel is None else numel
        if self.device.type == "cpu":
            return aligned_empty(numel, self.dtype)
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def read_copy(self, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) as a fresh CPU copy (blocking; for checkpoints and export)."""
        if hi == lo:
            return torch.empty(0, dtype=self.dtype)
        return self.fetch(self.new_buffer(hi - lo), lo, hi).cpu()

    def acquire(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) on the device: the resident storage itself when fully device-resident
        (in place, no copy), else a fresh buffer fetched from the tiers (blocking)."""
        hi = self.numel if hi is None else hi
        if self.resident:
            return self._device_seg[lo:hi]
        return self.fetch(self.new_buffer(hi - lo), lo, hi)

    def start_fetch(self, out: torch.Tensor, lo: int = 0, hi: int | None = None,
                    staging: torch.Tensor | None = None) -> Ticket:
        """Begin filling ``out`` with elements [lo, hi); the SSD part runs on the I/O threads.

        ``lo`` and ``hi`` must be multiples of ``ALIGN_ELEMS`` (or ``hi == numel``) so the SSD part
        stays page-aligned; ``out`` must be page-aligned on CPU (``new_buffer`` or ``aligned_empty``).
        ``staging`` (CUDA only): a pinned, page-aligned buffer of at least the SSD part's elements from
        a bounded pool, for the SSD->host->device bounce (else one is allocated per fetch).
        The host->device copies are issued on the calling thread's current stream (the copy stream
        when called inside ``CopyStream.issuing``).
        """
        hi = self.numel if hi is None else hi
        segments = self._segments(lo, hi)
        (d0, d1), (h0, h1), (s0, s1) = segments
        es = self.elem_bytes
        out[d0 - lo:d1 - lo].copy_(self._device_seg[d0:d1])
        self._counters.add("device", self.state, "read", (d1 - d0) * es)
        out[h0 - lo:h1 - lo].copy_(self._host_seg[h0 - self.device_end:h1 - self.device_end], non_blocking=True)
        self._counters.add("host", self.state, "read", (h1 - h0) * es)
        if s1 == s0:
            return DONE
        offset = (s0 - self.host_end) * es
        dst = out[s0 - lo:s1 - lo]
        self._counters.add("ssd", self.state, "read", round_up((s1 - s0) * es))
        if out.device.type == "cpu":
            return self._read(offset, padded_bytes(dst))
        # CUDA: the SSD part lands in a pinned bounce buffer, then crosses the host link; that copy
        # is issued inside wait(), after the read completes (see _StagedFetch).
        if staging is None:
            staging = aligned_empty(s1 - s0, self.dtype, pin_memory=True)
        staging = staging[:s1 - s0]
        return _StagedFetch(self._read(offset, padded_bytes(staging)), staging, dst)

    def _read(self, offset: int, buffer: torch.Tensor, held: bool = False) -> Ticket:
        # One read, or one per piece while a new version is partly written (storage/versions.py).
        pieces = (self.ssd_file.held_pieces if held else self.ssd_file.read_pieces)(offset, buffer.numel())
        tickets = [self._io.submit_read(fd, at, buffer[start:start + length], self.state)
                   for fd, at, start, length in pieces]
        ticket = tickets[0] if len(tickets) == 1 else _Joined(tickets)
        self.ssd_file.track(ticket)  # a previous version stays open until its reads are done
        return ticket

    def _write(self, offset: int, buffer: torch.Tensor) -> Ticket:
        fd = self.ssd_file.fd_for_write(offset, buffer.numel())  # a new version when a checkpoint holds this one
        ticket = self._io.submit_write(fd, offset, buffer, self.state)
        self.ssd_file.track(ticket)  # a pin waits for it
        return ticket

    # ------------------------------------------------------------------ rollback holds (engine/optimizer/rollback.py)
    def hold(self, lo: int, hi: int) -> None:
        """Keep the SSD part of elements [lo, hi) readable as it is now (``fetch_held``) while updates go
        on: they go to a new version of the file (storage/versions.py), nothing is copied. The device and
        host parts are updated in place: a caller that needs them keeps its own copy."""
        (_, _), (_, _), (s0, s1) = self._segments(lo, hi)
        if s1 > s0:
            self.ssd_file.hold((s0 - self.host_end) * self.elem_bytes, round_up((s1 - s0) * self.elem_bytes))

    def fetch_held(self, out: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi), all in the SSD part and held, as they were at ``hold`` (blocking)."""
        (_, _), (h0, h1), (s0, s1) = self._segments(lo, hi)
        assert s0 == lo and s1 == hi, f"[{lo}, {hi}) is not all on the SSD (from {self.host_end})"
        if s1 == s0:
            return out
        self._counters.add("ssd", self.state, "read", round_up((s1 - s0) * self.elem_bytes))
        if out.device.type == "cpu":
            self._read((s0 - self.host_end) * self.elem_bytes, padded_bytes(out[:s1 - s0]), held=True).wait()
            return out
        staging = aligned_empty(s1 - s0, self.dtype, pin_memory=True)
        _StagedFetch(self._read((s0 - self.host_end) * self.elem_bytes, padded_bytes(staging), held=True),
                     staging, out[:s1 - s0]).wait()
        return out

    def release_hold(self) -> None:
        if self.ssd_file is not None and self.ssd_file.holding:
            self.ssd_file.release_hold()

    def start_evict(self, src: torch.Tensor, lo: int = 0, hi: int | None = None) -> Ticket:
        """Begin writing ``src`` (elements [lo, hi)) back; ``src`` must stay untouched until the ticket
        is waited on (the ticket keeps it alive)."""
        hi = self.numel if hi is None else hi
        (d0, d1), (h0, h1), (s0, s1) = self._segments(lo, hi)
        es = self.elem_bytes
        dev_dst = self._device_seg[d0:d1]
        dev_src = src[d0 - lo:d1 - lo]
        if dev_dst.numel() and dev_src.data_ptr() != dev_dst.data_ptr():
            dev_dst.copy_(dev_src)
            self._counters.add("device", self.state, "write", (d1 - d0) * es)
        self._host_seg[h0 - self.device_end:h1 - self.device_end].copy_(src[h0 - lo:h1 - lo])
        self._counters.add("host", self.state, "write", (h1 - h0) * es)
        if s1 == s0:
            return DONE
        offset = (s0 - self.host_end) * es
        part = src[s0 - lo:s1 - lo]
        self._counters.add("ssd", self.state, "write", round_up((s1 - s0) * es))
        if part.device.type == "cpu" and part.data_ptr() % PAGE_BYTES == 0 and _storage_reaches(part):
            return _Joined([self._write(offset, padded_bytes(part))], keepalive=(src,))
        staging = aligned_empty(s1 - s0, self.dtype, pin_memory=part.device.type == "cuda")
        staging.copy_(part)  # a sync point on CUDA: the D2H copy must finish before the write starts
        write = self._write(offset, padded_bytes(staging))
        return _Joined([write], keepalive=(staging,))

    def _segments(self, lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """[lo, hi) cut at the tier boundaries: (device range, host range, ssd range) in element indices."""
        if not (0 <= lo <= hi <= self.numel):
            raise AssertionError(f"range [{lo}, {hi}) outside [0, {self.numel})")
        if (lo % ALIGN_ELEMS or (hi % ALIGN_ELEMS and hi != self.numel)) and hi > self.host_end:
            raise AssertionError(f"SSD ranges must be aligned to {ALIGN_ELEMS} elements: [{lo}, {hi})")

        def cut(a: int, b: int) -> tuple[int, int]:
            x, y = max(lo, a), min(hi, b)
            return (x, y) if x < y else (x, x)

        return cut(0, self.device_end), cut(self.device_end, self.host_end), cut(self.host_end, self.numel)

    def fetch(self, out: torch.Tensor, lo: int = 0, hi: int | None = None,
              staging: torch.Tensor | None = None) -> torch.Tensor:
        self.start_fetch(out, lo, hi, staging).wait()
        return out

    def evict(self, src: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        self.start_evict(src, lo, hi).wait()

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


@dataclass(frozen=True)
class Tiers:
    """What every tiered tensor of one engine shares: the placement, the device, the byte counters, the I/O
    engine and the SSD directory (None when nothing is on the SSD)."""

    storage: StorageConfig
    device: torch.device
    counters: TrafficCounters
    io: IOEngine | None
    ssd: SsdDirectory | None

    def tensor(self, name: str, state: str, numel: int, dtype: torch.dtype,
               split: TierShares | None = None) -> TieredTensor:
        """A tiered tensor of ``state`` ("weights", "master", "exp_avg", ...), split as the placement says
        (the moments follow ``storage.optimizer``) unless ``split`` is given."""
        if split is None:
            split = getattr(self.storage, "optimizer" if state in ("exp_avg", "exp_avg_sq") else state)
        return TieredTensor(name, state, numel, dtype, split, self.device, self.counters, self.io, self.ssd)
