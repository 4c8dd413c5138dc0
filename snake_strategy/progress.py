"""Progress of long work: events for every long phase (materialization, pretrained loading, checkpoint
save / verify / load, consolidation, export, and an optimizer step that runs long), reported as log
lines and to listeners.

At real sizes these phases take minutes: without a word a user cannot tell working from hung. A
``Progress`` reporter hands out one tracker per phase; the code doing the work advances it by units
(or files, tensors) and bytes, and the reporter turns that into ``ProgressEvent`` objects with the
rate and an ETA (from a predicted duration while the prediction holds, else from the observed rate).

Two outlets:

- ``listeners``: callables that receive every event (tests capture events there without parsing logs);
- what a person reads, only for work that lasts (tqdm's ``delay``): a phase that ends within ``delay_s``
  writes one summary line ("checkpoint_save: done, 14/14 files, 10 MB in 0.0 s"), nothing else. One that
  runs longer shows its progress: on a terminal (stderr ``isatty``) a tqdm bar (Lightning's own
  dependency), else log lines on the ``snake_strategy.progress`` logger at a bounded cadence (the
  phase's first event once ``delay_s`` has passed, then at most one line every ``every_s`` seconds),
  which is what log files and CI keep; its end is the same summary line. ``log=None`` (the strategy's
  default) follows the Trainer's ``enable_progress_bar``, so ``enable_progress_bar=False`` silences
  lines and bars (listeners still get events), as does raising the logger's level. When nothing
  configured logging, the lines go to stderr through a handler of their own, as Lightning does.

An optimizer step is the hot path: its tracker costs one clock read per task and reports nothing, to
listeners or log, until the step has run longer than ``every_s``; then "step N: task i/T (F unit u)"
lines appear at the same cadence, and an end event closes such a long step.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

from snake_strategy.schedule import FORWARD, Task

LOGGER_NAME = "snake_strategy.progress"
log = logging.getLogger(LOGGER_NAME)

START, UPDATE, END = "start", "update", "end"


@dataclass(frozen=True)
class ProgressEvent:
    """One report of a phase. ``done``/``total`` count ``what`` (units, files, tensors, tasks)."""

    phase: str  # "materialize", "load_pretrained", "checkpoint_save", ..., "step"
    label: str  # what the line starts with: the phase, or "step 12" for a step
    stage: str  # START, UPDATE or END
    done: int
    total: int
    what: str
    done_bytes: int
    total_bytes: int  # 0 when the phase does not count bytes
    elapsed_s: float
    eta_s: float | None  # None until there is a prediction or a rate to go by
    eta_source: str  # "predicted", "rate" or "" (no ETA)
    detail: str = ""  # the step's current task, e.g. "F unit 3"

    @property
    def bytes_per_s(self) -> float | None:
        return self.done_bytes / self.elapsed_s if self.done_bytes and self.elapsed_s > 0 else None

    @property
    def message(self) -> str:
        """The log line of this event."""
        if self.stage == END:
            text = f"{self.label}: done, {self.done}/{self.total} {self.what}"
            if self.done_bytes:
                text += f", {format_bytes(self.done_bytes)}"
            text += f" in {self.elapsed_s:.1f} s"
            if self.bytes_per_s is not None:
                text += f" ({format_bytes(self.bytes_per_s)}/s)"
            return text
        if self.detail:
            # The item now running: "step 3: task 17/40 (B unit 2)".
            text = f"{self.label}: {self.what.removesuffix('s')} {self.done}/{self.total} ({self.detail})"
        else:
            text = f"{self.label}: {self.done}/{self.total} {self.what}"
        if self.total_bytes:
            text += (f" ({format_bytes(self.total_bytes)})" if self.stage == START
                     else f", {format_bytes(self.done_bytes)} of {format_bytes(self.total_bytes)}")
        if self.stage == UPDATE:
            text += f", {self.elapsed_s:.1f} s"
            if self.bytes_per_s is not None:
                text += f", {format_bytes(self.bytes_per_s)}/s"
        if self.eta_s is not None:
            text += f", ETA {_format_duration(self.eta_s)}" + (" (predicted)" if self.eta_source == "predicted" else "")
        return text


Listener = Callable[[ProgressEvent], None]


class Progress:
    """The reporter: hands out phase trackers and sends their events to ``listeners`` and the log.

    Args:
        log: True writes log lines, False never does; None follows the Trainer's ``enable_progress_bar``
            inside ``Trainer.fit`` (the strategy calls ``follow_progress_bar``) and logs outside one.
        every_s: at most one log line per phase every this many seconds (besides its first and last),
            and how long a step runs before it reports at all.
        listeners: callables that receive every ``ProgressEvent`` (also ``progress.listeners.append``).
        clock: seconds as a float (``time.perf_counter``); tests substitute a fake one.
        delay_s: a phase shows progress (bar or lines) only once it has run this long; a shorter one writes
            its summary line only. 0 shows every phase from its start.
        bar: True draws a tqdm bar on stderr for work that lasts, False writes log lines, None (default)
            draws a bar when stderr is a terminal.
    """

    def __init__(self, log: bool | None = None, every_s: float = 5.0, listeners: list[Listener] | None = None,
                 clock: Callable[[], float] = time.perf_counter, delay_s: float = 2.0,
                 bar: bool | None = None) -> None:
        if not every_s > 0:
            raise ValueError(f"Progress(every_s={every_s}) must be a positive number of seconds (5 by default); "
                             "to silence the lines use log=False or Trainer(enable_progress_bar=False)")
        if not delay_s >= 0:
            raise ValueError(f"Progress(delay_s={delay_s}) must be >= 0 seconds (2 by default): how long work runs "
                             "before its progress is shown")
        if log not in (True, False, None):
            raise ValueError(f"Progress(log={log!r}) must be True (write lines), False (never) or None (follow the "
                             "Trainer's enable_progress_bar)")
        if bar not in (True, False, None):
            raise ValueError(f"Progress(bar={bar!r}) must be True (a bar on stderr), False (log lines) or None (a bar "
                             "when stderr is a terminal)")
        self.log = log
        self.every_s = float(every_s)
        self.delay_s = float(delay_s)
        self.bar = bar
        self.listeners: list[Listener] = list(listeners or [])
        # Predicted seconds per phase, e.g. the planner's step floor under "step": the ETA uses it while
        # the phase has not outrun it (afterwards the observed rate says more).
        self.predictions: dict[str, float] = {}
        self.clock = clock
        self._progress_bar = True
        self._group: list[str] | None = None  # summaries of short phases inside ``group``, written as one line

    @contextlib.contextmanager
    def group(self, label: str) -> Iterator[None]:
        """The phases of one piece of work (a save: write, verify, consolidate): each that ends within
        ``delay_s`` writes no summary line of its own; one line names them all at the end ("consolidate: done
        in 0.1 s (checkpoint_verify: done, ...; consolidate_write: done, ...)"). A phase that lasts shows
        its progress and its summary as usual. Nested groups: the outer one writes the line."""
        if self._group is not None:
            yield
            return
        self._group, start_s = [], self.clock()
        try:
            yield
        finally:
            parts, self._group = self._group, None
        if parts and self.logs:
            self.write_line(f"{label}: done in {self.clock() - start_s:.1f} s ({'; '.join(parts)})")

    def follow_progress_bar(self, enabled: bool) -> None:
        """With ``log=None``: write lines exactly when the Trainer shows its progress bar."""
        self._progress_bar = enabled

    @property
    def logs(self) -> bool:
        return self._progress_bar if self.log is None else self.log

    @property
    def active(self) -> bool:
        """Whether anything would receive an event (the hot path skips all work when not)."""
        return self.logs or bool(self.listeners)

    def phase(self, phase: str, total: int, what: str = "units", total_bytes: int = 0) -> PhaseProgress:
        """Start tracking ``total`` items (``what``) of a phase; emits its first event now."""
        return PhaseProgress(self, phase, phase, total, what, total_bytes)

    def step(self, step: int, total_tasks: int) -> StepProgress | None:
        """A tracker for optimizer step ``step``'s task loop, or None when nobody listens (no cost)."""
        if not self.active:
            return None
        return StepProgress(self, step, total_tasks)

    @property
    def bars(self) -> bool:
        """Whether lasting work is drawn as a bar (a terminal) rather than written as log lines."""
        if self.bar is not None:
            return self.bar
        isatty = getattr(sys.stderr, "isatty", None)
        return bool(isatty and isatty())

    def emit(self, event: ProgressEvent) -> None:
        for listener in list(self.listeners):
            listener(event)

    def write_line(self, message: str) -> None:
        _ensure_visible(log)
        log.info(message)


def or_quiet(progress: Progress | None) -> Progress:
    """``progress``, or a reporter that writes no lines: the default of library calls (``save``,
    ``consolidate``, ``SnakeEngine``), so existing callers stay silent."""
    return progress if progress is not None else Progress(log=False)


class _Tracker:
    """What a phase and a step share: timing, the ETA, and how a person sees it (summary, lines or a bar)."""

    def __init__(self, progress: Progress, phase: str, label: str, total: int, what: str, total_bytes: int) -> None:
        self.progress, self.phase, self.label, self.what = progress, phase, label, what
        self.total, self.total_bytes = int(total), int(total_bytes)
        self.done, self.done_bytes = 0, 0
        self.start_s = progress.clock()
        self.next_line_s = self.start_s + progress.delay_s  # no line before the work has lasted delay_s
        self.finished = False
        self.shown = False  # progress (beyond the summary) has been shown
        self._first: ProgressEvent | None = None  # the start event, written late when the work lasts
        self._bar: Any = None

    def _event(self, stage: str, now_s: float, detail: str = "", shown_done: int | None = None) -> ProgressEvent:
        elapsed_s = now_s - self.start_s
        eta_s, source = None, ""
        if stage != END:
            eta_s, source = _eta(elapsed_s, self._fraction(), self.progress.predictions.get(self.phase))
        done = self.done if shown_done is None else shown_done
        return ProgressEvent(self.phase, self.label, stage, done, self.total, self.what, self.done_bytes,
                             self.total_bytes, elapsed_s, eta_s, source, detail)

    def _fraction(self) -> float:
        # Bytes say more than item counts where items differ in size (meta.pt vs a unit file).
        if self.total_bytes:
            return min(1.0, self.done_bytes / self.total_bytes)
        return min(1.0, self.done / self.total) if self.total else 0.0

    def _report(self, stage: str, now_s: float, detail: str = "", shown_done: int | None = None) -> None:
        if not self.progress.active:
            return
        event = self._event(stage, now_s, detail, shown_done)
        self.progress.emit(event)
        if self.progress.logs:
            self._show(event, now_s)

    def _show(self, event: ProgressEvent, now_s: float) -> None:
        """The reader's view: the summary line at the end; before it, nothing until the work has lasted
        ``delay_s``, then a bar (a terminal) or lines at the ``every_s`` cadence."""
        progress = self.progress
        if event.stage == START:
            self._first = event
        if event.stage == END:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if progress._group is not None and not self.shown:
                progress._group.append(event.message)  # a short phase of a group: its line comes at the end
                return
            progress.write_line(event.message)
            return
        if not self.shown:
            if now_s - self.start_s < progress.delay_s:
                return
            self.shown = True
            if progress.bars:
                self._bar = _open_bar(self)
            elif self._first is not None and self._first is not event:
                progress.write_line(self._first.message)  # how the work started, now that it lasts
                self.next_line_s = self.start_s + progress.every_s
        if self._bar is not None:
            _update_bar(self._bar, self, event)
        elif now_s >= self.next_line_s:
            self.next_line_s = now_s + progress.every_s
            progress.write_line(event.message)


class PhaseProgress(_Tracker):
    """Progress of one phase: ``advance`` after each item, ``finish`` at the end (or use ``with``)."""

    def __init__(self, progress: Progress, phase: str, label: str, total: int, what: str, total_bytes: int) -> None:
        super().__init__(progress, phase, label, total, what, total_bytes)
        self._report(START, self.start_s)

    def advance(self, items: int = 1, num_bytes: int = 0) -> None:
        self.done += items
        self.done_bytes += num_bytes
        self._report(UPDATE, self.progress.clock())

    def finish(self) -> None:
        """The end event (once). A byte total that was an estimate becomes what was actually done."""
        if self.finished:
            return
        self.finished = True
        self.total = max(self.total, self.done)
        self.total_bytes = max(self.total_bytes, self.done_bytes)
        self._report(END, self.progress.clock())

    def __enter__(self) -> PhaseProgress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A failed phase ends with its error, not with a "done" line.
        if exc_type is None:
            self.finish()
        elif self._bar is not None:
            self._bar.close()
            self._bar = None


class StepProgress(_Tracker):
    """The task loop of one optimizer step. Silent until the step has run ``every_s``: a step that is
    short reports nothing at all, not even to listeners."""

    def __init__(self, progress: Progress, step: int, total_tasks: int) -> None:
        super().__init__(progress, "step", f"step {step}", total_tasks, "tasks", 0)
        self.quiet_until_s = self.start_s + progress.every_s
        self.next_line_s = self.quiet_until_s
        self.reported = False

    def task(self, index: int, task: Task) -> None:
        """Task ``index`` (0-based) of the list is about to run."""
        now_s = self.progress.clock()
        if now_s < self.quiet_until_s:
            return  # the common case: one clock read
        self.quiet_until_s = now_s + (0.0 if self.progress.bars else self.progress.every_s)
        self.done = index  # tasks completed: what the ETA goes by
        self.reported = True
        kind = "F" if task.kind == FORWARD else "B"
        # The line shows the task now running, numbered from 1 ("1/T" is the first).
        self._report(UPDATE, now_s, f"{kind} unit {task.unit}", shown_done=index + 1)

    def finish(self) -> None:
        """Close a step that reported (a short one stays silent)."""
        if self.finished:
            return
        self.finished = True
        if self.reported:
            self.done = self.total
            self._report(END, self.progress.clock())


def _open_bar(tracker: _Tracker) -> Any:
    from tqdm import tqdm  # Lightning's dependency; imported only when a bar is drawn

    in_bytes = bool(tracker.total_bytes)
    return tqdm(total=tracker.total_bytes if in_bytes else tracker.total, desc=tracker.label, file=sys.stderr,
                unit="B" if in_bytes else f" {tracker.what}", unit_scale=in_bytes, unit_divisor=1000,
                leave=False, dynamic_ncols=True)


def _update_bar(bar: Any, tracker: _Tracker, event: ProgressEvent) -> None:
    bar.n = event.done_bytes if tracker.total_bytes else event.done
    if event.detail:
        bar.set_postfix_str(event.detail, refresh=False)
    bar.refresh()


def _eta(elapsed_s: float, fraction: float, predicted_s: float | None) -> tuple[float | None, str]:
    if predicted_s is not None and elapsed_s < predicted_s:
        return predicted_s - elapsed_s, "predicted"
    if fraction > 0 and elapsed_s > 0:
        return elapsed_s * (1.0 - fraction) / fraction, "rate"
    return None, ""


def format_bytes(num_bytes: float, binary: bool = False) -> str:
    """Bytes for a person: three significant digits in decimal units (GB, MB, kB), or in binary ones (GiB,
    MiB, KiB) for disk space, as ``du -h`` shows it."""
    units = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if binary else (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
    for unit, size in units:
        if num_bytes >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def _format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _ensure_visible(logger: logging.Logger) -> None:
    """Without any logging configuration an INFO line would vanish (Python's last-resort handler prints
    warnings only): give the logger a stderr handler of its own, as Lightning does for its logger. A
    configured application (Hydra, basicConfig, pytest) keeps full control: nothing is added there."""
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False  # a root handler configured later must not print every line twice
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
