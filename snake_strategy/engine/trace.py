"""A cheap, public record of what the engine did in its last steps: the tasks it ran, in order, and the
weight fetches with their timing. Tests and telemetry read it instead of patching internals.

Appending a tuple per event costs well under a microsecond; a step has a few hundred events at most.

With ``enabled`` set (``GreedySnakeStrategy(trace_path=...)``), every thread of the engine also records
timed spans: the main thread's tasks and waits, the prefetch thread's waits, the optimizer worker's
unit parts and chunks, and each SSD chunk on the I/O threads. ``snake_strategy.timeline`` turns them
into a Chrome/Perfetto trace. Disabled (the default), a recording site costs one boolean check: callers
test ``trace.enabled`` before they read a clock, and ``span`` returns at once.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from snake_strategy.schedule import Task

# Span categories: what kind of work a span is (its lane is the thread that recorded it).
TASK, IO, OPTIMIZER, WAIT = "task", "io", "optimizer", "wait"


@dataclass(frozen=True)
class FetchRecord:
    """One fetch of a unit's weights: when it was issued, when it finished, and when compute needed it."""

    unit: int
    prefetched: bool  # issued ahead of use by the prefetch thread (False: fetched on demand)
    issued_s: float
    done_s: float
    needed_s: float  # when the task that uses it asked for it
    started_s: float  # when the fetching thread began it (later than issued_s while the thread was busy)

    @property
    def exposed_s(self) -> float:
        """Seconds compute waited for this fetch (0 when it was ready in time)."""
        return max(0.0, self.done_s - self.needed_s)


@dataclass(frozen=True)
class Span:
    """An interval of work or waiting on one thread (recorded only while the trace is enabled)."""

    cat: str  # TASK, IO, OPTIMIZER or WAIT
    name: str
    start_s: float  # time.perf_counter() seconds
    end_s: float
    thread: str  # the recording thread's name: the timeline's lane
    args: dict[str, Any]


@dataclass
class StepTrace:
    tasks: list[Task] = field(default_factory=list)
    fetches: list[FetchRecord] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    index: int = 0  # 1 for the run's first step
    start_s: float = 0.0
    end_s: float | None = None  # the end of its optimizer step (None while it runs)


class TaskTrace:
    """``steps[-1]`` is the last step; ``keep`` steps are retained (the older ones are dropped).

    Work recorded between two steps (the optimizer worker finishing, validation, a checkpoint) belongs
    to the earlier one: records go to the newest step whenever they arrive. Nothing is recorded before
    the first step.
    """

    def __init__(self, keep: int = 4, enabled: bool = False) -> None:
        self.keep = keep
        self.enabled = enabled  # record timed spans (a timeline); tasks and fetches are always recorded
        self.steps: list[StepTrace] = []
        self._count = 0
        self._lock = threading.Lock()  # records arrive from the prefetch, optimizer and I/O threads

    def begin_step(self) -> None:
        with self._lock:
            self._count += 1
            self.steps.append(StepTrace(index=self._count, start_s=time.perf_counter()))
            del self.steps[:-self.keep]

    def end_step(self) -> None:
        """The step's optimizer phase is over (its timeline slice ends here)."""
        with self._lock:
            if self.steps:
                self.steps[-1].end_s = time.perf_counter()

    def task(self, task: Task) -> None:
        self.steps[-1].tasks.append(task)

    def fetch(self, record: FetchRecord) -> None:
        with self._lock:
            if self.steps:
                self.steps[-1].fetches.append(record)

    def span(self, cat: str, name: str, start_s: float, end_s: float | None = None, **args: Any) -> None:
        """Record ``[start_s, end_s)`` (end: now) on the calling thread, when enabled."""
        if not self.enabled:
            return
        end_s = time.perf_counter() if end_s is None else end_s
        record = Span(cat, name, start_s, end_s, threading.current_thread().name, args)
        with self._lock:
            if self.steps:
                self.steps[-1].spans.append(record)

    def snapshot(self) -> list[StepTrace]:
        """Copies of the retained steps, consistent while worker threads keep recording."""
        with self._lock:
            return [StepTrace(list(s.tasks), list(s.fetches), list(s.spans), s.index, s.start_s, s.end_s)
                    for s in self.steps]

    @property
    def last(self) -> StepTrace:
        return self.steps[-1] if self.steps else StepTrace()
