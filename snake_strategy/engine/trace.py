"""A cheap, public record of what the engine did in its last step: the tasks it ran, in order, and the
weight fetches with their timing. Tests and telemetry read it instead of patching internals.

Appending a tuple per event costs well under a microsecond; a step has a few hundred events at most.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from snake_strategy.schedule import Task


@dataclass(frozen=True)
class FetchRecord:
    """One fetch of a unit's weights: when it was issued, when it finished, and when compute needed it."""

    unit: int
    prefetched: bool  # issued ahead of use by the prefetch thread (False: fetched on demand)
    issued_s: float
    done_s: float
    needed_s: float  # when the task that uses it asked for it

    @property
    def exposed_s(self) -> float:
        """Seconds compute waited for this fetch (0 when it was ready in time)."""
        return max(0.0, self.done_s - self.needed_s)


@dataclass
class StepTrace:
    tasks: list[Task] = field(default_factory=list)
    fetches: list[FetchRecord] = field(default_factory=list)


class TaskTrace:
    """``steps[-1]`` is the last step; ``keep`` steps are retained (the older ones are dropped)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.steps: list[StepTrace] = []
        self._lock = threading.Lock()  # fetch records arrive from the prefetch thread

    def begin_step(self) -> None:
        with self._lock:
            self.steps.append(StepTrace())
            del self.steps[:-self.keep]

    def task(self, task: Task) -> None:
        self.steps[-1].tasks.append(task)

    def fetch(self, record: FetchRecord) -> None:
        with self._lock:
            if self.steps:
                self.steps[-1].fetches.append(record)

    @property
    def last(self) -> StepTrace:
        return self.steps[-1] if self.steps else StepTrace()

    @staticmethod
    def now() -> float:
        return time.perf_counter()
