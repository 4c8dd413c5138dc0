"""The gradient path of one step: accumulate each task's block gradients into the unit's flat buffer,
and when a unit is complete check it, clip it and hand it to the optimizer worker; at the end of the
step turn the loss scale and the global norm into ONE factor for everything still to be stepped.

Policies (docs/design.md, "Clipping and loss scaling"):
- clipping by value is element-wise: each complete unit is unscaled and clamped at once, and the normal
  overlap applies;
- clipping by norm and fp16 loss scaling need every gradient before any update (the global norm; the
  overflow decision): ``finish`` computes the factor ``unscale x min(1, max_norm / (norm + 1e-6))`` that
  the deferred forward parts apply (or skips the step). The backward parts are stepped speculatively
  (factor 1, no overflow) or saved, and ``finish`` settles them (``SpeculationPolicy``, engine/optimizer/rollback.py:
  kept, redone or restored); with ``schedule.speculation="off"`` the plan's alpha is 1 (all deferred).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from snake_strategy.engine.optimizer.worker import OptimizerOverlap
from snake_strategy.engine.parallel.partition import Partition, shard_range
from snake_strategy.engine.parallel.reduce import GradientReducer
from snake_strategy.engine.optimizer.rollback import SpeculationPolicy
from snake_strategy.engine.state.stores import NonLayerState, UnitStore
from snake_strategy.engine.view import StepStats
from snake_strategy.precision import LossScaler
from snake_strategy.storage.pool import BufferPool


def squared_norms(grads: list[Tensor]) -> Tensor:
    """The sum of the squared L2 norms of ``grads``, a 0-d float64 tensor on the CPU (a sync point on GPUs).

    Each norm is taken as ``torch.nn.utils.clip_grad_norm_`` takes a parameter's: over the parameter's
    gradient, in its own dtype, so the engine's global norm is the one plain Lightning computes up to
    how the per-parameter norms are combined (here in float64). Not ``vector_norm(dtype=float64)`` over
    the unit: that casts the whole gradient first, 140-150 ms per 50M fp32 elements on this CPU against
    18 ms, plus a temporary of twice its bytes (gpt_1b: 3-4 s of the main thread per step, most of what
    norm clipping cost)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
    return norms.double().square().sum().cpu()


class GradientPath:
    def __init__(self, units: list[UnitStore], overlap: OptimizerOverlap, pool: BufferPool,
                 clip: tuple[str, float] | None, scaler: LossScaler, reducer: GradientReducer | None = None,
                 partition: Partition | None = None, speculation: SpeculationPolicy | None = None) -> None:
        self._units, self._overlap, self._pool, self._clip, self._scaler = units, overlap, pool, clip, scaler
        self._reducer = reducer  # None: one process; else the unit gradients are summed across ranks
        self._partition = partition  # partitioned optimizer state: each rank receives its shard's sum
        self._speculation = speculation  # None: no speculative step (tests building a path by hand)
        self.redo: dict[int, str] = {}  # backward parts the next forward steps with the true factor
        self._acc: tuple[int, Tensor] | None = None  # (unit, pool buffer) of the unit being accumulated
        self._begin(1, [], 0)

    def _begin(self, num_micro: int, hps: list[dict], step_before: int) -> None:
        self._num_micro, self._hps, self._step_before = num_micro, hps, step_before
        self._partial = [False] * len(self._units)  # horizontal: a partial sum waits in the store
        self.done = [0] * len(self._units)  # micro-batches whose gradient reached the unit
        self._used: list[set[int]] = [set() for _ in self._units]  # slots that received a gradient
        self._overlap.unused = {}
        self._grad_sq = torch.zeros((), dtype=torch.float64)  # squared norm of complete unit gradients
        self._found_inf = False

    def begin_step(self, num_micro: int, hps: list[dict], step_before: int) -> None:
        assert self._acc is None, "a gradient accumulator survived the previous step"
        self._begin(num_micro, hps, step_before)
        if self._speculation is not None:  # speculate unless the last step clipped
            self._overlap.begin_step(*self._speculation.begin_step())

    def accumulate(self, u: int, grads: tuple[Tensor, ...], num_micro: int) -> None:
        """Add one task's per-parameter gradients (covering ``num_micro`` micro-batches) into unit ``u``."""
        if self._acc is not None and self._acc[0] != u:
            self.flush()
        layout = self._units[u].layout
        slots, n = layout.trainable_slots, layout.train_end  # only the trainable part has a gradient
        self._used[u].update(i for i, g in enumerate(grads) if g is not None)
        if self._acc is None:
            # The first task's gradients are copied in (no zero-fill, no extra pass). Blocks while both
            # buffers are out (one with the worker): backpressure when the optimizer falls behind.
            buffer = self._pool.acquire()
            acc = buffer[:n]
            end = 0
            for s in slots:  # page padding between parameters (aligned layouts) and before the frozen part
                acc[end:s.offset].zero_()
                end = s.offset + s.numel
            acc[end:].zero_()
            for s, g in zip(slots, grads):
                if g is None:
                    acc[s.offset:s.offset + s.numel].zero_()  # an unused parameter: zero gradient
                else:
                    acc[s.offset:s.offset + s.numel].copy_(g.reshape(-1))
            self._acc = (u, buffer)
        else:
            acc = self._acc[1][:n]
            for s, g in zip(slots, grads):
                if g is not None:
                    acc[s.offset:s.offset + s.numel].add_(g.reshape(-1))
        self.done[u] += num_micro
        if self.done[u] == self._num_micro:
            self.flush()  # complete: hand it to the optimizer worker right away

    def flush(self) -> None:
        """Move the unit being accumulated on: to the worker when complete, else to the gradient store."""
        if self._acc is None:
            return
        u, buffer = self._acc
        self._acc = None
        unit = self._units[u]
        acc = buffer[:unit.train_end]
        if self._partial[u]:
            # Horizontal schedule: an earlier micro-batch left a partial gradient; read, add.
            acc.add_(unit.grads.acquire())
        if self.done[u] < self._num_micro:
            try:
                unit.grads.evict(acc)
            finally:
                self._pool.release(buffer)
            self._partial[u] = True
            return
        release = lambda: self._pool.release(buffer)  # noqa: E731 (the worker gives the buffer back)
        if self._reducer is None:
            self._complete(u, acc, self._used[u])
            self._overlap.submit_backward_part(u, acc, release, self._hps, self._step_before)
            return
        # Data parallel: sum the unit across the ranks while the next unit's backward runs; the worker
        # waits for the sum, then checks and clips it (a norm or an inf of the SUM, as on one rank).
        used = torch.tensor([i in self._used[u] for i in range(len(unit.layout.trainable_slots))],
                            dtype=torch.int32, device=acc.device)
        if self._partition is None:
            pending = self._reducer.start(u, acc, used)
            grad = acc
        else:
            padded = self._partition.padded(unit.train_end)
            buffer[unit.train_end:padded].zero_()  # the last shard's padding adds nothing
            pending = self._reducer.start_scatter(u, buffer[:padded], used, padded // self._partition.world_size)
            lo, hi = shard_range(unit)
            grad = pending.out[:hi - lo]

        def reduced() -> None:
            pending.wait()
            self._complete(u, grad, {i for i, n in enumerate(pending.used.tolist()) if n})

        self._overlap.submit_backward_part(u, grad, release, self._hps, self._step_before, prepare=reduced)

    def _complete(self, u: int, acc: Tensor, used: set[int]) -> None:
        """Check and clip unit ``u``'s complete gradient (on the worker when it was reduced across ranks;
        partitioned: this rank's shard of it, the norm and inf flag being completed in ``finish``)."""
        unit = self._units[u]
        if self._scaler.enabled:
            self._found_inf |= not bool(torch.isfinite(acc).all())  # a sync point on GPUs
        if self._clip is not None and self._clip[0] == "value":
            if self._scaler.enabled:
                acc.mul_(1.0 / self._scaler.scale)  # clip the true gradient, not the scaled one
            acc.clamp_(-self._clip[1], self._clip[1])
        elif self._clip is not None:
            # Per parameter, as torch's clip_grad_norm_; partitioned: the part of each in this shard.
            lo, hi = shard_range(unit)
            parts = [acc[max(slot.offset, lo) - lo:min(slot.offset + slot.numel, hi) - lo]
                     for i, slot in enumerate(unit.layout.trainable_slots)
                     if i in used and max(slot.offset, lo) < min(slot.offset + slot.numel, hi)]
            self._grad_sq += squared_norms(parts)
        unused = [(s.offset, s.offset + s.numel) for i, s in enumerate(unit.layout.trainable_slots)
                  if i not in used]
        if unused:
            self._overlap.unused[u] = unused

    def abandon(self) -> None:
        """Give back the accumulator after a failed step (the step's gradients are lost, not applied)."""
        if self._acc is not None:
            self._pool.release(self._acc[1])
            self._acc = None

    def finish(self, nonlayer: NonLayerState, stats: StepStats) -> tuple[bool, float | None]:
        """After every backward part is submitted and waited: (skip the step?, factor for deferred parts).

        Applies the same factor to the non-layer gradients. Updates the loss scaler (16-mixed). Settles the
        speculative step: ``redo`` holds the backward parts to step at the next forward; on a skip the
        speculated ones are restored by ``OptimizerOverlap.drop_forward_parts``.
        """
        skip, factor = self._finish(nonlayer, stats)
        if self._speculation is not None:
            self.redo = self._speculation.settle_step(skip, stats, self._overlap.speculated, self._overlap.saved)
        return skip, factor

    def _finish(self, nonlayer: NonLayerState, stats: StepStats) -> tuple[bool, float | None]:
        used = nonlayer.used_grads()
        scale_used = self._scaler.scale
        if self._scaler.enabled:
            self._found_inf |= any(not bool(torch.isfinite(g).all()) for g in used)
            if self._partition is not None:  # one all-reduce of the inf flag: every rank saw its shards only
                flag = torch.tensor([float(self._found_inf)], dtype=torch.float64)
                self._found_inf = bool(self._reducer.all_reduce_now(flag, dist.ReduceOp.MAX).item())
            stats.loss_scale = scale_used
            if self._scaler.update(self._found_inf):
                stats.skipped = True
                return True, None
        unscale = 1.0 / scale_used if self._scaler.enabled else None
        if unscale is not None:
            for g in used:
                g.mul_(unscale)
        if self._clip is None:
            return False, unscale
        algorithm, value = self._clip
        if algorithm == "value":
            for g in used:
                g.clamp_(-value, value)
            return False, None  # unit gradients were unscaled and clamped when they completed
        if self._partition is not None:  # one all-reduce of the squared norm of the shards
            self._grad_sq = self._reducer.all_reduce_now(self._grad_sq.reshape(1), dist.ReduceOp.SUM).reshape(())
        grad_sq = self._grad_sq * (unscale**2 if unscale is not None else 1.0)
        sq = grad_sq + squared_norms(used)
        total_norm = float(sq.sqrt())
        # torch.nn.utils.clip_grad_norm_: factor = min(1, max_norm / (norm + 1e-6)), applied even when 1,
        # computed in the gradients' dtype as torch computes it (the norm is a tensor of that dtype there).
        dtype = next((g.dtype for g in used), self._pool.dtype)  # the unit gradients are the pool's
        norm_t = torch.tensor(total_norm, dtype=dtype)
        factor = float(torch.clamp(value / (norm_t + 1e-6), max=1.0))
        for g in used:
            g.mul_(factor)
        stats.grad_norm, stats.clip_factor = total_norm, factor
        return False, factor * unscale if unscale is not None else factor
