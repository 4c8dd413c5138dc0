"""The speculative optimizer step's rollback state and its adaptive policy (docs/design.md, "Clipping and
loss scaling").

Norm clipping and fp16 loss scaling decide one factor for every gradient only at the end of the backward
(the global norm, the overflow flag). A speculative step does not wait: each unit's backward part
[forward_end, train_end) is stepped as soon as its gradient is complete, as if the clip factor were 1 and
nothing overflowed. ``torch.nn.utils.clip_grad_norm_`` multiplies by exactly 1.0 when the norm is at most
``max_norm``, so a correct guess is bitwise the deferred computation. Before stepping a chunk the
worker saves its raw gradient and its pre-step master weights and optimizer state here; when the guess was wrong
they are read back: a clipped step is redone from them with the true factor (at the next forward, like a
forward part), an overflowing one is restored (nothing changed, the step is skipped).

``RollbackStore``: per unit over this rank's backward part, the raw gradient and the in-memory part of the
pre-step states in slots overwritten every step (all on the host or all in SSD files,
``storage.rollback``); the states' SSD part held as the previous versions of their files. Counted by
``memory_model.rollback_copied_elems`` and ``memory_model.rollback_held_bytes``. Its files are the engine's own,
separate from any checkpoint: a killed run resumes from its last checkpoint.

``SpeculationPolicy``: when the last step clipped (or overflowed) the next one is not speculated (the
"deferred" mode: the backward part's raw gradient is saved here and applied at the next forward, with
the known factor; nothing to roll back); a deferred step whose norm stayed within ``max_norm`` turns
speculation back on. Both modes compute the same numbers.
"""
from __future__ import annotations

import torch

from snake_strategy.config import TierShares
from snake_strategy.engine.parallel.partition import shard_range
from snake_strategy.engine.state.stores import UnitStore
from snake_strategy.engine.view import StepStats
from snake_strategy.planning.run_plan import STEP_MODES
from snake_strategy.storage import IOEngine, SsdDirectory, TieredTensor, TrafficCounters
from snake_strategy.precision import LossScaler
from snake_strategy.storage.io_engine import DONE, Ticket

GRAD, MASTER = "grad", "master"  # the saved raw gradient; the master weights (the other states: the unit's slots)
SPECULATE, DEFER = "speculate", "defer"  # a step's mode
# What the next forward job does with a unit's backward part: step it from its saved pre-step state (a
# wrong speculation) or from the current state (a deferred-mode step), with the saved raw gradient.
REDO, APPLY = "redo", "apply"


class RollbackStore:
    """Per unit, elements [start, hi) of this rank's range (``start = max(split, lo)``): the raw gradient and
    the pre-step master weights and optimizer state of the last speculative step. Indices are each state's
    own: the unit's elements for the gradient, the master weights and element-wise state, a slot's pieces
    for state kept per tensor (``UnitStore.slot_range``).

    The raw gradient is copied into a slot (on ``storage.rollback``). Of each state, only the part in
    memory (device and host segments, stepped in place) is copied; its SSD part is *held*: the step's
    writes go to a new version of the state file and the pre-step bytes stay in the previous one
    (``TieredTensor.hold``, storage/versions.py), so a speculation writes no extra state bytes and a commit
    frees the dead copy (``release``)."""

    def __init__(self, units: list[UnitStore], tier: str, dtype: torch.dtype, device: torch.device,
                 counters: TrafficCounters, io: IOEngine | None, ssd: SsdDirectory | None) -> None:
        split = TierShares(host=0.0, ssd=1.0) if tier == "ssd" else TierShares()
        self.starts: list[int] = []
        self._units = units
        self._ranges: list[dict[str, tuple[int, int]]] = []  # per unit: each state's [start, hi), its indices
        self._slots: list[dict[str, TieredTensor]] = []
        self._held: set[int] = set()
        for u, unit in enumerate(units):
            lo, hi = shard_range(unit)
            start = max(unit.forward_end, lo)
            self.starts.append(start)
            ranges = {GRAD: (start, hi), MASTER: (start, hi),
                      **{name: unit.slot_range(name, start, hi) for name in unit.state}}
            self._ranges.append(ranges)
            name = f"unit{unit.layout.index:05d}"
            slots = {}
            if hi > start:
                slots[GRAD] = TieredTensor(f"{name}.{GRAD}", "rollback", hi - start, dtype, split, device, counters,
                                           io, ssd)
                for state in self._states(u):
                    n = self._memory_end(u, state) - ranges[state][0]
                    if n > 0:
                        slots[state] = TieredTensor(f"{name}.{state}", "rollback", n, self._state(u, state).dtype,
                                                    split, device, counters, io, ssd)
            self._slots.append(slots)

    def _states(self, u: int) -> list[str]:
        return [MASTER, *self._units[u].state]

    def _state(self, u: int, state: str):
        unit = self._units[u]
        return unit.master if state == MASTER else unit.state[state]

    def _memory_end(self, u: int, state: str) -> int:
        """The end of the part of the state's range that it keeps in memory (copied); from there on: held."""
        start, end = self._ranges[u][state]
        return max(start, min(end, self._state(u, state).host_end))

    def holds(self, u: int) -> bool:
        """Whether unit ``u`` has a backward part on this rank (else nothing is ever saved for it)."""
        return bool(self._slots[u])

    def hold(self, u: int) -> None:
        """Before unit ``u``'s speculative step: hold the SSD part of its pre-step states."""
        for state in self._states(u):
            a, b = self._memory_end(u, state), self._ranges[u][state][1]
            if b > a:
                self._state(u, state).hold(a, b)
        self._held.add(u)

    def release(self, u: int) -> None:
        """Unit ``u``'s pre-step states are no longer needed (committed, redone or restored)."""
        if u in self._held:
            self._held.discard(u)
            for state in self._states(u):
                self._state(u, state).release_hold()

    def release_all(self) -> None:
        for u in list(self._held):
            self.release(u)

    def start_save(self, u: int, state: str, src: torch.Tensor, lo: int, hi: int) -> Ticket:
        """Begin copying what the store copies of ``src`` (elements [lo, hi) of ``state``): all of a gradient,
        the in-memory part of a state; ``src`` must stay untouched until the ticket is waited on."""
        start = self._ranges[u][state][0]
        if state != GRAD:
            hi = min(hi, self._memory_end(u, state))
            if hi <= lo:
                return DONE
        return self._slots[u][state].start_evict(src[:hi - lo], lo - start, hi - start)

    def fetch(self, u: int, state: str, out: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of ``state``'s saved values into ``out`` (blocking): from the slot, and a state's
        SSD part from its held version."""
        start = self._ranges[u][state][0]
        mid = hi if state == GRAD else min(hi, max(lo, self._memory_end(u, state)))
        if mid > lo:
            self._slots[u][state].fetch(out[:mid - lo], lo - start, mid - start)
        if hi > mid:
            self._state(u, state).fetch_held(out[mid - lo:hi - lo], mid, hi)
        return out[:hi - lo]


class SpeculationPolicy:
    """Whether each step is speculated, and the counts ``perf/speculation`` / ``perf/rollbacks`` show.

    Enabled when the plan's ``step_mode`` is "speculative" (``run_plan.resolve`` decides it once, from norm
    clipping, fp16 loss scaling, ``schedule.speculation`` and alpha); ``clip`` and ``scaler`` say only what
    a speculated step assumes."""

    def __init__(self, step_mode: str, clip: tuple[str, float] | None, scaler: LossScaler) -> None:
        assert step_mode in STEP_MODES, step_mode
        self.enabled = step_mode == "speculative"
        # A speculative step assumes the clip factor 1 and no overflow: only the loss scale's unscale
        # (value clipping unscales each unit as it clamps it, engine/step/gradients.py).
        self._unscales = scaler.enabled and not (clip is not None and clip[0] == "value")
        self._scaler = scaler
        self.speculate_next = True
        self.mode: str | None = None  # this step's: SPECULATE, DEFER, or None (disabled)
        self.rollbacks = 0  # speculative steps whose backward parts were redone or restored
        self.speculative_steps = 0

    def begin_step(self) -> tuple[str | None, float | None]:
        """This step's mode and the factor a speculative step assumes (``OptimizerOverlap.begin_step``)."""
        self.mode = (SPECULATE if self.speculate_next else DEFER) if self.enabled else None
        return self.mode, 1.0 / self._scaler.scale if self._unscales else None

    def settle_step(self, skip: bool, stats: StepStats, speculated: set[int], saved: set[int]) -> dict[int, str]:
        """After the step's global decision (``skip``: an fp16 overflow; ``stats.clip_factor``): record it
        in ``stats`` (every step, speculation enabled or not), choose the next step's mode, and return the backward parts to step at the next forward
        with the true factor (none after a skip: the engine restores the speculated ones)."""
        if self.mode is None:  # logged every step all the same (perf/speculation 0)
            stats.speculation, stats.rolled_back, stats.rollbacks = False, False, self.rollbacks
            return {}
        wrong = skip or (stats.clip_factor is not None and stats.clip_factor != 1.0)
        rolled_back = self.mode == SPECULATE and wrong
        self.speculative_steps += self.mode == SPECULATE
        self.rollbacks += rolled_back
        # Early training clips step after step: defer until a step's norm is back within max_norm.
        self.speculate_next = not wrong
        stats.speculation, stats.rolled_back, stats.rollbacks = self.mode == SPECULATE, rolled_back, self.rollbacks
        if skip:
            return {}
        redo = {u: APPLY for u in saved}
        if rolled_back:
            redo.update({u: REDO for u in speculated})
        return redo
