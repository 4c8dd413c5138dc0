"""The SSD tier's transfers: a pure-Python asynchronous I/O engine (the files: storage/ssd_directory.py).

Worker threads issue ``os.preadv``/``os.pwritev`` on files opened with O_DIRECT; both calls release
the GIL, so plain threads keep the disk busy while the main thread computes. Requests are split into
chunks so several threads work on one large transfer at once (a single O_DIRECT stream does not
reach this class of disk's bandwidth).

Priorities: the chunks wait in one priority queue, so a read that compute waits for overtakes queued
optimizer-state traffic instead of queueing behind a unit's worth of it. A transfer's priority is the
submitting thread's (``set_thread_priority``): reads of the main and prefetch threads (the next unit's
weights, the next activation checkpoints) are ``URGENT``; their writes (checkpoints) ``NORMAL``; the
optimizer worker's reads and writes (master, moments, parked gradients, refreshed weights) ``BACKGROUND``,
except while it steps a unit's deferred forward part, which the fetch of that unit's weights waits for
(reads ``URGENT``, writes ``NORMAL``).
A chunk already on the disk is not interrupted: an urgent read waits for at most ``num_threads`` chunks.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future

import torch

from snake_strategy.storage.aligned import PAGE_BYTES

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 2**20
# Transfer priorities, lowest first (see the module docstring).
URGENT, NORMAL, BACKGROUND = 0, 1, 2
_thread_state = threading.local()


def set_thread_priority(priority: int) -> None:
    """The priority of the SSD transfers this thread submits from now on (``URGENT`` by default; reads of
    an ``URGENT`` thread stay urgent, its writes are ``NORMAL``)."""
    _thread_state.priority = priority


def thread_priority() -> int:
    return getattr(_thread_state, "priority", URGENT)


class Ticket:
    """A handle on one submitted transfer; ``wait()`` blocks until every chunk is done (a sync point)."""

    def __init__(self, futures: list[Future]) -> None:
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        for future in self._futures:
            future.result()  # re-raises the worker's OSError here, in the caller's thread


DONE = Ticket([])


class IOEngine:
    """Submit page-aligned reads and writes; get a Ticket back. Shut down with ``close()``."""

    def __init__(self, num_threads: int = 2, chunk_bytes: int = CHUNK_BYTES, before_transfer=None,
                 trace=None) -> None:
        """``before_transfer(direction, num_bytes)``, when given, runs on the I/O thread before each chunk:
        a test hook that slows the SSD down deterministically (see ``engine.EngineHooks``).

        ``trace``: the engine's ``TaskTrace`` (duck-typed: storage does not import the engine); while it is
        enabled, every chunk is recorded as a span on the I/O thread that moved it."""
        if chunk_bytes % PAGE_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a multiple of {PAGE_BYTES}")
        self._chunk_bytes = chunk_bytes
        self._before_transfer = before_transfer
        self._trace = trace
        # (priority, submission order, job): FIFO within a priority; None as the job stops a worker.
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._moving = 0  # chunks an I/O thread is transferring now (``idle``)
        self._moving_lock = threading.Lock()
        # Seconds during which at least one chunk was moving: the disk's busy time, which the planner's
        # SSD term is calibrated against (``take_busy_s``). Overlapping chunks count once.
        self._busy_s = 0.0
        self._busy_since = 0.0
        self._threads = [threading.Thread(target=self._work, name=f"snake-io_{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()
        self._closed = False

    def submit_read(self, fd: int, offset: int, buffer: torch.Tensor, what: str = "") -> Ticket:
        """Fill the uint8 CPU tensor ``buffer`` from ``fd`` at byte ``offset`` (``what``: the state, for
        the timeline)."""
        return self._submit(_read_exact, fd, offset, buffer, "read", what, thread_priority())

    def submit_write(self, fd: int, offset: int, buffer: torch.Tensor, what: str = "") -> Ticket:
        """Write the uint8 CPU tensor ``buffer`` to ``fd`` at byte ``offset``."""
        return self._submit(_write_exact, fd, offset, buffer, "write", what, max(NORMAL, thread_priority()))

    def _submit(self, fn, fd: int, offset: int, buffer: torch.Tensor, direction: str, what: str,
                priority: int) -> Ticket:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise AssertionError("I/O buffers are 1-D uint8 views")
        if self._closed:
            raise RuntimeError("the I/O engine is closed")
        futures = []
        for start in range(0, buffer.numel(), self._chunk_bytes):
            piece = buffer[start:start + self._chunk_bytes]
            future: Future = Future()
            self._queue.put((priority, next(self._order),
                             (future, fn, direction, fd, offset + start, piece, what, priority)))
            futures.append(future)
        return Ticket(futures)

    def _work(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            future, *transfer = job
            if not future.set_running_or_notify_cancel():
                continue
            with self._moving_lock:
                if self._moving == 0:
                    self._busy_since = time.perf_counter()
                self._moving += 1
            try:
                self._transfer(*transfer)
            except BaseException as err:  # handed to whoever waits on the ticket
                future.set_exception(err)
            else:
                future.set_result(None)
            finally:
                with self._moving_lock:
                    self._moving -= 1
                    if self._moving == 0:
                        self._busy_s += time.perf_counter() - self._busy_since

    def _transfer(self, fn, direction: str, fd: int, offset: int, piece: torch.Tensor, what: str,
                  priority: int) -> None:
        trace = self._trace
        start_s = time.perf_counter() if trace is not None and trace.enabled else None
        if self._before_transfer is not None:
            self._before_transfer(direction, piece.numel())  # a slowed-down SSD: part of the chunk's time
        fn(fd, offset, piece)
        if start_s is not None:
            trace.span("io", f"ssd {direction} {what}".rstrip(), start_s, direction=direction, state=what,
                       bytes=piece.numel(), priority=priority)

    def take_busy_s(self) -> float:
        """Seconds the disk was busy (any chunk moving) since the last call, the running stretch included."""
        with self._moving_lock:
            now = time.perf_counter()
            busy = self._busy_s + (now - self._busy_since if self._moving else 0.0)
            self._busy_s = 0.0
            if self._moving:
                self._busy_since = now
        return busy

    def idle(self) -> bool:
        """Whether no transfer is queued or moving right now: the disk is free for work that must not slow
        training down (the checkpoints' background checksums, checkpoint/pins.py)."""
        with self._moving_lock:
            return self._moving == 0 and self._queue.empty()

    def close(self) -> None:
        """Finish every queued transfer, then stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put((BACKGROUND + 1, next(self._order), None))  # after every queued transfer
        for thread in self._threads:
            thread.join()


class ShortReadError(OSError):
    """A state file ended before the bytes its layout places there: the file is short, the disk is fine."""


def _read_exact(fd: int, offset: int, buffer: torch.Tensor) -> None:
    try:
        _read_loop(fd, offset, buffer)
    except OSError as err:
        raise _explained(err, "read", fd, offset, buffer.numel()) from err


def _write_exact(fd: int, offset: int, buffer: torch.Tensor) -> None:
    try:
        _write_loop(fd, offset, buffer)
    except OSError as err:
        raise _explained(err, "write", fd, offset, buffer.numel()) from err


def _explained(err: OSError, op: str, fd: int, offset: int, num_bytes: int) -> OSError:
    """The same errno, with the file, the transfer and what to do (ENOSPC, EIO, ...)."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        path = f"fd {fd}"
    if isinstance(err, ShortReadError):
        hint = ("the file is shorter than this run's layout says: something outside this run truncated or "
                "replaced it (give every run its own storage.ssd_dir); resume from the last checkpoint")
    else:
        hint = {errno.ENOSPC: "the SSD tier is full: free space in storage.ssd_dir or point it at a larger disk",
                errno.EIO: "the disk reported an I/O error: check the device (dmesg) before resuming from the "
                           "last checkpoint"}.get(err.errno, "check storage.ssd_dir")
    return OSError(err.errno, f"SSD tier {op} of {num_bytes} bytes at offset {offset} in {path} failed: "
                              f"{err.strerror}; {hint}")


def _read_loop(fd: int, offset: int, buffer: torch.Tensor) -> None:
    view = memoryview(buffer.numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ShortReadError(errno.EIO, f"short read: file ends {len(view) - done} bytes early at offset "
                                            f"{offset + done}")
        done += got


def _write_loop(fd: int, offset: int, buffer: torch.Tensor) -> None:
    view = memoryview(buffer.numpy())
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)
