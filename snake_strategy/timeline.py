"""The run's timeline as a Chrome/Perfetto trace: the engine's ``TaskTrace`` in the Trace Event Format.

``GreedySnakeStrategy(trace_path="run.json")`` records timed spans on every engine thread and writes
them here at teardown; open the file in https://ui.perfetto.dev or chrome://tracing. One lane (``tid``)
per thread, each with a ``thread_name`` metadata event:

- ``steps``: one slice per optimizer step, from its first task to the end of its optimizer step;
- ``compute``: the thread that ran the schedule: one slice per task (``F(unit,micro)`` /
  ``B(unit,micro)``), with the waits inside it (weights, checkpoint reads and writes, backpressure on a
  pooled buffer), on-demand weight fetches, and the end-of-step ``wait optimizer``;
- ``prefetch``: the prefetch thread's weight fetches (from ``FetchRecord``: the slice runs from when the
  thread began the fetch to when it finished; when it was issued, how long it queued and how long compute
  waited for it are in its args), and its waits (the unit's deferred update, a free buffer);
- ``optimizer``: the worker's backward and forward parts of each unit, with their chunks inside;
- ``ssd io N``: every SSD chunk each I/O thread moved (direction, state, bytes).

Slices on one lane never overlap partially (each thread does one thing at a time; waits nest in the
work that waited), which the Trace Event Format's complete events ("ph": "X") require. Times are
microseconds from the first exported step's start. Reading back: ``read_trace``, ``lanes`` and
``step_breakdown`` (busy seconds per resource, to set next to ``time_model.predict``).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable

from snake_strategy.engine.trace import IO, OPTIMIZER, TASK, WAIT, StepTrace, TaskTrace

STEPS, COMPUTE, PREFETCH, OPTIMIZER_LANE, SSD_IO = "steps", "compute", "prefetch", "optimizer", "ssd io"
FETCH = "fetch"  # the category of weight-fetch slices (from FetchRecords)
PID = 1
log = logging.getLogger(__name__)
# Thread-name prefixes of the engine's worker threads (their ThreadPoolExecutor prefixes) -> lane.
_WORKER_LANES = (("snake-prefetch", PREFETCH), ("snake-optim", OPTIMIZER_LANE), ("snake-io", SSD_IO))


def check_trace_path(path: str | os.PathLike) -> Path:
    """The trace file's path, refused early (before training) when it cannot be a writable file."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ValueError(f"trace_path='{path}' is a directory; give a file name, e.g. trace_path='{target / 'run.json'}'")
    parent = next((p for p in [target.parent, *target.parent.parents] if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(f"trace_path='{path}' cannot be written ({parent} is not a writable directory); "
                         "point trace_path at a file in a directory you can write to")
    return target


def _lane(thread: str, compute_thread: str) -> str:
    for prefix, lane in _WORKER_LANES:
        if thread.startswith(prefix):
            # ThreadPoolExecutor names its threads "<prefix>_<n>": one SSD lane per I/O thread.
            return f"{SSD_IO} {thread.rsplit('_', 1)[-1]}" if lane == SSD_IO else lane
    return COMPUTE if thread == compute_thread else thread


def _sort_key(lane: str) -> tuple[int, str]:
    order = {STEPS: 0, COMPUTE: 1, PREFETCH: 2, OPTIMIZER_LANE: 3}
    if lane in order:
        return order[lane], ""
    return (4, lane.zfill(12)) if lane.startswith(SSD_IO) else (5, lane)


def trace_events(steps: Iterable[StepTrace] | TaskTrace) -> list[dict[str, Any]]:
    """Trace Event Format events of the given steps: complete events ("ph": "X") and lane metadata."""
    steps = steps.snapshot() if isinstance(steps, TaskTrace) else list(steps)
    if not steps:
        return []
    origin = steps[0].start_s
    compute_thread = next((s.thread for step in steps for s in step.spans if s.cat == TASK), "MainThread")
    tids: dict[str, int] = {STEPS: 0, COMPUTE: 1}  # the others numbered as they first appear
    events: list[dict[str, Any]] = []

    def slice_(lane: str, cat: str, name: str, start_s: float, end_s: float, step: int, **args: Any) -> float:
        tid = tids.setdefault(lane, len(tids))
        ts, end = _us(start_s - origin), _us(end_s - origin)
        events.append({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": max(0.0, round(end - ts, 3)),
                       "pid": PID, "tid": tid, "args": {"step": step, **args}})
        return end_s

    for step in steps:
        ends = [step.start_s]
        for f in step.fetches:
            lane = PREFETCH if f.prefetched else COMPUTE
            ends.append(slice_(lane, FETCH, f"fetch u{f.unit}", f.started_s, f.done_s, step.index, unit=f.unit,
                               prefetched=f.prefetched, issued_us=_us(f.issued_s - origin),
                               queued_us=_us(f.started_s - f.issued_s), exposed_us=_us(f.exposed_s)))
            if f.prefetched and f.exposed_s > 0:
                # Compute asked before the prefetch was done: the weights wait, on the compute lane.
                slice_(COMPUTE, WAIT, f"wait weights u{f.unit}", f.needed_s, f.done_s, step.index, unit=f.unit)
        for s in step.spans:
            ends.append(slice_(_lane(s.thread, compute_thread), s.cat, s.name, s.start_s, s.end_s, step.index,
                               **s.args))
        end_s = step.end_s if step.end_s is not None else max(ends)
        slice_(STEPS, "step", f"step {step.index}", step.start_s, end_s, step.index, tasks=len(step.tasks),
               fetches=len(step.fetches))
    meta = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "snake_strategy"}}]
    for lane, tid in tids.items():
        meta.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": lane}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                     "args": {"sort_index": _sort_key(lane)[0] * 100 + tid}})
    # Parents before children at equal start times: viewers nest slices in file order.
    events.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    return meta + events


def write_trace(path: str | os.PathLike, trace: TaskTrace | Iterable[StepTrace]) -> Path:
    """Write the trace file (JSON Object Format: ``{"traceEvents": [...]}``); returns its path."""
    target = check_trace_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    document = {"traceEvents": trace_events(trace), "displayTimeUnit": "ms",
                "otherData": {"source": "snake_strategy", "time_unit": "us from the first exported step"}}
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(document))
    os.replace(partial, target)  # a reader never sees half a file
    return target


def export_trace(path: str | os.PathLike | None, trace: TaskTrace) -> Path | None:
    """``write_trace`` at the end of a run (nothing when ``path`` is None). A write error is logged, not
    raised: losing the timeline must not stop the teardown that gives the trained weights back."""
    if path is None:
        return None
    try:
        written = write_trace(path, trace)
    except OSError as err:
        log.error("could not write the timeline to trace_path=%s: %s", path, err)
        return None
    log.info("timeline written to %s (open it in https://ui.perfetto.dev or chrome://tracing)", written)
    return written


def read_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of a trace file (either the JSON Array or the JSON Object Format)."""
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def lanes(events: list[dict[str, Any]], step: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """Complete events per lane name, lanes in display order, events by start (one step, or all)."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in sorted(names.values(), key=_sort_key)}
    for e in events:
        if e.get("ph") == "X" and (step is None or e["args"].get("step") == step):
            out[names[e["tid"]]].append(e)
    return {name: sorted(evs, key=lambda e: e["ts"]) for name, evs in out.items()}


def step_breakdown(events: list[dict[str, Any]], step: int) -> dict[str, float]:
    """Seconds of one step: its length, and the busy time of each resource over it.

    ``compute``: task time on the compute lane minus its waits (and its on-demand fetches);
    ``waits``: the compute lane's waiting, inside tasks or not; ``ssd``: time at least one I/O thread was
    moving a chunk; ``optimizer``: the worker's busy time; ``prefetch``: the prefetch thread's. Only what
    falls inside the step's slice counts (work recorded after it, such as the flush at the end of
    training, does not). Comparable with ``time_model.predict``'s ``compute_s``, ``ssd_s``, ``optimizer_s``.
    """
    by_lane = lanes(events, step)
    if not by_lane.get(STEPS):
        raise ValueError(f"step={step} is not in this trace; it holds steps "
                         f"{[e['args']['step'] for e in lanes(events)[STEPS]]}")
    window = by_lane[STEPS][0]["ts"], by_lane[STEPS][0]["ts"] + by_lane[STEPS][0]["dur"]

    def intervals(lane_names: Iterable[str], cats: set[str]) -> list[tuple[float, float]]:
        clipped = [(max(e["ts"], window[0]), min(e["ts"] + e["dur"], window[1]))
                   for n in lane_names for e in by_lane.get(n, []) if e["cat"] in cats]
        return _union([(a, b) for a, b in clipped if a < b])

    tasks = intervals([COMPUTE], {TASK})
    waiting = intervals([COMPUTE], {WAIT, FETCH})
    return {
        "step": (window[1] - window[0]) / 1e6,
        "compute": (_measure(tasks) - _overlap(tasks, waiting)) / 1e6,
        "waits": _measure(waiting) / 1e6,
        "ssd": _measure(intervals([n for n in by_lane if n.startswith(SSD_IO)], {IO})) / 1e6,
        "optimizer": _measure(intervals([OPTIMIZER_LANE], {OPTIMIZER})) / 1e6,
        "prefetch": _measure(intervals([PREFETCH], {FETCH})) / 1e6,
    }


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)  # nanosecond resolution: perf_counter's, and a short file


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _measure(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
