"""Task orders of one optimizer step: pure data, testable without any I/O.

A task is (pass, unit, micro-batch). Forward tasks cover units 0..N-2 (run without grad, they only
produce activation checkpoints); backward tasks cover N-1..0, and the last unit's backward task is
fused with its forward, the post stage and the loss, so the last unit is never recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass

FORWARD = "fwd"
BACKWARD = "bwd"


@dataclass(frozen=True)
class Task:
    kind: str  # FORWARD or BACKWARD
    unit: int
    micro: int

    def __repr__(self) -> str:
        return f"{'F' if self.kind == FORWARD else 'B'}({self.unit},{self.micro})"


def _snake_order(unit: int, num_micro: int) -> range:
    # Even units run micro-batches upward, odd units downward: at every unit boundary (and at the
    # forward->backward turn) the next task uses the micro-batch that was just finished.
    return range(num_micro) if unit % 2 == 0 else range(num_micro - 1, -1, -1)


def vertical_tasks(num_units: int, num_micro: int) -> list[Task]:
    """The GreedySnake order: every micro-batch of a unit before moving to the next unit."""
    _check(num_units, num_micro)
    tasks = [Task(FORWARD, u, m) for u in range(num_units - 1) for m in _snake_order(u, num_micro)]
    tasks += [Task(BACKWARD, u, m) for u in range(num_units - 1, -1, -1) for m in _snake_order(u, num_micro)]
    return tasks


def horizontal_tasks(num_units: int, num_micro: int) -> list[Task]:
    """Gradient accumulation: each micro-batch runs through every unit, forward then backward."""
    _check(num_units, num_micro)
    tasks = []
    for m in range(num_micro):
        tasks += [Task(FORWARD, u, m) for u in range(num_units - 1)]
        tasks += [Task(BACKWARD, u, m) for u in range(num_units - 1, -1, -1)]
    return tasks


def build_tasks(kind: str, num_units: int, num_micro: int) -> list[Task]:
    if kind == "vertical":
        return vertical_tasks(num_units, num_micro)
    if kind == "horizontal":
        return horizontal_tasks(num_units, num_micro)
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


def _check(num_units: int, num_micro: int) -> None:
    if num_units < 1 or num_micro < 1:
        raise ValueError(f"a schedule needs >= 1 unit and >= 1 micro-batch (got {num_units}, {num_micro})")
