"""Partitioned optimizer state (ZeRO-1 style) for data parallelism: each rank owns 1/N of every unit.

Unit ``u``'s trainable elements ``[0, train_end)`` are cut into ``N`` equal shards of ``per`` elements
(a multiple of ``SHARD_ALIGN_ELEMS``, so optimizer chunks and SSD pages stay aligned; the last shard is
short or empty). Rank ``r`` owns ``[r per, (r+1) per) ∩ [0, train_end)``:

- its Adam moments exist for that range only (``ShardView``: a tiered tensor of the shard's length that
  is addressed with unit-wide element indices, so the optimizer code keeps its indices);
- the unit's summed gradient arrives by ``reduce_scatter`` (each rank receives the sum of its shard
  only: ``(N-1)/N`` of the payload sent per rank instead of ``2 (N-1)/N``);
- the rank steps its shard (backward part at once, forward part in the next forward, as on one rank);
- before the unit is read again the ranks ``all_gather`` the updated compute weights of the whole unit
  (in the next step's forward, on the optimizer worker, right after the forward part: one gather per
  unit and step covers both parts). The gathers run on a process group of their own, so the worker's
  collectives and the main thread's never interleave within one group.

The compute weights stay whole on every rank (the forward and backward need them); in fp32/fp64 they
are the master copy, so the partitioned bytes are the two moments: per-rank optimizer state drops from
``3 P`` to ``P + 2 P / N`` elements and its optimizer reads/writes of moments by N.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

# The shard geometry is a sizing rule: it lives with the memory model, which plans each rank's bytes.
from snake_strategy.planning.memory_model import shard_bounds, shard_size


class ShardView:
    """A tiered tensor holding elements ``[base, base + numel)`` of a unit, addressed with unit-wide
    indices. Never "resident": the optimizer fetches into and evicts from its scratch (one device copy
    more than in place when the shard is on the device)."""

    resident = False

    def __init__(self, tensor, base: int) -> None:
        self.tensor, self.base, self.end = tensor, base, base + tensor.numel
        self.state, self.name, self.dtype = tensor.state, tensor.name, tensor.dtype
        self.ssd_bytes, self.numel, self.elem_bytes = tensor.ssd_bytes, tensor.numel, tensor.elem_bytes

    def new_buffer(self, numel: int | None = None) -> Tensor:
        return self.tensor.new_buffer(numel)

    def fetch(self, out: Tensor, lo: int, hi: int) -> Tensor:
        return self.tensor.fetch(out, lo - self.base, hi - self.base)

    def start_fetch(self, out: Tensor, lo: int, hi: int, staging: Tensor | None = None):
        return self.tensor.start_fetch(out, lo - self.base, hi - self.base, staging)

    def start_evict(self, src: Tensor, lo: int, hi: int):
        return self.tensor.start_evict(src, lo - self.base, hi - self.base)

    def evict(self, src: Tensor, lo: int, hi: int) -> None:
        self.tensor.evict(src, lo - self.base, hi - self.base)

    @property
    def host_end(self) -> int:
        return self.base + self.tensor.host_end

    def hold(self, lo: int, hi: int) -> None:
        self.tensor.hold(lo - self.base, hi - self.base)

    def fetch_held(self, out: Tensor, lo: int, hi: int) -> Tensor:
        return self.tensor.fetch_held(out, lo - self.base, hi - self.base)

    def release_hold(self) -> None:
        self.tensor.release_hold()

    def read_shard(self) -> Tensor:
        return self.tensor.read_full()


def shard_range(unit) -> tuple[int, int]:
    """[lo, hi) of a unit's trainable elements this rank steps: its shard, or all of them unpartitioned."""
    return unit.shard if unit.shard is not None else (0, unit.train_end)


class Partition:
    """This rank's place in the partition, and the collectives on shards. ``counters`` get the bytes sent
    (ring model: ``(N-1)/N`` of an all-gather's output)."""

    def __init__(self, world_size: int, rank: int, counters, dtypes, device: torch.device) -> None:
        if dtypes.compute != dtypes.master:
            raise ValueError("shard_optimizer_state=True needs the compute weights to be the master weights "
                             "(precision 32-true, 64-true or bf16-mixed); with bf16-true pass "
                             "GreedySnakeStrategy(shard_optimizer_state=False)")
        if dtypes.half_weights is not None:  # the fp32 tail of each unit is not all-gathered (yet)
            raise ValueError("shard_optimizer_state=True does not combine with half-precision weight storage: pass "
                             "plugins=[GreedySnakePrecision(<precision>, half_weights=False)] or "
                             "GreedySnakeStrategy(shard_optimizer_state=False)")
        self.world_size, self.rank, self._counters = world_size, rank, counters
        self._dtype, self._device = dtypes.compute, device
        # The optimizer worker's own group: its gathers never interleave with the main thread's reductions.
        self.worker_group = dist.new_group(list(range(world_size)))

    def bounds(self, train_end: int) -> tuple[int, int]:
        return shard_bounds(train_end, self.world_size, self.rank)

    def padded(self, train_end: int) -> int:
        return shard_size(train_end, self.world_size) * self.world_size

    def gather_weights(self, unit) -> float:
        """All-gather the unit's weights ``[0, train_end)`` from the shard owners into this rank's tiers (the
        other ranks' shards are written; this rank's own is already there). Returns seconds spent."""
        weights, train_end = unit.weights, unit.train_end
        start_s = time.perf_counter()
        per = shard_size(train_end, self.world_size)
        if per == 0:
            return 0.0
        lo, hi = self.bounds(train_end)
        mine = weights.new_buffer(per)  # page-aligned: the SSD share is read and written straight through it
        mine[hi - lo:].zero_()
        if hi > lo:
            weights.fetch(mine[:hi - lo], lo, hi)
        gathered = weights.new_buffer(per * self.world_size)  # one unit, transient
        dist.all_gather_into_tensor(gathered, mine, group=self.worker_group)
        self._counters.add("net", "weights", "sent", (self.world_size - 1) * per * mine.element_size())
        for r in range(self.world_size):
            a, b = shard_bounds(train_end, self.world_size, r)
            if r != self.rank and b > a:
                weights.evict(gathered[r * per:r * per + (b - a)], a, b)
        return time.perf_counter() - start_s

    def local_state(self, unit) -> dict[str, Tensor]:
        """This rank's shard ``shard_range(unit)`` of the unit's master weights and moments (CPU copies, no
        collective): what the rank writes to its checkpoint shard (checkpoint_shards.py)."""
        lo, hi = shard_range(unit)
        return {"master": unit.master.read_copy(lo, hi), **{name: t.read_shard() for name, t in unit.state.items()}}

    def load_local(self, unit, state: dict[str, Tensor]) -> None:
        """Put this rank's shard of a unit's master weights and moments (elements ``shard_range(unit)``)
        into its tiers, then all-gather the whole unit's weights from the shard owners (a collective every
        rank runs for the same units in order; the weights are the master copy, see Partition)."""
        assert unit.weights is unit.master, "partitioned state keeps the master copy in the compute weights"
        lo, hi = shard_range(unit)
        if hi > lo:
            for name, t in (("master", unit.master), *unit.state.items()):
                assert state[name].numel() == hi - lo, (name, state[name].numel(), hi - lo)
                t.evict(state[name].to(t.dtype), lo, hi)
        self.gather_weights(unit)

    def gather_moments(self, unit) -> dict[str, Tensor]:
        """The unit's whole optimizer state from every rank's shard (CPU copies; a collective)."""
        return {name: self._gather_shard(t.read_shard(), unit.train_end) for name, t in unit.state.items()}

    def _gather_shard(self, shard: Tensor, train_end: int) -> Tensor:
        device = self._device
        per = shard_size(train_end, self.world_size)
        mine = torch.zeros(per, dtype=shard.dtype, device=device)
        mine[:shard.numel()] = shard.to(device)
        gathered = torch.empty(per * self.world_size, dtype=shard.dtype, device=device)
        dist.all_gather_into_tensor(gathered, mine)
        out = torch.empty(train_end, dtype=shard.dtype)
        for r in range(self.world_size):
            a, b = shard_bounds(train_end, self.world_size, r)
            out[a:b] = gathered[r * per:r * per + (b - a)].cpu()
        return out
