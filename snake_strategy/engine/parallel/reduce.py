"""Data parallelism inside the engine: each unit's complete gradient is summed across the ranks.

Every rank runs the same task list over its own micro-batches, so every rank completes the units in the
same order; the reduction of unit ``u`` is launched (``torch.distributed.all_reduce(async_op=True)``)
the moment its gradient is complete, from the main thread, and the main thread goes on with the next
unit's backward while the collective runs on the backend's own threads. The optimizer worker waits for
it (``PendingReduction.wait``) before it checks, clips or steps the unit, so the wait is off the
critical path unless the network is slower than a unit's backward. Collectives are always issued from
the main thread in the schedule's order: the ranks' sequences match, whatever the worker does.

Loss normalisation: each micro-batch loss is divided by ``num_micro_batches x world_size`` and the
gradients are summed, so N ranks x M micro-batches equal 1 rank x N*M micro-batches of the same
global batch (docs/design.md, "Data parallelism").

Bytes: ``counters`` get ``("net", state, "sent")``, the bytes one rank sends under the bandwidth-optimal
ring algorithm, ``2 (N-1)/N`` of the payload for an all-reduce (the backend may pick another algorithm;
the payload itself is in ``records``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from snake_strategy.engine.trace import TaskTrace
from snake_strategy.storage import TrafficCounters

NET = "net"


def ring_all_reduce_sent_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``payload_bytes`` (reduce-scatter + all-gather)."""
    return 2 * (world_size - 1) * payload_bytes // world_size


@dataclass
class ReductionRecord:
    """One gradient reduction of a step: what was reduced, when it was issued and when it was waited on."""

    unit: int  # -1: the non-layer gradients
    payload_bytes: int
    tasks_before: int  # tasks the step had run when it was issued (the trace's task index)
    issued_s: float
    sent_bytes: int  # what the counters got for it (ring model)
    kind: str = "all_reduce"  # or "reduce_scatter" (partitioned optimizer state)
    waited_s: float = 0.0  # seconds the waiter blocked (0: it had finished in time)


class PendingReduction:
    """The in-flight all-reduce of one unit's gradient (and of its used-parameter mask)."""

    def __init__(self, works: list, used: Tensor, record: ReductionRecord, out: Tensor | None = None) -> None:
        self._works, self.used, self.record = works, used, record
        self.out = out  # reduce-scatter: this rank's summed shard (None: the input was summed in place)

    def wait(self) -> None:
        start_s = time.perf_counter()
        for work in self._works:
            work.wait()  # sync point with the other ranks
        self.record.waited_s = time.perf_counter() - start_s


class GradientReducer:
    """Sums gradients across the ranks of ``group`` (the default group when None)."""

    def __init__(self, world_size: int, counters: TrafficCounters, trace: TaskTrace, device: torch.device,
                 group=None) -> None:
        assert world_size >= 2, "a single process has nothing to reduce"
        self.world_size, self._counters, self._trace, self._group = world_size, counters, trace, group
        self._device = device  # NCCL reduces device tensors only
        self._lock = threading.Lock()
        self.records: list[ReductionRecord] = []  # this step's reductions, in issue order
        self.last_step: list[ReductionRecord] = []  # the previous complete step's

    def begin_step(self) -> None:
        with self._lock:
            self.last_step, self.records = self.records, []

    def _record(self, unit: int, payload_bytes: int, state: str, sent_bytes: int | None = None,
                kind: str = "all_reduce") -> ReductionRecord:
        sent = ring_all_reduce_sent_bytes(payload_bytes, self.world_size) if sent_bytes is None else sent_bytes
        self._counters.add(NET, state, "sent", sent)
        record = ReductionRecord(unit, payload_bytes, len(self._trace.last.tasks), time.perf_counter(), sent, kind)
        with self._lock:
            self.records.append(record)
        return record

    def start(self, u: int, grad: Tensor, used: Tensor) -> PendingReduction:
        """Launch the sum of unit ``u``'s gradient and of its used-slot mask (an unused parameter is unused
        only when no rank used it). Neither tensor may be touched until ``wait`` returns."""
        works = [dist.all_reduce(grad, group=self._group, async_op=True),
                 dist.all_reduce(used, group=self._group, async_op=True)]
        payload = grad.numel() * grad.element_size() + used.numel() * used.element_size()
        return PendingReduction(works, used, self._record(u, payload, "gradients"))

    def start_scatter(self, u: int, grad: Tensor, used: Tensor, shard_elems: int) -> PendingReduction:
        """Partitioned optimizer state: launch the reduce-scatter of unit ``u``'s padded gradient (``N x
        shard_elems`` elements, the padding zero); ``pending.out`` receives this rank's summed shard."""
        out = torch.empty(shard_elems, dtype=grad.dtype, device=grad.device)  # 1/N unit, until stepped
        works = [dist.reduce_scatter_tensor(out, grad, group=self._group, async_op=True),
                 dist.all_reduce(used, group=self._group, async_op=True)]
        payload = grad.numel() * grad.element_size()
        sent = ((self.world_size - 1) * payload // self.world_size
                + ring_all_reduce_sent_bytes(used.numel() * used.element_size(), self.world_size))
        return PendingReduction(works, used, self._record(u, payload, "gradients", sent, "reduce_scatter"), out)

    def all_reduce_now(self, value: Tensor, op) -> Tensor:
        """A blocking all-reduce of a small tensor (the partitioned norm or inf flag): a sync point."""
        on_device = value.to(self._device)
        dist.all_reduce(on_device, op=op, group=self._group)
        value = on_device.to(value.device)
        self._counters.add(NET, "scalars", "sent", ring_all_reduce_sent_bytes(value.numel() * value.element_size(),
                                                                                self.world_size))
        return value

    def start_nonlayer(self, grads: list[Tensor], used: list[bool]) -> PendingReduction | None:
        """Launch the sum of the non-layer gradients (complete only at the end of the backward)."""
        if not grads:
            return None
        mask = torch.tensor([1 if u else 0 for u in used], dtype=torch.int32, device=grads[0].device)
        works = [dist.all_reduce(g, group=self._group, async_op=True) for g in grads]
        works.append(dist.all_reduce(mask, group=self._group, async_op=True))
        payload = sum(g.numel() * g.element_size() for g in grads) + mask.numel() * mask.element_size()
        return PendingReduction(works, mask, self._record(-1, payload, "nonlayer_gradients"))
