"""Writing host tensors into a new file, durably and at the disk's rate: a checkpoint's written parts.

A save writes what is not already a file on the SSD tier: the non-layer vectors, the host-tier part of
the unit states, and (in a copy save) everything. Through the page cache these ran at 0.5-0.7 GB/s inside
a training process, against 1.2-1.5 GB/s for the same bytes with O_DIRECT (r1, the same benchmark):
a buffered write first copies into page-cache pages the training process
has to give back, and the fsync after it waits for every other dirty page of the filesystem.

So ``write_tensors`` stages the bytes in page-aligned buffers (a copy per byte, ~0.1 s/GB, on the caller's
thread), computes the CRC-32 of each staged chunk in file order (which the manifest needs anyway), and a
writer thread issues the O_DIRECT ``pwrite`` of one chunk while the next is staged. The last chunk is
padded to a page and the file truncated back to its size; the fsync then only has metadata to write.
Where the filesystem refuses O_DIRECT (tmpfs, some network filesystems) the same loop writes through the
page cache, and the result says which was used.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

from snake_strategy.storage.aligned import aligned_empty, round_up
from snake_strategy.storage.versions import direct_descriptor

CHUNK_BYTES = 16 * 2**20  # per pwrite: overwrites measured ~10% faster than 4 MiB (benchmarks/new_blocks.py)
BUFFERS = 3  # staging buffers: one being filled, up to two being written (48 MiB in all)


@dataclasses.dataclass(frozen=True)
class Written:
    bytes: int  # the file's size: the values' bytes, concatenated
    crc32: int  # of those bytes (zlib's)
    direct: bool  # O_DIRECT; False: through the page cache (the filesystem refused O_DIRECT)


class _Sink:
    """A new file: written through a second, O_DIRECT descriptor where the filesystem takes one
    (``versions.direct_descriptor``), else through the page cache."""

    def __init__(self, path: Path) -> None:
        self._buffered = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._direct = direct_descriptor(self._buffered, os.O_WRONLY)

    @property
    def direct(self) -> bool:
        return self._direct is not None

    def write(self, view: memoryview, offset: int) -> None:
        """All of ``view`` at ``offset`` (pwrite may write less than asked)."""
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self._direct if self.direct else self._buffered, view[done:], offset + done)
            except OSError as err:
                # A filesystem that opens with O_DIRECT but refuses the transfer: go on buffered.
                if not (self.direct and err.errno == errno.EINVAL):
                    raise
                os.close(self._direct)
                self._direct = None

    def finish(self, size_bytes: int) -> None:
        """Cut the padding of the last page off and make the file durable."""
        os.ftruncate(self._buffered, size_bytes)
        os.fsync(self._buffered)  # a sync point: after O_DIRECT only the size and extents are left to write

    def close(self) -> None:
        for fd in (self._direct, self._buffered):
            if fd is not None:
                os.close(fd)


def write_tensors(path: str | os.PathLike, values: Sequence[torch.Tensor]) -> Written:
    """Write the bytes of the CPU tensors ``values``, concatenated, into a new file at ``path``, and fsync
    it. The tensors are only read; the caller must not change them until this returns."""
    sources = [v.detach().contiguous().reshape(-1).view(torch.uint8) for v in values]
    staging = [aligned_empty(CHUNK_BYTES, torch.uint8) for _ in range(BUFFERS)]
    views = [memoryview(buffer.numpy()) for buffer in staging]
    free, in_flight = list(range(BUFFERS)), deque()
    crc = size = 0
    sink = _Sink(Path(path))
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="snake-write") as writer:
            def take() -> int:
                if not free:
                    future, j = in_flight.popleft()
                    future.result()  # a sync point: the oldest buffer is written, free again
                    free.append(j)
                return free.pop()

            def submit(k: int, length: int) -> None:
                nonlocal crc, size
                crc = zlib.crc32(views[k][:length], crc)  # releases the GIL: overlaps the write before
                padded = round_up(length) if sink.direct else length
                views[k][length:padded] = bytes(padded - length)  # the last chunk only: zeros, cut off later
                in_flight.append((writer.submit(sink.write, views[k][:padded], size), k))
                size += length

            k, fill = None, 0
            for src in sources:
                at = 0
                while at < src.numel():
                    if k is None:
                        k = take()
                    n = min(CHUNK_BYTES - fill, src.numel() - at)
                    staging[k][fill:fill + n].copy_(src[at:at + n])  # the copy; releases the GIL
                    fill, at = fill + n, at + n
                    if fill == CHUNK_BYTES:
                        submit(k, fill)
                        k, fill = None, 0
            if k is not None:
                submit(k, fill)
            while in_flight:
                in_flight.popleft()[0].result()
        sink.finish(size)
    finally:
        sink.close()
    return Written(bytes=size, crc32=crc, direct=sink.direct)
