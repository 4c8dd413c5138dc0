"""The tasks of one optimizer step, as plain data: the engine runs this list one to one.

A task is (pass, unit, micro-batches). Forward tasks cover units 0..N-2 and run without grad: they only
produce activation checkpoints. Backward tasks cover units N-1..0; the last unit's backward task is
fused with its forward, the post stage and the loss, so the last unit is never recomputed
(docs/design.md, "The schedule").

A task normally holds one micro-batch. With ``batched_forward`` / ``batched_backward`` (vertical
schedule only) all micro-batches of a unit's pass form ONE task that runs them as a single batched
pass, in the same snake order; the list says so explicitly instead of the engine skipping tasks.

With ``split_backward`` (LayerPipe's split, vertical only) a unit's backward is two kinds of task:
``BX(u, m)`` per micro-batch (recompute, the input gradient and every gradient that is not an
nn.Linear weight's) and then one ``W(u, ...)`` over all micro-batches: each Linear weight gradient of
the unit as ONE product (``engine/step/split_backward.py``). ``W`` reads no weights, so the unit's weight buffer is
given back before it runs and the fetches of the units below proceed under it.
"""
from __future__ import annotations

from dataclasses import dataclass

FORWARD = "fwd"
BACKWARD = "bwd"
BACKWARD_INPUT = "bwd_x"  # split backward: recompute + input gradient (dX), Linear weight gradients deferred
WEIGHT_GRAD = "wgrad"  # split backward: the deferred Linear weight gradients (dW) of all micro-batches
_LETTER = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "BX", WEIGHT_GRAD: "W"}


@dataclass(frozen=True)
class Task:
    kind: str  # FORWARD, BACKWARD, BACKWARD_INPUT or WEIGHT_GRAD
    unit: int
    micro_batches: tuple[int, ...]  # in the order they are stacked when batched

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, int):
            object.__setattr__(self, "micro_batches", (self.micro_batches,))
        else:
            object.__setattr__(self, "micro_batches", tuple(self.micro_batches))

    def __repr__(self) -> str:
        micro = ",".join(map(str, self.micro_batches))
        return f"{_LETTER[self.kind]}({self.unit},{micro})"

    @property
    def backward(self) -> bool:
        """A task that back-propagates through its unit (the split's input-gradient part included)."""
        return self.kind in (BACKWARD, BACKWARD_INPUT)


def _snake_order(unit: int, num_micro: int) -> tuple[int, ...]:
    # Even units run micro-batches upward, odd units downward: at every unit boundary (and at the
    # forward->backward turn) the next task uses the micro-batch that was just finished.
    return tuple(range(num_micro)) if unit % 2 == 0 else tuple(range(num_micro - 1, -1, -1))


def _pass(kind: str, units: range, num_micro: int, batched: bool) -> list[Task]:
    if batched:
        return [Task(kind, u, _snake_order(u, num_micro)) for u in units]
    return [Task(kind, u, (m,)) for u in units for m in _snake_order(u, num_micro)]


def _split_pass(units: range, num_micro: int) -> list[Task]:
    tasks = []
    for u in units:
        order = _snake_order(u, num_micro)
        tasks += [Task(BACKWARD_INPUT, u, (m,)) for m in order] + [Task(WEIGHT_GRAD, u, order)]
    return tasks


def _backward_units(num_units: int, first_backward: int) -> range:
    # Units below ``first_backward`` hold nothing trainable and feed nothing trainable: no backward. The
    # last unit's task always runs (it is the forward of the last unit, the head and the loss).
    return range(num_units - 1, min(first_backward, num_units - 1) - 1, -1)


def vertical_tasks(num_units: int, num_micro: int, batched_forward: bool = False,
                   batched_backward: bool = False, first_backward: int = 0, split_backward: bool = False) -> list[Task]:
    """The GreedySnake order: every micro-batch of a unit before moving to the next unit."""
    _check(num_units, num_micro)
    if split_backward and batched_backward:
        raise ValueError("split_backward and batched_backward are two ways to run a unit's backward; pick one")
    backward_units = _backward_units(num_units, first_backward)
    backward = (_split_pass(backward_units, num_micro) if split_backward
                else _pass(BACKWARD, backward_units, num_micro, batched_backward))
    return _pass(FORWARD, range(num_units - 1), num_micro, batched_forward) + backward


def horizontal_tasks(num_units: int, num_micro: int, first_backward: int = 0) -> list[Task]:
    """Gradient accumulation: each micro-batch runs through every unit, forward then backward."""
    _check(num_units, num_micro)
    tasks = []
    for m in range(num_micro):
        tasks += [Task(FORWARD, u, (m,)) for u in range(num_units - 1)]
        tasks += [Task(BACKWARD, u, (m,)) for u in _backward_units(num_units, first_backward)]
    return tasks


def build_tasks(kind: str, num_units: int, num_micro: int, batched_forward: bool = False,
                batched_backward: bool = False, first_backward: int = 0, split_backward: bool = False) -> list[Task]:
    if kind == "vertical":
        return vertical_tasks(num_units, num_micro, batched_forward, batched_backward, first_backward, split_backward)
    if kind == "horizontal":
        if batched_forward or batched_backward or split_backward:
            raise ValueError("batched passes and the split backward need schedule.kind='vertical'")
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
    """The next ``depth`` distinct units after task ``index``'s own, in task order (what to prefetch).

    A ``W`` task holds no weights (its unit's buffer is given back before it runs), so from it one more
    unit is fetched ahead: the buffer it frees is used at once."""
    if tasks[index].kind == WEIGHT_GRAD:
        depth += 1
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
