"""Kept forward graphs: units whose forward autograd graph stays in memory until their backward, so
the backward starts from it instead of recomputing the forward from the unit's checkpoint
(``schedule.keep_activations``; docs/design.md, "Kept activations").

Recomputing costs one extra forward per unit (a quarter of a step's block FLOPs); keeping costs the
activations autograd saves (several times a checkpoint per block). The planner keeps what the host budget
holds and recomputes the rest.

The saved weights are not held by the graph. A saved tensor that lies in the storage of the unit's weight
leaves is packed as a reference (leaf, offset, shape, strides) and unpacked, at the backward, from the
weights fetched for that backward: the same values, because no update of a unit lands between its forward
and its backward within a step (the streamer waits for the deferred update before the forward's fetch,
and the backward part of this step's update starts after the backward). So a kept graph costs its
activations only, and the weight buffer pool keeps serving the other units meanwhile.

Which units: the top ``k`` of the units that have a recompute at all, i.e. from the first unit with a
backward up to the one below the last (the last unit's backward is fused with its forward). With
``"auto"`` the first forward of the lowest such unit is measured (bytes of its saved tensors) and ``k``
is what the memory left over by the plan holds; that first graph is kept only when every unit fits.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)


class _WeightRef(NamedTuple):
    """A saved tensor that is (a view of) the unit's weights: where it lies relative to leaf ``leaf``
    (relative, because a buffer of the pool starts at its own page-alignment offset in its storage)."""

    leaf: int
    byte_delta: int  # its first element's byte offset minus the leaf's, within their common storage
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class KeptGraph:
    x: Tensor  # the forward's input (a leaf; requires grad when the unit below needs dX)
    leaves: list[Tensor]  # the forward's weight leaves: the weight gradients are taken with respect to them
    y: Tensor  # the forward's output, still attached to the graph
    num_bytes: int  # the saved activations (weights excluded)
    outputs: list[Tensor] = field(default_factory=list)  # the blocks' outputs for the loss, attached (if it reads any)


class _Recording:
    """The pack hook of one kept forward, and the bytes it saw."""

    def __init__(self, leaves: list[Tensor]) -> None:
        # Every leaf is a view of one or two flat buffers: map each storage to the first leaf that uses it.
        self._leaves = leaves
        self._weights: dict[int, int] = {}
        for i, leaf in enumerate(leaves):
            self._weights.setdefault(leaf.untyped_storage().data_ptr(), i)
        self._seen: set[int] = set()
        self.num_bytes = 0

    def pack(self, t: Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        leaf = self._weights.get(ptr) if ptr else None
        if leaf is not None:
            anchor = self._leaves[leaf]
            delta = t.storage_offset() * t.element_size() - anchor.storage_offset() * anchor.element_size()
            return _WeightRef(leaf, delta, tuple(t.size()), tuple(t.stride()), t.dtype)
        if ptr not in self._seen:  # several saved views of one tensor cost its storage once
            self._seen.add(ptr)
            self.num_bytes += storage.nbytes()
        return t


class KeptGraphs:
    def __init__(self, setting: int | str, device: torch.device, forward_tasks_per_unit: int = 1) -> None:
        """``setting``: the plan's effective policy (``run_plan.resolve``): the number of units to keep, or
        "auto" (as many as ``free_bytes`` allows at the first step; a CPU run's only, since on a GPU the
        graphs would live in device memory, which the host budget does not see).
        ``forward_tasks_per_unit``: the forward tasks of one unit whose graphs are alive together (the
        micro-batches of an unbatched vertical forward)."""
        assert setting != "auto" or device.type == "cpu", "the plan keeps no graph by budget on a GPU"
        self.setting = setting
        self.units: frozenset[int] | None = None if setting == "auto" else frozenset()
        self.bytes_per_unit = 0  # measured: one unit's graphs alive at the turning point
        self._graphs: dict[tuple[int, tuple[int, ...]], KeptGraph] = {}
        self._unpack_from: list[Tensor] | None = None  # the weight leaves fetched for the running backward
        self._candidates: list[int] = []
        self._forward_tasks_per_unit = forward_tasks_per_unit

    @classmethod
    def for_schedule(cls, schedule, device: torch.device) -> KeptGraphs:
        """The plan's ``keep_activations``, as resolved: none where the schedule cannot keep a graph (the
        split backward defers a recompute's weight gradients; a graph covers one forward task, so the
        forward and the backward must group micro-batches alike)."""
        vertical = schedule.kind == "vertical"
        assert schedule.keep_activations == 0 or not schedule.split_backward and (
            not vertical or schedule.batched_forward == schedule.batched_backward), "resolve keeps none here"
        per_unit = schedule.num_micro_batches if vertical and not schedule.batched_forward else 1
        return cls(schedule.keep_activations, device, per_unit)

    # ------------------------------------------------------------------ which units
    def begin(self, first_backward: int, num_units: int) -> None:
        """Once the units with a backward are known (the first step): fix the candidates and, for an
        explicit count, the kept units."""
        self._candidates = list(range(first_backward, num_units - 1))
        if isinstance(self.setting, int):
            kept = self._candidates[max(0, len(self._candidates) - self.setting):] if self.setting else []
            self.units = frozenset(kept)

    def wants(self, u: int) -> bool:
        """Whether the forward of unit ``u`` runs under grad (kept, or measured to decide)."""
        if self.units is None:
            return bool(self._candidates) and u == self._candidates[0]
        return u in self.units

    @property
    def planned_bytes(self) -> int:
        """Host bytes of the kept graphs at their peak (every kept unit's graphs alive at once)."""
        return len(self.units or ()) * self.bytes_per_unit

    def expected_units(self, graph_bytes: int, free: int | None, num_units: int) -> tuple[int, int]:
        """(how many units the first step will keep, the host bytes of one unit's graphs) from a graph of
        ``graph_bytes`` measured before it (one forward task's) and ``free`` budget bytes: the decision ``keep``
        makes, for the prediction before step 1 (all units but the last as candidates: frozen lower units are
        known only at the first step)."""
        candidates, per_unit = max(0, num_units - 1), graph_bytes * self._forward_tasks_per_unit
        if isinstance(self.setting, int):
            return min(self.setting, candidates), per_unit
        return min(candidates, max(0, free or 0) // max(1, per_unit)), per_unit

    # ------------------------------------------------------------------ forward
    @contextlib.contextmanager
    def recording(self, leaves: list[Tensor]):
        """Run a unit's forward under grad, saving weights as references (see the module docstring)."""
        rec = _Recording(leaves)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, self._unpack):
            yield rec

    def keep(self, key: tuple[int, tuple[int, ...]], graph: KeptGraph,
             free_bytes: Callable[[], int | None]) -> bool:
        """Keep ``graph`` for the backward of ``key`` = (unit, micro-batches); decides "auto" on the first
        one, from ``free_bytes()`` (the host budget left by the plan; None: no budget known, keep none).
        Returns whether it was kept (if not, the unit is recomputed as usual)."""
        if not self.bytes_per_unit:  # the first graph: measured, then "auto" decides or a count is checked
            self.bytes_per_unit = graph.num_bytes * self._forward_tasks_per_unit
            free = free_bytes()
            if self.units is None:
                count = min(len(self._candidates), max(0, free or 0) // max(1, self.bytes_per_unit))
                self.units = frozenset(self._candidates[len(self._candidates) - count:] if count else [])
                log.info("keep_activations='auto': %d of %d units keep their forward graph (%.1f MiB each; %.2f GiB "
                         "free in the host budget); the others are recomputed", count, len(self._candidates),
                         self.bytes_per_unit / 2**20, (free or 0) / 2**30)
            elif free is not None and self.planned_bytes > free:
                raise ValueError(
                    f"schedule.keep_activations={self.setting} keeps {len(self.units)} units' forward graphs, "
                    f"{self.planned_bytes / 2**30:.2f} GiB ({self.bytes_per_unit / 2**20:.1f} MiB each), but the host "
                    f"budget has {free / 2**30:.2f} GiB left after the plan: keep fewer units, use "
                    "keep_activations='auto', or raise storage.host_budget_bytes")
        if key[0] not in self.units:
            return False
        self._graphs[key] = graph
        return True

    # ------------------------------------------------------------------ backward
    def take(self, key: tuple[int, tuple[int, ...]]) -> KeptGraph | None:
        return self._graphs.pop(key, None)

    @contextlib.contextmanager
    def unpacking(self, leaves: list[Tensor]):
        """The backward of a kept graph: its weight references resolve to ``leaves`` (this fetch's)."""
        self._unpack_from = leaves
        try:
            yield
        finally:
            self._unpack_from = None

    def _unpack(self, packed):
        if not isinstance(packed, _WeightRef):
            return packed
        assert self._unpack_from is not None, "a kept graph's weights are read outside its backward"
        anchor = self._unpack_from[packed.leaf]
        start_bytes = anchor.storage_offset() * anchor.element_size() + packed.byte_delta
        itemsize = packed.dtype.itemsize
        assert start_bytes % itemsize == 0, "a weight reference must land on an element boundary"
        # A view of the fetched weights, no copy: the same bytes the forward saw.
        return torch.empty(0, dtype=packed.dtype, device=anchor.device).set_(
            anchor.untyped_storage(), start_bytes // itemsize, packed.size, packed.stride)

    def clear(self) -> None:
        """Forget every graph (the end of a step, or a step that failed)."""
        self._graphs.clear()
        self._unpack_from = None
