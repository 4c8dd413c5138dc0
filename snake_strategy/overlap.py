"""The optimizer-step overlap (greedysnake.md section 5): AdamW runs on a worker thread while the main
thread computes.

Each unit's flat vector is cut at ``split`` (about ``alpha`` of its elements, page-aligned):

- backward part [split, n): stepped in the same iteration, on the worker, as soon as the unit's
  gradient is complete (the unit is not read again in this iteration);
- forward part [0, split): its gradient waits in the gradient store; it is stepped during the next
  iteration's forward, before the unit's weights are fetched (``wait_forward_part``), with the
  hyper-parameters and step number snapshotted at the end of the iteration that produced it.

Every element is updated exactly once per iteration, with its full accumulated gradient, before it is
next read: the parameter sequence is synchronous AdamW. ``flush`` applies pending forward parts before
anything else reads weights (validation, checkpoints, teardown).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from snake_strategy.optim import AdamHyperParams, adam_step
from snake_strategy.storage import TieredTensor
from snake_strategy.storage.tiered import ALIGN_ELEMS
from snake_strategy.units import UnitLayout


# The optimizer worker steps a unit in chunks of this many elements (a multiple of ALIGN_ELEMS): its
# working memory is 3 x 4 bytes x this, about 400 MB, whatever the unit size.
STEP_CHUNK_ELEMS = 8192 * ALIGN_ELEMS


@dataclass
class UnitStore:
    """Every offloaded state of one unit."""

    layout: UnitLayout
    weights: TieredTensor
    master: TieredTensor  # the same object as ``weights`` when the compute dtype is the master dtype
    exp_avg: TieredTensor
    exp_avg_sq: TieredTensor
    grads: TieredTensor
    split: int  # forward part = [0, split), backward part = [split, numel)


def forward_split(numel: int, alpha: float) -> int:
    """The page-aligned end of the forward part for a unit of ``numel`` elements (all of it for alpha >= 1,
    which exact norm clipping uses: every update waits until the global gradient norm is known)."""
    if alpha >= 1.0:
        return numel
    split = round(alpha * numel / ALIGN_ELEMS) * ALIGN_ELEMS
    return max(0, min(split, numel))


@dataclass
class _Deferred:
    hps: list[AdamHyperParams]
    step_before: int
    grad_scale: float | None  # the global-norm clip coefficient, applied before the step (None: no clipping)
    submitted: dict[int, Future] = field(default_factory=dict)


class OptimizerOverlap:
    """Owns the optimizer worker thread and the bookkeeping of pending unit steps."""

    def __init__(self, units: list[UnitStore], compute_dtype: torch.dtype) -> None:
        self._units, self._compute_dtype = units, compute_dtype
        # One intra-op thread: AdamW is memory-bound, and the compute thread's matmuls own the cores.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snake-optim",
                                        initializer=torch.set_num_threads, initargs=(1,))
        self._backward_jobs: dict[int, Future] = {}
        self._deferred: _Deferred | None = None
        self._lock = threading.Lock()
        self.busy_s = 0.0  # worker time spent stepping, since the last reset

    # ------------------------------------------------------------------ backward parts
    def submit_backward_part(self, u: int, grad: torch.Tensor, hps: list[AdamHyperParams], step_before: int) -> None:
        """Step unit ``u``'s backward part with the complete gradient ``grad`` (all n elements) and park
        the forward part's gradient in the gradient store. ``grad`` must not be touched afterwards."""
        self._backward_jobs[u] = self._pool.submit(self._backward_job, u, grad, hps, step_before)

    def _backward_job(self, u: int, grad: torch.Tensor, hps: list[AdamHyperParams], step_before: int) -> None:
        unit = self._units[u]
        start_s = time.perf_counter()
        if unit.split:
            unit.grads.evict(grad[:unit.split], 0, unit.split)
        self._step_range(unit, unit.split, unit.layout.numel, grad[unit.split:], hps, step_before)
        self._add_busy(time.perf_counter() - start_s)

    def wait_backward_parts(self) -> float:
        """Block until every backward part of this iteration is applied; returns the seconds waited."""
        start_s = time.perf_counter()
        jobs, self._backward_jobs = self._backward_jobs, {}
        for job in jobs.values():
            job.result()  # sync point: the step is not finished before these are
        return time.perf_counter() - start_s

    # ------------------------------------------------------------------ forward parts
    def defer_forward_parts(self, hps: list[AdamHyperParams], step_before: int, grad_scale: float | None = None) -> None:
        if any(unit.split for unit in self._units):
            self._deferred = _Deferred(hps, step_before, grad_scale)

    def submit_forward_parts(self) -> None:
        """Queue every pending forward part (the worker applies them in unit order, ahead of use)."""
        if self._deferred is not None:
            for u in range(len(self._units)):
                self._submit_forward_part(u)

    def _submit_forward_part(self, u: int) -> Future | None:
        d = self._deferred
        if d is None or not self._units[u].split:
            return None
        if u not in d.submitted:
            d.submitted[u] = self._pool.submit(self._forward_job, u, d.hps, d.step_before, d.grad_scale)
        return d.submitted[u]

    def _forward_job(self, u: int, hps: list[AdamHyperParams], step_before: int, grad_scale: float | None) -> None:
        unit = self._units[u]
        start_s = time.perf_counter()
        grad = unit.grads.acquire(0, unit.split)
        if grad_scale is not None:
            grad.mul_(grad_scale)  # as torch.nn.utils.clip_grad_norm_ does, even when the factor is 1
        self._step_range(unit, 0, unit.split, grad, hps, step_before)
        self._add_busy(time.perf_counter() - start_s)

    def wait_forward_part(self, u: int) -> None:
        """Block until unit ``u``'s forward part is applied (called before its weights are read)."""
        job = self._submit_forward_part(u)
        if job is not None:
            job.result()

    def end_forward_parts(self) -> None:
        """All forward parts of the pending iteration have been waited on; forget them."""
        if self._deferred is not None and len(self._deferred.submitted) == sum(bool(u.split) for u in self._units):
            self._deferred = None

    def flush(self) -> None:
        """Apply every pending update now (before validation, checkpoint save, teardown)."""
        self.wait_backward_parts()
        if self._deferred is not None:
            for u in range(len(self._units)):
                self.wait_forward_part(u)
            self._deferred = None

    @property
    def pending(self) -> bool:
        return self._deferred is not None or bool(self._backward_jobs)

    # ------------------------------------------------------------------ the arithmetic
    def _step_range(self, unit: UnitStore, lo: int, hi: int, grad: torch.Tensor,
                    hps: list[AdamHyperParams], step_before: int) -> None:
        """AdamW on elements [lo, hi) of a unit, in chunks of at most ``STEP_CHUNK_ELEMS`` so the worker
        holds a bounded amount of master/moment memory however large a unit is."""
        for start in range(lo, hi, STEP_CHUNK_ELEMS):
            end = min(hi, start + STEP_CHUNK_ELEMS)
            self._step_chunk(unit, start, end, grad[start - lo:end - lo], hps, step_before)

    def _step_chunk(self, unit: UnitStore, lo: int, hi: int, grad: torch.Tensor,
                    hps: list[AdamHyperParams], step_before: int) -> None:
        with torch.no_grad():
            master = unit.master.acquire(lo, hi)
            exp_avg = unit.exp_avg.acquire(lo, hi)
            exp_avg_sq = unit.exp_avg_sq.acquire(lo, hi)
            grad = grad.to(master.device, non_blocking=True)
            for group, start, end in unit.layout.group_ranges:
                s, e = max(start, lo) - lo, min(end, hi) - lo
                if s < e:
                    adam_step([master[s:e]], [grad[s:e]], [exp_avg[s:e]], [exp_avg_sq[s:e]], step_before, hps[group])
            tickets = [_release_range(t, v, lo, hi) for t, v in
                       ((unit.master, master), (unit.exp_avg, exp_avg), (unit.exp_avg_sq, exp_avg_sq))]
            if unit.weights is not unit.master:
                tickets.append(unit.weights.start_evict(master.to(self._compute_dtype), lo, hi))
            for ticket in tickets:
                if ticket is not None:
                    ticket.wait()

    def _add_busy(self, seconds: float) -> None:
        with self._lock:
            self.busy_s += seconds

    def take_busy_s(self) -> float:
        with self._lock:
            busy, self.busy_s = self.busy_s, 0.0
        return busy

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._backward_jobs, self._deferred = {}, None


def _release_range(t: TieredTensor, value: torch.Tensor, lo: int, hi: int):
    return None if t.resident else t.start_evict(value, lo, hi)
