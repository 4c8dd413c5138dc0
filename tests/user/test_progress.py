"""Progress of long work: the events of a setup, a long step, a checkpoint save, a resume and a
consolidation (counts and order), the log cadence, the quiet option and the CLI's lines."""
import itertools
import logging
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from snake_strategy import Progress, ProgressEvent
from snake_strategy import checkpoint as snake_checkpoint
from snake_strategy.gpt import GPTModule
from snake_strategy.progress import END, LOGGER_NAME, START, UPDATE
from snake_strategy.schedule import BACKWARD, FORWARD, Task, build_tasks
from tests.helpers import SMALL_GPT, token_data, trainer_kwargs

MICRO, MICRO_SIZE = 4, 2
NUM_UNITS = SMALL_GPT.num_layers  # one block per unit
# Files a checkpoint verifies: three per unit, the three non-layer vectors, nonlayer.pt and meta.pt.
CHECKPOINT_FILES = 3 * NUM_UNITS + 5
# A slowed SSD (every transfer sleeps) makes each step run far longer than the test's cadence.
SSD_DELAY_S, EVERY_S = 0.01, 0.05


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER_NAME]


def _labels(events: list[ProgressEvent]) -> list[str]:
    """The phases in the order they ran (consecutive events of one phase collapsed)."""
    return [label for label, _ in itertools.groupby(e.label for e in events)]


class SaveAt(L.Callback):
    def __init__(self, step: int, path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class SlowedFit:
    """A tiny GPT trained on an SSD tier, slowed down through the public test hooks."""

    def __init__(self, tmp_path, steps: int, progress, save_at_step: int | None = None, ckpt_path=None,
                 slow: bool = True, **trainer_extra) -> None:
        x, y = token_data(steps * MICRO * MICRO_SIZE, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
        loader = DataLoader(TensorDataset(x, y), batch_size=MICRO * MICRO_SIZE, shuffle=False)
        torch.manual_seed(0)
        hooks = snake_strategy.EngineHooks(before_ssd_transfer=(lambda direction, n: time.sleep(SSD_DELAY_S))
                                           if slow else None)
        storage = {"ssd_dir": str(tmp_path / "ssd"), "weights": {"ssd": 1.0}, "optimizer": {"ssd": 1.0}}
        self.strategy = snake_strategy.GreedySnakeStrategy(storage=storage, schedule={"kind": "vertical",
                                                                                               "num_micro_batches": MICRO},
                                                           hooks=hooks, progress=progress)
        self.checkpoint = tmp_path / "progress.ckpt"
        callbacks = [SaveAt(save_at_step, self.checkpoint)] if save_at_step else []
        kw = trainer_kwargs(**trainer_extra)
        trainer = L.Trainer(strategy=self.strategy, max_steps=steps, callbacks=callbacks, **kw)
        trainer.fit(GPTModule(SMALL_GPT), train_dataloaders=loader, ckpt_path=ckpt_path)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Two slowed steps, a save after step 2, every event captured; the Trainer's bar is off."""
    tmp_path = tmp_path_factory.mktemp("progress")
    events: list[ProgressEvent] = []
    progress = Progress(every_s=EVERY_S, listeners=[events.append])
    handler = _ListHandler()
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # a record would be made if anything logged
    try:
        fit = SlowedFit(tmp_path, steps=2, progress=progress, save_at_step=2)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return fit, events, handler.records


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# ---------------------------------------------------------------------- the reporter on its own
def test_phase_events_every_item_and_log_lines_at_the_cadence(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    clock, events = FakeClock(), []
    progress = Progress(log=True, every_s=5.0, listeners=[events.append], clock=clock)
    with progress.phase("checkpoint_save", 10, what="files", total_bytes=10_000_000) as tracker:
        for _ in range(10):
            clock.now_s += 2.0
            tracker.advance(1, 1_000_000)
    assert [e.stage for e in events] == [START] + [UPDATE] * 10 + [END]
    assert [e.done for e in events] == list(range(11)) + [10]
    middle = events[5]  # 5 files of 10 after 10 s: 10 s to go at the observed rate
    assert middle.eta_s == pytest.approx(10.0) and middle.eta_source == "rate"
    assert middle.bytes_per_s == pytest.approx(500_000)
    # Lines: the first event, then at most one per 5 s (at 6, 12, 18 s), and the end.
    lines = [r.getMessage() for r in _records(caplog)]
    assert lines == [events[0].message, events[3].message, events[6].message, events[9].message,
                     events[-1].message], lines
    assert lines[0] == "checkpoint_save: 0/10 files (10 MB)"
    assert lines[1] == "checkpoint_save: 3/10 files, 3 MB of 10 MB, 6.0 s, 500 kB/s, ETA 14 s"
    assert lines[-1] == "checkpoint_save: done, 10/10 files, 10 MB in 20.0 s (500 kB/s)"


def _run_phase(progress: Progress, clock: FakeClock, items: int, seconds_per_item: float) -> None:
    with progress.phase("checkpoint_save", items, "files", total_bytes=items * 1_000_000) as tracker:
        for _ in range(items):
            clock.now_s += seconds_per_item
            tracker.advance(1, 1_000_000)


def test_short_work_writes_one_summary_line_long_work_shows_progress(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    clock = FakeClock()
    events: list[ProgressEvent] = []
    progress = Progress(log=True, bar=False, listeners=[events.append], clock=clock)  # delay_s: 2 s by default
    _run_phase(progress, clock, items=14, seconds_per_item=0.005)  # 14 files in 0.07 s
    lines = [r.getMessage() for r in _records(caplog)]
    assert lines == ["checkpoint_save: done, 14/14 files, 14 MB in 0.1 s (200 MB/s)"], lines
    assert len(events) == 16  # listeners still get every event
    caplog.clear()
    _run_phase(progress, clock, items=10, seconds_per_item=1.0)  # 10 s: lasts past delay_s
    lines = [r.getMessage() for r in _records(caplog)]
    assert lines == ["checkpoint_save: 0/10 files (10 MB)",  # written late, at 2 s, when the work had lasted
                     "checkpoint_save: 5/10 files, 5 MB of 10 MB, 5.0 s, 1 MB/s, ETA 5 s",  # every_s: 5 s
                     "checkpoint_save: 10/10 files, 10 MB of 10 MB, 10.0 s, 1 MB/s, ETA 0 s",
                     "checkpoint_save: done, 10/10 files, 10 MB in 10.0 s (1 MB/s)"], lines


def test_a_group_of_short_phases_writes_one_line(caplog):
    """A save's phases (write, verify, consolidate) that each end within delay_s: one line for all of them;
    a phase of the group that lasts shows its own progress and summary."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    clock = FakeClock()
    progress = Progress(log=True, bar=False, clock=clock)
    with progress.group("consolidate"):
        _run_phase(progress, clock, items=3, seconds_per_item=0.01)
        _run_phase(progress, clock, items=2, seconds_per_item=0.01)
    lines = [r.getMessage() for r in _records(caplog)]
    assert len(lines) == 1 and lines[0].startswith("consolidate: done in 0.1 s (checkpoint_save: done, 3/3 files")
    assert lines[0].count("checkpoint_save: done") == 2
    caplog.clear()
    with progress.group("consolidate"):
        _run_phase(progress, clock, items=4, seconds_per_item=1.0)  # lasts: shown as usual
    lines = [r.getMessage() for r in _records(caplog)]
    assert lines[-1] == "checkpoint_save: done, 4/4 files, 4 MB in 4.0 s (1 MB/s)" and len(lines) > 1


def test_a_terminal_gets_a_bar_and_the_summary_line(caplog, capsys):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    clock = FakeClock()
    _run_phase(Progress(log=True, bar=True, clock=clock), clock, items=3, seconds_per_item=0.01)
    assert capsys.readouterr().err == ""  # short: no bar at all
    _run_phase(Progress(log=True, bar=True, clock=clock), clock, items=10, seconds_per_item=1.0)
    drawn = capsys.readouterr().err
    assert "checkpoint_save" in drawn and "10.0M/10.0M" in drawn  # tqdm's bar, in bytes
    lines = [r.getMessage() for r in _records(caplog)]
    assert [line.split(",")[0] for line in lines] == ["checkpoint_save: done"] * 2, lines  # no per-item lines


def test_a_failed_phase_ends_without_a_done_event():
    events = []
    progress = Progress(log=False, listeners=[events.append])
    with pytest.raises(OSError):
        with progress.phase("checkpoint_save", 3, what="files") as tracker:
            tracker.advance()
            raise OSError("disk full")
    assert [e.stage for e in events] == [START, UPDATE]


def test_step_is_silent_until_it_runs_long_then_reports_task_and_predicted_eta():
    clock, events = FakeClock(), []
    progress = Progress(log=False, every_s=5.0, listeners=[events.append], clock=clock)
    tasks = [Task(FORWARD, u, (0,)) for u in range(4)] + [Task(BACKWARD, u, (0,)) for u in reversed(range(5))]
    short = progress.step(1, len(tasks))
    for i, task in enumerate(tasks):
        clock.now_s += 0.5  # 4.5 s in all: shorter than the cadence
        short.task(i, task)
    short.finish()
    assert events == []
    progress.predictions["step"] = 12.0
    long = progress.step(2, len(tasks))
    for i, task in enumerate(tasks):
        clock.now_s += 2.0
        long.task(i, task)
    long.finish()
    # Tasks start at 2, 4, ..., 18 s after the step began: reports at 6, 12 and 18 s (one per 5 s at most).
    assert [(e.stage, e.done, e.detail) for e in events] == [
        (UPDATE, 3, "F unit 2"), (UPDATE, 6, "B unit 3"), (UPDATE, 9, "B unit 0"), (END, 9, "")]
    first, second = events[0], events[1]
    assert first.message == "step 2: task 3/9 (F unit 2), 6.0 s, ETA 6 s (predicted)"
    # 12 s predicted and already 12 s gone: the observed rate takes over (5 of 9 tasks done in 12 s).
    assert second.eta_source == "rate" and second.eta_s == pytest.approx(12.0 * 4 / 5)
    assert events[-1].message == "step 2: done, 9/9 tasks in 18.0 s"


def test_nobody_listening_costs_no_step_tracker():
    assert Progress(log=False).step(1, 10) is None
    assert Progress(log=False, listeners=[print]).step(1, 10) is not None


@pytest.mark.parametrize("kwargs, words", [({"every_s": 0}, "every_s=0"), ({"log": "yes"}, "log='yes'"),
                                           ({"delay_s": -1}, "delay_s=-1"), ({"bar": "auto"}, "bar='auto'")])
def test_settings_are_checked(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Progress(**kwargs)


# ---------------------------------------------------------------------- wired into the strategy
def test_setup_long_steps_save_and_export_report_in_order(saved_run):
    fit, events, records = saved_run
    assert _labels(events) == ["materialize", "step 1", "step 2", "checkpoint_save", "export"], _labels(events)
    by_phase = {phase: [e for e in events if e.phase == phase] for phase in ("materialize", "checkpoint_save", "export")}
    for phase, num, what in (("materialize", NUM_UNITS, "units"), ("checkpoint_save", 3 * NUM_UNITS + 2, "files"),
                             ("export", NUM_UNITS, "units")):
        got = by_phase[phase]
        # One event per unit (per file for the save), between a start and an end.
        assert [e.stage for e in got] == [START] + [UPDATE] * num + [END], phase
        assert [e.done for e in got[:-1]] == list(range(num + 1)) and got[-1].total == num, phase
        assert {e.what for e in got} == {what}
        assert got[-1].done_bytes == got[-1].total_bytes > 0
    num_tasks = len(build_tasks("vertical", NUM_UNITS, MICRO, False, False))
    for step in (1, 2):
        got = [e for e in events if e.label == f"step {step}"]
        # A slowed step runs far longer than the cadence: task reports, then the end.
        assert len(got) >= 2 and [e.stage for e in got] == [UPDATE] * (len(got) - 1) + [END]
        running = [e.done for e in got[:-1]]
        assert running == sorted(set(running)) and 1 <= running[0] and running[-1] <= num_tasks
        assert all(e.total == num_tasks and e.detail[:2] in ("F ", "B ") for e in got[:-1])
        assert got[-1].done == num_tasks
    # The Trainer's progress bar is off: not one log record, although the listener saw everything.
    assert records == []


def test_consolidate_reports_verify_read_and_write(saved_run, tmp_path):
    fit, _, _ = saved_run
    events = []
    out = tmp_path / "model.ckpt"
    snake_checkpoint.consolidate(fit.checkpoint, out, Progress(log=False, listeners=[events.append]))
    assert _labels(events) == ["checkpoint_verify", "consolidate", "consolidate_write"]
    counts = {phase: sum(e.stage == UPDATE for e in events if e.phase == phase) for phase in _labels(events)}
    assert counts == {"checkpoint_verify": CHECKPOINT_FILES, "consolidate": NUM_UNITS, "consolidate_write": 1}
    assert events[-1].stage == END and events[-1].done_bytes == out.stat().st_size


def test_progress_bar_on_logs_setup_and_resume_lines(saved_run, tmp_path, caplog):
    """The default reporter follows the Trainer's enable_progress_bar; a resume verifies and loads."""
    fit, _, _ = saved_run
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    SlowedFit(tmp_path, steps=3, progress=None, ckpt_path=fit.checkpoint, slow=False, enable_progress_bar=True)
    lines = [r.getMessage() for r in _records(caplog)]
    phases = [line.split(":")[0] for line in lines]
    assert [p for p, _ in itertools.groupby(phases)] == ["materialize", "checkpoint_verify", "checkpoint_load",
                                                         "export"], lines
    assert f"checkpoint_verify: done, {CHECKPOINT_FILES}/{CHECKPOINT_FILES} files" in "\n".join(lines)
    assert f"checkpoint_load: done, {NUM_UNITS}/{NUM_UNITS} units" in "\n".join(lines)


# ---------------------------------------------------------------------- the consolidation CLI
def test_cli_prints_progress_lines(saved_run, tmp_path):
    fit, _, _ = saved_run
    out = tmp_path / "cli.ckpt"
    done = subprocess.run([sys.executable, "-m", "snake_strategy.checkpoint", str(fit.checkpoint), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.split(":")[0] in
             ("checkpoint_verify", "consolidate", "consolidate_write")]
    # Work of milliseconds: one line for the whole consolidation, naming each of its phases' summaries, no
    # start or progress lines (issue 36, item 5; issue 43, item 5: one line per save, not per phase).
    assert len(lines) == 1, lines
    assert lines[0].startswith("consolidate: done in "), lines
    assert f"(checkpoint_verify: done, {CHECKPOINT_FILES}/{CHECKPOINT_FILES} files" in lines[0], lines
    assert f"; consolidate: done, {NUM_UNITS}/{NUM_UNITS} units" in lines[0], lines
    assert "; consolidate_write: done, 1/1 files" in lines[0], lines
    assert done.stdout.startswith(f"wrote {out}")


def test_cli_quiet_writes_no_progress(saved_run, tmp_path, caplog, capsys):
    fit, _, _ = saved_run
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    assert snake_checkpoint.main(["--quiet", str(fit.checkpoint), str(tmp_path / "quiet.ckpt")]) == 0
    assert _records(caplog) == []
    assert snake_checkpoint.main([str(fit.checkpoint), str(tmp_path / "loud.ckpt")]) == 0
    assert [r.getMessage().split(":")[0] for r in _records(caplog)] == ["consolidate"]
