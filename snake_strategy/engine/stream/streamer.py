"""The weight streamer: one unit's compute weights resident, the next ``prefetch_depth`` on their way.

A prefetch thread fetches upcoming units (in task order) into buffers of a bounded pool of
``1 + prefetch_depth`` unit-sized buffers while the current unit computes; before fetching a unit it
waits for that unit's pending forward-part optimizer step, so it never reads a stale weight. Weights do
not change during a step, so leaving a unit writes nothing back: the weight traffic is exactly
``schedule.weight_fetches``. Fully device-resident weights are used in place, with no buffer at all.

On CUDA the fetch goes through the copy stream (``storage/streams.py``): the host->device copies of a
unit run on their own stream, after the event the compute stream recorded when it last read the
buffer; the compute stream waits for the unit's copy event before its first kernel on those weights.
The host never waits for a copy here. The SSD share bounces through a bounded pool of pinned staging
buffers (2: one being read from the SSD while the other crosses PCIe). On CPU every event is complete
and the code path is the same.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from snake_strategy.engine.optimizer.worker import OptimizerOverlap
from snake_strategy.engine.state.stores import UnitStore
from snake_strategy.engine.trace import FetchRecord, TaskTrace
from snake_strategy.engine.optimizer.worker_threads import single_threaded_ops
from snake_strategy.schedule import Task, unit_run_ahead
from snake_strategy.planning.memory_model import WEIGHT_STAGING_BUFFERS
from snake_strategy.storage.pool import BufferPool
from snake_strategy.storage.streams import DONE, CopyStream, Event, copy_stream


class WeightStreamer:
    def __init__(self, units: list[UnitStore], overlap: OptimizerOverlap, trace: TaskTrace, prefetch_depth: int,
                 compute_dtype: torch.dtype, device: torch.device, copies: CopyStream | None = None) -> None:
        """``compute_dtype``: the dtype of the units' stored weight vectors (half under mixed precision)."""
        self._units, self._overlap, self._trace, self._depth = units, overlap, trace, prefetch_depth
        self._copies = copy_stream(device) if copies is None else copies
        in_place = all(u.weights.resident for u in units)
        # A buffer holds a unit's main weight vector and, with half-precision storage, its fp32 tail.
        self.pool = None if in_place else BufferPool(
            "weights", 1 + prefetch_depth, max(_buffer_numel(u) for u in units), compute_dtype, device, trace=trace)
        ssd_elems = max((u.weights.numel - u.weights.host_end for u in units), default=0)
        self.staging = None  # pinned SSD->device bounce buffers (CUDA only: on CPU the SSD reads land in place)
        if device.type == "cuda" and ssd_elems:
            self.staging = BufferPool("weight-staging", WEIGHT_STAGING_BUFFERS, ssd_elems, compute_dtype,
                                      torch.device("cpu"), pin_memory=True)
        # Its copies run on one intra-op thread, set for this thread only (engine/optimizer/worker_threads.py).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snake-prefetch",
                                          initializer=single_threaded_ops)
        self._prefetched: dict[int, tuple[Future, float]] = {}  # unit -> (job, issue time)
        self._resident: tuple[int, Tensor | None, list[Tensor]] | None = None  # (unit, pool buffer, leaves)
        self.wait_s = 0.0  # main-thread time blocked on weight fetches, since the last take

    # ------------------------------------------------------------------ fetching
    def _fetch(self, u: int) -> tuple[Tensor | None, tuple[Tensor, Tensor | None], float, float, Event]:
        """(pool buffer or None, the unit's (main weight vector, fp32 tail or None), start time,
        issue-complete time, the copy's event). Runs on either thread. On CUDA the done time is when the
        copies were issued, not when they land."""
        started_s = time.perf_counter()
        self._overlap.wait_forward_part(u)  # the deferred update of this unit must land first
        unit = self._units[u]
        weights = unit.weights
        # evaluation's units (EvalUnit) keep one vector in one dtype: no half-precision format, no tail
        fmt, tail = (unit.fmt, unit.tail) if isinstance(unit, UnitStore) else (None, None)
        if self.pool is None:  # in place: nothing copied
            parts = (weights.device_tensor(), tail.device_tensor() if tail is not None else None)
            return None, parts, started_s, time.perf_counter(), DONE
        # backpressure: blocks while resident + prefetched fill the pool
        buffer, reusable = self.pool.acquire_ordered()
        if weights.device_end:
            # A device share is written by the optimizer on the compute stream: copy after it.
            reusable = self._copies.record()
        staging = self.staging.acquire() if self.staging is not None and weights.host_end < weights.numel else None
        batch = None
        try:
            with self._copies.issuing(after=reusable) as batch:  # the H2D copies run on the copy stream
                if fmt is None:
                    parts = (weights.fetch(buffer[:weights.numel], staging=staging), None)
                else:
                    main, tail_out = fmt.split_buffer(buffer)
                    parts = (weights.fetch(main, staging=staging), tail.fetch(tail_out))
        except BaseException:
            self._copies.synchronize()  # nothing may still be copying into or out of the buffers
            self.pool.release(buffer)
            if staging is not None:
                self.staging.release(staging)
            raise
        if staging is not None:
            self.staging.release(staging, batch.event)  # rewritten by the next SSD read once the copy is over
        return buffer, parts, started_s, time.perf_counter(), batch.event

    def prefetch_after(self, tasks: list[Task], index: int) -> None:
        """Make sure the weights of the next ``prefetch_depth`` units after task ``index`` are on their way."""
        resident = tasks[index].unit
        for u in unit_run_ahead(tasks, index, self._depth):
            if u != resident and u not in self._prefetched and not self._units[u].weights.resident:
                self._prefetched[u] = (self._thread.submit(self._fetch, u), time.perf_counter())

    def leaves(self, u: int) -> list[Tensor]:
        """Unit ``u``'s compute weights, one grad-requiring leaf per parameter (fetched if needed)."""
        if self._resident is not None and self._resident[0] == u:
            return self._resident[2]
        self.release()  # first: at most one unit is held besides the prefetched ones
        needed_s = time.perf_counter()
        job = self._prefetched.pop(u, None)
        if job is not None:
            buffer, parts, started_s, done_s, copied = job[0].result()  # sync point when the prefetch is late
            issued_s = job[1]
        else:
            buffer, parts, started_s, done_s, copied = self._fetch(u)
            issued_s = needed_s
        self._copies.wait_event(copied)  # the compute stream (not the host) waits for the copy
        self.wait_s += time.perf_counter() - needed_s
        # The timeline draws the wait for a late prefetch from this record (needed_s -> done_s).
        self._trace.fetch(FetchRecord(u, job is not None, issued_s, done_s, needed_s, started_s))
        unit = self._units[u]
        leaves = unit.leaves(*parts) if isinstance(unit, UnitStore) else unit.layout.leaves(parts[0])
        self._resident = (u, buffer, leaves)
        return self._resident[2]

    def flat(self, u: int) -> Tensor:
        """Unit ``u``'s flat weights, read-only (evaluation): the resident buffer, fetched if needed."""
        self.leaves(u)
        buffer = self._resident[1]
        weights = self._units[u].weights
        return weights.device_tensor() if buffer is None else buffer[:weights.numel]

    def release(self) -> None:
        """Give the resident unit's buffer back to the pool."""
        if self._resident is not None:
            _, buffer, _ = self._resident
            self._resident = None
            if buffer is not None:
                # Rewritten only after every kernel issued so far (the ones that read it) has run.
                self.pool.release(buffer, self._copies.record())

    def drain(self) -> None:
        """Finish and release every prefetch in flight (end of a step, flush, close)."""
        self.release()
        jobs, self._prefetched = self._prefetched, {}
        first_error = None
        for job, _ in jobs.values():
            try:
                buffer, _, _, _, copied = job.result()
            except BaseException as err:
                first_error = first_error or err
                continue
            if buffer is not None:
                self.pool.release(buffer, copied)  # never read: free once its copy has landed
        if first_error is not None:
            raise first_error

    def set_prefetch_depth(self, depth: int) -> None:
        """Fetch ``depth`` units ahead from the next step on (a re-plan, planning/calibration.py): called between
        steps, when nothing is prefetched; the pool keeps ``1 + depth`` buffers."""
        assert not self._prefetched, "the prefetch depth changes between steps"
        self._depth = depth
        if self.pool is not None:
            self.pool.resize(1 + depth)

    def take_wait_s(self) -> tuple[float, float]:
        """(seconds blocked on fetches, of which waiting for a free buffer) since the last call."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait, self.pool.take_wait_s() if self.pool is not None else 0.0

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._thread.shutdown(wait=True)
            self._copies.synchronize()  # sync point (teardown): no copy may outlive the buffers it uses
            if self.pool is not None:
                self.pool.clear()
            if self.staging is not None:
                self.staging.clear()


def _buffer_numel(unit) -> int:
    """Elements of a working buffer for ``unit`` (a training UnitStore or evaluation's EvalUnit)."""
    return unit.buffer_numel if isinstance(unit, UnitStore) else unit.weights.numel
