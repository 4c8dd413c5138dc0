"""Task orders (pure data) and the engine really following them during a training step.

greedysnake.md section 3: vertical = every micro-batch of a unit before the next unit, snake-ordered
micro-batches (even units upward, odd units downward); forward covers units 0..N-2, backward N-1..0,
the last unit's backward task is fused with its forward (never recomputed).
"""
from __future__ import annotations

import lightning as L
import pytest
import torch

from snake_strategy import gpt
from snake_strategy.schedule import (
    BACKWARD,
    BACKWARD_INPUT,
    FORWARD,
    WEIGHT_GRAD,
    Task,
    build_tasks,
    horizontal_tasks,
    vertical_tasks,
    weight_fetches,
)
from tests.helpers import SMALL_GPT, run_snake


def as_tuples(tasks: list[Task]) -> list[tuple[str, int, int]]:
    """One (kind, unit, micro-batch) per micro-batch of each task, in order."""
    return [(t.kind, t.unit, m) for t in tasks for m in t.micro_batches]


# ---------------------------------------------------------------------------------------- pure orders
def test_vertical_order_n4_m3_matches_design_example():
    fwd = [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    bwd = [(3, 2), (3, 1), (3, 0), (2, 0), (2, 1), (2, 2), (1, 2), (1, 1), (1, 0), (0, 0), (0, 1), (0, 2)]
    expected = [(FORWARD, u, m) for u, m in fwd] + [(BACKWARD, u, m) for u, m in bwd]
    assert as_tuples(vertical_tasks(4, 3)) == expected
    assert as_tuples(build_tasks("vertical", 4, 3)) == expected


def test_vertical_turning_points_reuse_the_micro_batch_just_finished():
    # At every unit boundary and at the forward->backward turn the next task uses the same micro-batch.
    for n in range(1, 7):
        for m in range(1, 6):
            tasks = vertical_tasks(n, m)
            for prev, nxt in zip(tasks, tasks[1:]):
                if prev.unit != nxt.unit or prev.kind != nxt.kind:
                    assert nxt.micro_batches == prev.micro_batches, (n, m, prev, nxt)


def test_horizontal_order_n3_m2():
    expected = [
        (FORWARD, 0, 0), (FORWARD, 1, 0), (BACKWARD, 2, 0), (BACKWARD, 1, 0), (BACKWARD, 0, 0),
        (FORWARD, 0, 1), (FORWARD, 1, 1), (BACKWARD, 2, 1), (BACKWARD, 1, 1), (BACKWARD, 0, 1),
    ]
    assert as_tuples(horizontal_tasks(3, 2)) == expected
    assert as_tuples(build_tasks("horizontal", 3, 2)) == expected


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
@pytest.mark.parametrize("n,m", [(1, 1), (1, 4), (2, 1), (4, 3), (5, 2), (6, 5)])
def test_every_task_runs_exactly_once(kind, n, m):
    tasks = build_tasks(kind, n, m)
    expected = {(FORWARD, u, mb) for u in range(n - 1) for mb in range(m)}
    expected |= {(BACKWARD, u, mb) for u in range(n) for mb in range(m)}
    assert len(tasks) == len(expected) == m * (2 * n - 1)
    assert set(as_tuples(tasks)) == expected
    # Data dependencies: F(u, mb) after F(u-1, mb); B(u, mb) after B(u+1, mb) and after F(n-2, mb).
    pos = {t: i for i, t in enumerate(as_tuples(tasks))}
    for mb in range(m):
        for u in range(1, n - 1):
            assert pos[(FORWARD, u - 1, mb)] < pos[(FORWARD, u, mb)]
        for u in range(n - 1):
            assert pos[(BACKWARD, u + 1, mb)] < pos[(BACKWARD, u, mb)]
        if n > 1:
            assert pos[(FORWARD, n - 2, mb)] < pos[(BACKWARD, n - 1, mb)]


@pytest.mark.parametrize("n,m", [(1, 1), (1, 3), (2, 1), (2, 2), (4, 3), (4, 4), (7, 5)])
def test_weight_fetch_counts(n, m):
    vertical = weight_fetches(vertical_tasks(n, m))
    horizontal = weight_fetches(horizontal_tasks(n, m))
    assert len(vertical) == 2 * n - 1
    assert len(horizontal) == m * (2 * n - 1) - (m - 1)
    # Vertical: each unit once per pass; the last unit only once (its backward is fused with its forward).
    assert vertical == list(range(n - 1)) + list(range(n - 1, -1, -1))


def test_weight_fetches_of_explicit_sequence():
    tasks = [Task(FORWARD, 0, 0), Task(FORWARD, 0, 1), Task(BACKWARD, 1, 1), Task(BACKWARD, 0, 1), Task(BACKWARD, 0, 0)]
    assert weight_fetches(tasks) == [0, 1, 0]
    assert weight_fetches([]) == []


def test_single_unit_has_only_fused_backward_tasks():
    assert as_tuples(vertical_tasks(1, 3)) == [(BACKWARD, 0, 0), (BACKWARD, 0, 1), (BACKWARD, 0, 2)]
    assert as_tuples(horizontal_tasks(1, 3)) == [(BACKWARD, 0, 0), (BACKWARD, 0, 1), (BACKWARD, 0, 2)]


def test_single_micro_batch_vertical_equals_horizontal():
    for n in (1, 2, 5):
        assert vertical_tasks(n, 1) == horizontal_tasks(n, 1)
        assert as_tuples(vertical_tasks(n, 1)) == (
            [(FORWARD, u, 0) for u in range(n - 1)] + [(BACKWARD, u, 0) for u in range(n - 1, -1, -1)]
        )


@pytest.mark.parametrize("fn", [vertical_tasks, horizontal_tasks])
@pytest.mark.parametrize("n,m", [(0, 1), (1, 0), (-1, 3), (3, -2), (0, 0)])
def test_bad_sizes_raise(fn, n, m):
    with pytest.raises(ValueError, match="unit"):
        fn(n, m)


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="diagonal"):
        build_tasks("diagonal", 3, 2)


def test_task_repr():
    assert repr(Task(BACKWARD_INPUT, 2, 1)) == "BX(2,1)"
    assert repr(Task(WEIGHT_GRAD, 2, (1, 0))) == "W(2,1,0)"
    assert repr(Task(FORWARD, 1, 2)) == "F(1,2)"
    assert repr(Task(BACKWARD, 0, 3)) == "B(0,3)"
    assert repr(Task(BACKWARD, 1, (2, 1, 0))) == "B(1,2,1,0)"


def test_batched_passes_are_explicit_tasks():
    tasks = build_tasks("vertical", 3, 2, batched_forward=True, batched_backward=True)
    assert [(t.kind, t.unit, t.micro_batches) for t in tasks] == [
        (FORWARD, 0, (0, 1)), (FORWARD, 1, (1, 0)), (BACKWARD, 2, (0, 1)), (BACKWARD, 1, (1, 0)), (BACKWARD, 0, (0, 1))]
    # Same micro-batch order as the unbatched schedule, and the same weight fetches.
    assert as_tuples(tasks) == as_tuples(build_tasks("vertical", 3, 2))
    assert weight_fetches(tasks) == weight_fetches(build_tasks("vertical", 3, 2))
    with pytest.raises(ValueError, match="vertical"):
        build_tasks("horizontal", 3, 2, batched_backward=True)


# ---------------------------------------------------------------------------------------- real runs
BLOCK_CALLS = {"no_grad": 0, "grad": 0}


def _count_block_call(block, args, output):
    # The schedule's calls only: the setup check of the output contract runs the blocks on meta tensors (no
    # compute), and the first batched task's sample-independence check runs one unit in eval mode.
    if args[0].is_meta or not block.training:
        return
    key = "grad" if torch.is_grad_enabled() else "no_grad"
    BLOCK_CALLS[key] += 1


class CountingGPT(gpt.GPTModule):
    """Counts block calls, split by grad mode (forward tasks run under no_grad), with forward hooks."""

    def configure_model(self):
        super().configure_model()
        for block in self.blocks:
            block.register_forward_hook(_count_block_call)


@pytest.fixture
def block_calls():
    BLOCK_CALLS.update(no_grad=0, grad=0)
    return BLOCK_CALLS


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
@pytest.mark.parametrize("blocks_per_unit", [1, 2, 4])
def test_block_forward_calls_in_one_step(block_calls, kind, blocks_per_unit):
    micro = 3
    k, num_units = blocks_per_unit, SMALL_GPT.num_layers // blocks_per_unit
    run_snake(SMALL_GPT, 1, micro, 1, "32-true", schedule_kind=kind, blocks_per_unit=k, module_cls=CountingGPT)
    # Forward tasks: units 0..N-2 for every micro-batch, without grad.
    assert block_calls["no_grad"] == micro * (num_units - 1) * k
    # Backward tasks: units 0..N-2 recomputed, the last unit computed once (fused), all with grad.
    assert block_calls["grad"] == micro * num_units * k
    assert block_calls["no_grad"] + block_calls["grad"] == micro * (2 * num_units - 1) * k


@pytest.mark.parametrize("blocks_per_unit", [1, 2])
def test_block_forward_calls_with_batched_backward(block_calls, blocks_per_unit):
    # batched_backward recomputes each unit once over all its micro-batches (one batched call per block).
    micro = 3
    k, num_units = blocks_per_unit, SMALL_GPT.num_layers // blocks_per_unit
    run_snake(SMALL_GPT, 1, micro, 1, "32-true", blocks_per_unit=k, schedule_extra={"batched_backward": True},
              module_cls=CountingGPT)
    assert block_calls["no_grad"] == micro * (num_units - 1) * k
    assert block_calls["grad"] == num_units * k


class TraceRecorder(L.Callback):
    """Copies the engine's public task trace after every step."""

    def __init__(self) -> None:
        self.steps: list[list[Task]] = []

    def on_train_batch_end(self, trainer, *args):
        self.steps.append(list(trainer.strategy.engine.trace.last.tasks))


@pytest.mark.parametrize("kind,batched,split", [("vertical", False, False), ("horizontal", False, False),
                                                ("vertical", True, False), ("vertical", False, True)])
def test_engine_executes_the_schedule_in_order(kind, batched, split):
    rec = TraceRecorder()
    extra = {"batched_forward": True, "batched_backward": True} if batched else {}
    extra["split_backward"] = split
    run_snake(SMALL_GPT, 2, 3, 1, "32-true", schedule_kind=kind, schedule_extra=extra, callbacks=[rec])
    one_step = build_tasks(kind, SMALL_GPT.num_layers, 3, batched, batched, split_backward=split)
    assert rec.steps == [one_step, one_step]
