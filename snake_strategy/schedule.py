"""The tasks of one optimizer step, as plain data: the engine runs this list one to one.

A task is (pass, unit, micro-batches). Forward tasks cover units 0..N-2 and run without grad: they only
produce activation checkpoints. Backward tasks cover units N-1..0; the last unit's backward task is
fused with its forward, the post stage and the loss, so the last unit is never recomputed
(docs/design.md, "The schedule").

A task normally holds one micro-batch. With ``batched_forward`` / ``batched_backward`` (vertical
schedule only) all micro-batches of a unit's pass form ONE task that runs them as a single batched
pass, in the same snake order; the list says so explicitly instead of the engine skipping tasks.
"""
from __future__ import annotations

from dataclasses import dataclass

FORWARD = "fwd"
BACKWARD = "bwd"


@dataclass(frozen=True)
class Task:
    kind: str  # FORWARD or BACKWARD
    unit: int
    micro_batches: tuple[int, ...]  # in the order they are stacked when batched

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, int):
            object.__setattr__(self, "micro_batches", (self.micro_batches,))
        else:
            object.__setattr__(self, "micro_batches", tuple(self.micro_batches))

    def __repr__(self) -> str:
        micro = ",".join(map(str, self.micro_batches))
        return f"{'F' if self.kind == FORWARD else 'B'}({self.unit},{micro})"


def _snake_order(unit: int, num_micro: int) -> tuple[int, ...]:
    # Even units run micro-batches upward, odd units downward: at every unit boundary (and at the
    # forward->backward turn) the next task uses the micro-batch that was just finished.
    return tuple(range(num_micro)) if unit % 2 == 0 else tuple(range(num_micro - 1, -1, -1))


def _pass(kind: str, units: range, num_micro: int, batched: bool) -> list[Task]:
    if batched:
        return [Task(kind, u, _snake_order(u, num_micro)) for u in units]
    return [Task(kind, u, (m,)) for u in units for m in _snake_order(u, num_micro)]


def _backward_units(num_units: int, first_backward: int) -> range:
    # Units below ``first_backward`` hold nothing trainable and feed nothing trainable: no backward. The
    # last unit's task always runs (it is the forward of the last unit, the head and the loss).
    return range(num_units - 1, min(first_backward, num_units - 1) - 1, -1)


def vertical_tasks(num_units: int, num_micro: int, batched_forward: bool = False,
                   batched_backward: bool = False, first_backward: int = 0) -> list[Task]:
    """The GreedySnake order: every micro-batch of a unit before moving to the next unit."""
    _check(num_units, num_micro)
    return (_pass(FORWARD, range(num_units - 1), num_micro, batched_forward)
            + _pass(BACKWARD, _backward_units(num_units, first_backward), num_micro, batched_backward))


def horizontal_tasks(num_units: int, num_micro: int, first_backward: int = 0) -> list[Task]:
    """Gradient accumulation: each micro-batch runs through every unit, forward then backward."""
    _check(num_units, num_micro)
    tasks = []
    for m in range(num_micro):
        tasks += [Task(FORWARD, u, (m,)) for u in range(num_units - 1)]
        tasks += [Task(BACKWARD, u, (m,)) for u in _backward_units(num_units, first_backward)]
    return tasks


def build_tasks(kind: str, num_units: int, num_micro: int, batched_forward: bool = False,
                batched_backward: bool = False, first_backward: int = 0) -> list[Task]:
    if kind == "vertical":
        return vertical_tasks(num_units, num_micro, batched_forward, batched_backward, first_backward)
    if kind == "horizontal":
        if batched_forward or batched_backward:
            raise ValueError("batched passes need schedule.kind='vertical'")
        return horizontal_tasks(num_units, num_micro, first_backward)
    raise ValueError(f"unknown schedule kind '{kind}'")


def weight_fetches(tasks: list[Task]) -> list[int]:
    """Units whose weights must be fetched, in order, when one unit is resident at a time.

    A fetch happens whenever the task's unit differs from the previous task's unit. This is the
    traffic model the engine's byte counters are tested against.
    """
    fetches, resident = [], None
    for task in tasks:
        if task.unit != resident:
            fetches.append(task.unit)
            resident = task.unit
    return fetches


def unit_run_ahead(tasks: list[Task], index: int, depth: int) -> list[int]:
    """The next ``depth`` distinct units after task ``index``'s own, in task order (what to prefetch)."""
    upcoming: list[int] = []
    current = tasks[index].unit
    for task in tasks[index + 1:]:
        if len(upcoming) >= depth:
            break
        last = upcoming[-1] if upcoming else current
        if task.unit != last:
            upcoming.append(task.unit)
    return upcoming


def _check(num_units: int, num_micro: int) -> None:
    if num_units < 1 or num_micro < 1:
        raise ValueError(f"a schedule needs >= 1 unit and >= 1 micro-batch (got {num_units}, {num_micro})")
