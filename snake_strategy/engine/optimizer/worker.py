"""The optimizer-step overlap: the optimizer steps on a worker thread while the main thread computes.

Each unit's trainable elements [0, train_end) are cut at ``forward_end`` (about ``alpha`` of them, page-aligned);
frozen elements [train_end, n) are never stepped nor written:

- backward part [forward_end, train_end): stepped in the same iteration, on the worker, as soon as the unit's
  gradient is complete (the unit is not read again in this iteration);
- forward part [0, forward_end): its gradient waits in the gradient store; it is stepped during the next
  iteration's forward, before the unit's weights are fetched (``wait_forward_part``), with the
  hyper-parameters and step number snapshotted at the end of the iteration that produced it.

Every element is updated exactly once per iteration, with its full accumulated gradient, before it is
next read: the parameter sequence is the synchronous optimizer's (docs/design.md, "Why the overlap is
exact"). The arithmetic of a chunk is engine/optimizer/update.py's.

Under norm clipping and fp16 loss scaling (a ``RollbackStore`` is given, engine/optimizer/rollback.py) the backward
part is stepped speculatively, its raw gradient and pre-step state saved first ("speculate"), or only its
raw gradient is saved ("defer"); the end of the iteration then queues a redo (restore + step with the
true factor) or an apply (step with the true factor) of the backward part into the unit's next forward
job, or restores it at once (``restore``: a skipped fp16 step).
``flush`` applies pending forward parts before anything else reads weights (validation, checkpoints,
teardown).

Memory: the worker steps in chunks of ``storage.optimizer_chunk_elems`` (or of whole parameters, for optimizers
stepped per tensor) through a fixed scratch set, and gives each
complete gradient buffer back to its pool when done; the backward therefore waits (backpressure) when
the optimizer falls behind, instead of queueing gradients without bound.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from snake_strategy.engine.parallel.partition import shard_range
from snake_strategy.engine.optimizer.rollback import DEFER, GRAD, MASTER, REDO, RollbackStore
from snake_strategy.engine.state.stores import UnitStore
from snake_strategy.engine.trace import OPTIMIZER, WAIT, TaskTrace
from snake_strategy.engine.optimizer.worker_threads import single_threaded_ops
from snake_strategy.engine.optimizer.update import ChunkUpdate
from snake_strategy.optimizers.kind import scratch_elems
from snake_strategy.storage.io_engine import BACKGROUND, URGENT, set_thread_priority
from snake_strategy.storage.pool import BufferPool
from snake_strategy.storage.tiered import ALIGN_ELEMS


@dataclass
class _Deferred:
    hps: list[dict]
    step_before: int
    grad_scale: float | None  # unscale x global-norm clip coefficient, applied before the step (None: none)
    unused: dict[int, list[tuple[int, int]]]  # per unit: element ranges of parameters that got no gradient
    # per unit: the backward part still to step from the rollback store: REDO (from the saved pre-step
    # state: a speculation that was wrong) or APPLY (from the current state: a deferred-mode step)
    redo: dict[int, str] = field(default_factory=dict)
    submitted: dict[int, Future] = field(default_factory=dict)


class OptimizerOverlap:
    """Owns the optimizer worker thread and the bookkeeping of pending unit steps.

    ``before_chunk`` is a test hook called on the worker before each chunk's step (fault and delay
    injection through the public ``EngineHooks``); it must not touch engine state.
    """

    def __init__(self, units: list[UnitStore], update: ChunkUpdate, compute_dtype: torch.dtype,
                 master_dtype: torch.dtype, device: torch.device, chunk_elems: int,
                 before_chunk: Callable[[int], None] | None = None, trace: TaskTrace | None = None,
                 rollback: RollbackStore | None = None, gather: Callable[[int], None] | None = None) -> None:
        self._units, self._compute_dtype = units, compute_dtype
        self._update = update
        self._before_chunk = before_chunk
        self._trace = trace if trace is not None else TaskTrace()  # spans of the worker's parts and chunks
        # One intra-op thread: the step is memory-bound, and the compute thread's matmuls own the cores.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snake-optim", initializer=_worker_init)
        self._chunk_elems = chunk_elems
        # The worker's scratch: a chunk of master weights, of each state slot and a parked gradient (+ the
        # compute copy); frozen elements are never stepped.
        # (sized as the memory plan counts them: optimizers/kind.py, ``scratch_elems``)
        chunk, per_slot = scratch_elems(update.spec, [u.layout for u in units], [shard_range(u) for u in units],
                                        chunk_elems)
        sizes = {"master": (chunk, master_dtype), "grad": (chunk, master_dtype)}
        sizes.update({slot.name: (per_slot[slot.name], slot.dtype) for slot in update.spec.slots})
        if compute_dtype != master_dtype:
            sizes["compute"] = (chunk, compute_dtype)
        self._scratch = {name: BufferPool(f"optimizer-{name}", 1, n, dtype, device, trace=self._trace)
                         for name, (n, dtype) in sizes.items()}
        self._backward_jobs: dict[int, Future] = {}
        self._deferred: _Deferred | None = None
        # Parameters that received no gradient in this step (unused in forward): torch's AdamW skips a
        # parameter whose grad is None, so their values and moments are kept as they were.
        self.unused: dict[int, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()
        # Partitioned optimizer state: gather(u) all-gathers unit u's updated weights (engine/parallel/partition.py).
        self.gather = gather
        self.busy_s = 0.0  # worker time spent stepping, since the last reset
        self.skipped_state_bytes = 0  # master + optimizer state left unread and unwritten, since the last reset
        # The speculative step (engine/optimizer/rollback.py): given under norm clipping / fp16 scaling.
        self.rollback = rollback
        self._mode: str | None = None  # this iteration: SPECULATE, DEFER, or None (plain overlap)
        self._spec_scale: float | None = None  # the factor a speculative step assumes (the unscale only)
        self.speculated: set[int] = set()  # units whose backward part was stepped speculatively
        self.saved: set[int] = set()  # units whose backward part's raw gradient waits in the rollback store

    def begin_step(self, mode: str | None, spec_scale: float | None) -> None:
        """This iteration's backward parts: SPECULATE (stepped, assuming ``spec_scale``), DEFER (saved) or
        None (stepped, no global decision needed)."""
        assert mode is None or self.rollback is not None, "a speculative mode needs the rollback store"
        self._mode, self._spec_scale = mode, spec_scale
        self.speculated, self.saved = set(), set()

    # ------------------------------------------------------------------ backward parts
    def submit_backward_part(self, u: int, grad: torch.Tensor, release: Callable[[], None],
                             hps: list[dict], step_before: int,
                             prepare: Callable[[], None] | None = None) -> None:
        """Step unit ``u``'s backward part with the complete gradient ``grad`` (all n elements), park the
        forward part's gradient in the gradient store, then call ``release`` (the buffer goes back to its
        pool). ``grad`` must not be touched afterwards. ``prepare`` runs on the worker first (data parallel:
        wait for the cross-rank sum of ``grad``, then check and clip it)."""
        self._backward_jobs[u] = self._pool.submit(self._backward_job, u, grad, release, hps, step_before, prepare)

    def _backward_job(self, u: int, grad: torch.Tensor, release: Callable[[], None],
                      hps: list[dict], step_before: int, prepare: Callable[[], None] | None) -> None:
        unit = self._units[u]
        lo, hi = shard_range(unit)  # partitioned: ``grad`` is this rank's shard [lo, hi) only
        start_s = time.perf_counter()
        try:
            if prepare is not None:
                prepare()
                start_s = time.perf_counter()  # busy time excludes the wait for the other ranks
            park_end = min(unit.forward_end, hi)
            if park_end > lo:
                unit.grads.evict(grad[:park_end - lo], lo, park_end)
            start = max(unit.forward_end, lo)
            if self._mode is None or not self.rollback.holds(u):
                self._step_range(unit, start, hi, lambda a, b: grad[a - lo:b - lo], hps, step_before,
                                 None, self.unused.get(u, []))
            elif self._mode == DEFER:  # one write of the raw gradient; stepped at the next forward
                self.rollback.start_save(u, GRAD, grad[start - lo:hi - lo], start, hi).wait()
                self.saved.add(u)
            else:
                self.rollback.hold(u)  # before the first write: the step's writes start new versions
                self._step_range(unit, start, hi, lambda a, b: grad[a - lo:b - lo], hps, step_before,
                                 self._spec_scale, self.unused.get(u, []), snapshot=True)
                self.speculated.add(u)
        finally:
            release()
        self._add_busy(time.perf_counter() - start_s)
        if self._trace.enabled:
            self._trace.span(OPTIMIZER, f"backward part u{u}", start_s, unit=u, part="backward",
                             elements=unit.layout.numel - unit.forward_end)

    def wait_backward_parts(self) -> float:
        """Block until every backward part of this iteration is applied; returns the seconds waited."""
        start_s = time.perf_counter()
        jobs, self._backward_jobs = self._backward_jobs, {}
        for job in jobs.values():
            job.result()  # sync point: the step is not finished before these are
        end_s = time.perf_counter()
        if jobs and self._trace.enabled:
            self._trace.span(WAIT, "wait optimizer", start_s, end_s, units=sorted(jobs))
        return end_s - start_s

    # ------------------------------------------------------------------ forward parts
    def _has_forward_job(self, u: int, d: _Deferred | None = None) -> bool:
        # Partitioned state: every trainable unit's weights are gathered after its forward part.
        unit, d = self._units[u], d or self._deferred
        return bool(unit.forward_end) or (self.gather is not None and unit.train_end > 0) or (d is not None and u in d.redo)

    def defer_forward_parts(self, hps: list[dict], step_before: int, grad_scale: float | None,
                            redo: dict[int, str] | None = None) -> None:
        """Queue this iteration's forward parts (and the backward parts in ``redo``) for the next forward."""
        d = _Deferred(hps, step_before, grad_scale, dict(self.unused), dict(redo or {}))
        if self.rollback is not None:  # committed speculations: their pre-step states are not needed
            for u in self.speculated:
                if d.redo.get(u) != REDO:
                    self.rollback.release(u)
        if any(self._has_forward_job(u, d) for u in range(len(self._units))):
            self._deferred = d

    def restore(self, units: set[int]) -> None:
        """Put back the pre-step master weights and moments of these units' backward parts (a skipped step
        that was speculated), on the worker; blocks until done (a sync point, on overflowing steps only)."""
        jobs = [self._pool.submit(self._restore_job, u) for u in sorted(units)]
        for job in jobs:
            job.result()

    def _restore_job(self, u: int) -> None:
        unit = self._units[u]
        start_s = time.perf_counter()
        self._step_range(unit, self.rollback.starts[u], shard_range(unit)[1], None, [], 0, None, [],
                         source=True)
        self.rollback.release(u)
        self._add_busy(time.perf_counter() - start_s)

    def drop_forward_parts(self) -> None:
        """Forget the parked gradients (a skipped fp16 step): nothing is applied, and the backward parts
        stepped speculatively get their pre-step state back (``restore``)."""
        self._deferred = None
        self.restore(self.speculated)

    def submit_forward_parts(self) -> None:
        """Queue every pending forward part (the worker applies them in unit order, ahead of use)."""
        if self._deferred is not None:
            for u in range(len(self._units)):
                self._submit_forward_part(u)

    def _submit_forward_part(self, u: int) -> Future | None:
        d = self._deferred
        if d is None or not self._has_forward_job(u):
            return None
        if u not in d.submitted:
            d.submitted[u] = self._pool.submit(self._forward_job, u, d.hps, d.step_before, d.grad_scale,
                                               d.unused.get(u, []), d.redo.get(u))
        return d.submitted[u]

    def _forward_job(self, u: int, hps: list[dict], step_before: int, grad_scale: float | None,
                     unused: list[tuple[int, int]], redo: str | None) -> None:
        unit = self._units[u]
        start_s = time.perf_counter()
        # The unit's weights are fetched only after this update: its reads are what compute waits for.
        set_thread_priority(URGENT)
        grad_pool = self._scratch["grad"]
        buffer = grad_pool.acquire()

        def parked_grad(lo: int, hi: int) -> torch.Tensor:
            # Read back chunk by chunk into the scratch buffer: bounded memory however large the unit.
            return unit.grads.fetch(buffer[:hi - lo], lo, hi)

        lo, hi = shard_range(unit)
        try:
            try:
                self._step_range(unit, lo, min(unit.forward_end, hi), parked_grad, hps, step_before, grad_scale, unused)
                if redo is not None:
                    # The backward part, with the true factor: from its saved pre-step state (REDO, a wrong
                    # speculation) or from the current one (APPLY, a deferred-mode step); raw gradient saved.
                    def saved_grad(a: int, b: int) -> torch.Tensor:
                        return self.rollback.fetch(u, GRAD, buffer, a, b)

                    self._step_range(unit, self.rollback.starts[u], hi, saved_grad, hps, step_before, grad_scale,
                                     unused, source=redo == REDO)
                    self.rollback.release(u)
            finally:
                grad_pool.release(buffer)
            if self.gather is not None:
                self.gather(u)  # partitioned: every rank's updated shard of the unit, before anyone reads it
        finally:
            set_thread_priority(BACKGROUND)
        self._add_busy(time.perf_counter() - start_s)
        if self._trace.enabled:
            self._trace.span(OPTIMIZER, f"forward part u{u}", start_s, unit=u, part="forward", elements=unit.forward_end)

    def wait_forward_part(self, u: int) -> None:
        """Block until unit ``u``'s forward part is applied (called before its weights are read)."""
        job = self._submit_forward_part(u)
        if job is not None:
            # Timed only when it blocks: a part already applied is no wait.
            start_s = time.perf_counter() if self._trace.enabled and not job.done() else None
            job.result()
            if start_s is not None:
                self._trace.span(WAIT, f"wait forward part u{u}", start_s, unit=u)

    def end_forward_parts(self) -> None:
        """All forward parts of the pending iteration have been waited on; forget them."""
        if self._deferred is not None and len(self._deferred.submitted) == sum(
                self._has_forward_job(u) for u in range(len(self._units))):
            for job in self._deferred.submitted.values():
                job.result()
            self._deferred = None

    def flush(self) -> None:
        """Apply every pending update now (before validation, checkpoint save, teardown)."""
        self.wait_backward_parts()
        if self._deferred is not None:
            for u in range(len(self._units)):
                self.wait_forward_part(u)
            self._deferred = None

    # ------------------------------------------------------------------ the chunks
    def _step_range(self, unit: UnitStore, lo: int, hi: int, grad_of: Callable[[int, int], torch.Tensor] | None,
                    hps: list[dict], step_before: int, grad_scale: float | None,
                    unused: list[tuple[int, int]], source: bool = False, snapshot: bool = False) -> None:
        """Step elements [lo, hi) of a unit, chunk by chunk (``grad_of(a, b)``: the gradient of elements
        [a, b) of the unit, a buffer the step may scale in place; None: no step, only put back the saved
        state). ``source``: the master weights and optimizer state start from the rollback store's saved
        pre-step values, not the tiers. ``snapshot``: save the raw gradient and the pre-step state first."""
        u = unit.layout.index
        # A parameter that sat the step out keeps its state where it is: never read, never written (a
        # rollback's snapshot and restore cover whole ranges, so they step everything, keeping it unchanged).
        skipped = [] if source or snapshot or grad_of is None else self._skippable(unit, lo, hi, unused)
        saving: list = []  # raw-gradient saves still writing: the gradient buffer is only read meanwhile
        try:
            for start, end in self._update.chunks(unit, lo, hi, self._chunk_elems):
                for a, b in _without(start, end, skipped):
                    self._step_piece(unit, a, b, grad_of, hps, step_before, grad_scale, unused, snapshot, saving,
                                     source)
        finally:
            for ticket in saving:
                ticket.wait()  # before the caller gives the gradient buffer back
        for a, b in skipped:
            self._update.sit_out(unit, a, b, step_before)
        if skipped:
            stores = [("master", unit.master), *unit.state.items()]
            nbytes = sum(_span(unit.slot_range(name, a, b) if name != "master" else (a, b)) * t.elem_bytes
                         for a, b in skipped for name, t in stores)
            with self._lock:
                self.skipped_state_bytes += nbytes

    def _step_piece(self, unit: UnitStore, start: int, end: int, grad_of: Callable[[int, int], torch.Tensor] | None,
                    hps: list[dict], step_before: int, grad_scale: float | None, unused: list[tuple[int, int]],
                    snapshot: bool, saving: list, source: bool) -> None:
        u = unit.layout.index
        chunk_s = time.perf_counter() if self._trace.enabled else 0.0
        if self._before_chunk is not None:
            self._before_chunk(u)
        grad = grad_of(start, end) if grad_of is not None else None
        if snapshot:  # the step may redo from it
            ticket = self.rollback.start_save(u, GRAD, grad, start, end)
            if grad_scale is not None:
                ticket.wait()  # before the in-place scaling below
            else:
                saving.append(ticket)  # the optimizer only reads the gradient: the write overlaps the step
        if grad is not None and grad_scale is not None:
            grad.mul_(grad_scale)  # as torch.nn.utils.clip_grad_norm_ does, even when the factor is 1
        keep = [(max(a, start), min(b, end)) for a, b in unused if max(a, start) < min(b, end)]
        self._step_chunk(unit, start, end, grad, hps, step_before, keep, source, snapshot)
        if self._trace.enabled:
            self._trace.span(OPTIMIZER, f"chunk u{u}", chunk_s, unit=u, elements=end - start, offset=start)

    def _skippable(self, unit: UnitStore, lo: int, hi: int, unused: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The element ranges of [lo, hi) the step leaves alone: runs of parameters without a gradient, with
        the page padding after each; where a unit's state reaches the SSD, whose transfers start and end on
        ``ALIGN_ELEMS`` boundaries, as the optimizer's kind cuts them to those (``StepKind.skippable``)."""
        if not unused:
            return []
        slots = unit.layout.trainable_slots
        ends = {s.offset: (slots[i + 1].offset if i + 1 < len(slots) else unit.train_end) for i, s in enumerate(slots)}
        runs: list[tuple[int, int]] = []
        for a, _ in sorted(unused):
            a, b = max(a, lo), min(ends[a], hi)
            if a >= b:
                continue
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b)
            else:
                runs.append((a, b))
        if not any(t.ssd_file is not None for t in [unit.master, *unit.state.values()]):
            return runs
        return self._update.spec.kind.skippable(runs, lo, hi, ALIGN_ELEMS)

    def _step_chunk(self, unit: UnitStore, lo: int, hi: int, grad: torch.Tensor | None,
                    hps: list[dict], step_before: int, keep: list[tuple[int, int]],
                    source: bool = False, snapshot: bool = False) -> None:
        scratch = {name: pool.acquire() for name, pool in self._scratch.items() if name != "grad"}
        u = unit.layout.index
        # Every stored state of the chunk, with its range in its own index space (a per-tensor slot's pieces).
        stores = {MASTER: (unit.master, lo, hi),
                  **{name: (t, *unit.slot_range(name, lo, hi)) for name, t in unit.state.items()}}
        try:
            with torch.no_grad():
                if source:  # the saved pre-step values (a rollback)
                    values = {name: self.rollback.fetch(u, name, scratch[name], a, b) for name, (_, a, b) in stores.items()}
                else:
                    values = {name: _acquire(t, scratch[name], a, b) for name, (t, a, b) in stores.items()}
                if snapshot:  # waited: a device-resident state is stepped in place right below
                    for ticket in [self.rollback.start_save(u, name, values[name], a, b)
                                   for name, (_, a, b) in stores.items()]:
                        ticket.wait()
                if grad is not None:
                    self._update.apply(unit, lo, hi, values[MASTER], {n: v for n, v in values.items() if n != MASTER},
                                       grad, hps, step_before, keep)
                resident = not source  # fetched from the tiers: a resident state was stepped in place
                tickets = [t.start_evict(values[name], a, b) for name, (t, a, b) in stores.items()
                           if not (t.resident and resident)]
                if unit.weights is not unit.master:
                    tickets += unit.start_refresh(values[MASTER], lo, hi, scratch["compute"])
                for ticket in tickets:
                    ticket.wait()  # the scratch is reused by the next chunk: the writes must be done
        finally:
            for name, buffer in scratch.items():
                self._scratch[name].release(buffer)

    def _add_busy(self, seconds: float) -> None:
        with self._lock:
            self.busy_s += seconds

    def take_busy_s(self) -> float:
        with self._lock:
            busy, self.busy_s = self.busy_s, 0.0
        return busy

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the worker's scratch set (one buffer per pool: master, gradient, each slot, compute copy), as
        the memory plan counts them (without the allocator's page slack)."""
        return sum(pool.capacity * pool.numel * pool.dtype.itemsize for pool in self._scratch.values())

    def take_skipped_state_bytes(self) -> int:
        with self._lock:
            skipped, self.skipped_state_bytes = self.skipped_state_bytes, 0
        return skipped

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.rollback is not None:
            self.rollback.release_all()
        self._backward_jobs, self._deferred = {}, None
        for pool in self._scratch.values():
            pool.clear()


def _worker_init() -> None:
    # One intra-op thread for the worker's chunks, set for this thread only (engine/optimizer/worker_threads.py).
    single_threaded_ops()
    # Backward parts are waited for only at the end of the step: reads of weights and checkpoints go first.
    set_thread_priority(BACKGROUND)


def _span(r: tuple[int, int]) -> int:
    return r[1] - r[0]


def _without(lo: int, hi: int, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) minus the sorted, disjoint ``holes``, as ranges in order."""
    out, at = [], lo
    for a, b in holes:
        a, b = max(a, lo), min(b, hi)
        if a < b:
            if at < a:
                out.append((at, a))
            at = b
    if at < hi:
        out.append((at, hi))
    return out


def _acquire(t, scratch: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of ``t``: in place when device-resident, else fetched into the scratch buffer."""
    if t.resident:
        return t.device_tensor()[lo:hi]
    return t.fetch(scratch[:hi - lo], lo, hi)
