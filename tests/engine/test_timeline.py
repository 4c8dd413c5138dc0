"""The timeline: a run with ``trace_path`` writes a Trace Event Format file whose slices are the engine's
own records (tasks one to one, fetches one to one), one lane per thread, properly nested; without it the
engine records no spans at all."""
from __future__ import annotations

import json
from collections import defaultdict

import lightning as L
import pytest
import torch
from torch import nn

from snake_strategy import GreedySnakeStrategy
from snake_strategy.timeline import check_trace_path, lanes, read_trace, step_breakdown
from tests.helpers import StackModule, fit_snake, token_loader

STEPS, MICRO = 3, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class KeepEngine(L.Callback):
    """Holds the engine (its trace outlives the strategy's teardown)."""

    def on_train_end(self, trainer, pl_module):
        self.engine = trainer.strategy.engine


def _run(tmp_path, trace_path=None) -> KeepEngine:
    keep = KeepEngine()
    # Everything on the SSD and two middle micro-batches' checkpoints too: every lane has work.
    fit_snake(StackModule(lambda i: Block(1024), width=1024, depth=4, vocab=32),  # 4 MiB units: 2 SSD chunks
              token_loader(STEPS * MICRO, MICRO, seq_len=8, vocab=32), steps=STEPS,
              storage={"ssd_dir": str(tmp_path / "ssd"), "weights": "ssd", "optimizer": "ssd", "checkpoints": "ssd",
                       "checkpoint_host_ends": 1},
              schedule={"num_micro_batches": MICRO, "alpha": 0.5}, trace_path=trace_path, callbacks=[keep],
              record=None, seed=None)
    return keep


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("timeline")
    path = tmp_path / "out" / "run.json"  # a directory that does not exist yet
    keep = _run(tmp_path, trace_path=path)
    return keep.engine.trace, read_trace(path), json.loads(path.read_text())


def _complete(events):
    return [e for e in events if e["ph"] == "X"]


def test_the_file_is_trace_event_json_with_named_lanes(traced):
    trace, events, document = traced
    assert document["displayTimeUnit"] == "ms" and isinstance(document["traceEvents"], list)
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(set(names.values())) == len(names)  # one tid per lane name
    slices = _complete(events)
    for e in slices:
        assert set(e) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
        assert e["ts"] >= 0 and e["dur"] >= 0, e
        assert e["tid"] in names
    used = {names[e["tid"]] for e in slices}
    assert {"steps", "compute", "prefetch", "optimizer"} <= used
    assert any(n.startswith("ssd io ") for n in used), used
    # The retained steps, in order, each a slice on the steps lane.
    assert [e["name"] for e in lanes(events)["steps"]] == [f"step {s.index}" for s in trace.steps]


def test_slices_on_a_lane_nest_and_never_partly_overlap(traced):
    _, events, _ = traced
    for lane, slices in lanes(events).items():
        open_ends: list[float] = []
        for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + 1e-3:
                open_ends.pop()
            if open_ends:  # inside the enclosing slice: must end within it
                assert e["ts"] + e["dur"] <= open_ends[-1] + 1e-3, (lane, e)
            open_ends.append(e["ts"] + e["dur"])


def test_compute_slices_are_the_executed_tasks_one_to_one(traced):
    trace, events, _ = traced
    assert [s.index for s in trace.steps] == list(range(1, STEPS + 1))
    for step in trace.steps:
        tasks = [e for e in lanes(events, step.index)["compute"] if e["cat"] == "task"]
        assert [e["name"] for e in tasks] == [repr(t) for t in step.tasks]
        assert [(e["args"]["kind"], e["args"]["unit"], tuple(e["args"]["micro_batches"])) for e in tasks] == \
            [(t.kind, t.unit, t.micro_batches) for t in step.tasks]
    assert step.tasks == trace.last.tasks


def test_fetch_slices_are_the_fetch_records(traced):
    trace, events, _ = traced
    origin = trace.steps[0].start_s
    for step in trace.steps:
        slices = [e for lane in lanes(events, step.index).values() for e in lane if e["cat"] == "fetch"]
        got = sorted((e["args"]["unit"], e["args"]["prefetched"], e["ts"]) for e in slices)
        want = sorted((f.unit, f.prefetched, round((f.started_s - origin) * 1e6, 3)) for f in step.fetches)
        assert got == want
        assert len(step.fetches) == 2 * 4 - 1  # the vertical schedule's weight fetches
        late = [f for f in step.fetches if f.prefetched and f.exposed_s > 0]
        waits = [e for e in lanes(events, step.index)["compute"] if e["name"].startswith("wait weights")]
        assert len(waits) == len(late)


def test_each_kind_of_work_has_its_own_lane(traced):
    _, events, _ = traced
    kinds = defaultdict(set)
    for lane, slices in lanes(events).items():
        for e in slices:
            kinds[e["cat"]].add("ssd io" if lane.startswith("ssd io") else lane)
    assert kinds["task"] == {"compute"}
    assert kinds["io"] == {"ssd io"}
    assert kinds["optimizer"] == {"optimizer"}
    assert kinds["step"] == {"steps"}
    assert kinds["fetch"] <= {"prefetch", "compute"}  # on demand: the compute thread fetched it itself
    assert kinds["wait"] <= {"compute", "prefetch", "optimizer"}
    assert "wait optimizer" in {e["name"] for e in lanes(events)["compute"]}
    # The optimizer lane holds every unit's backward and forward part, with chunks inside.
    parts = {e["name"] for e in lanes(events)["optimizer"]}
    assert {f"backward part u{u}" for u in range(4)} <= parts and "forward part u0" in parts
    assert {"chunk u0", "chunk u3"} <= parts
    io = [e for slices in lanes(events).values() for e in slices if e["cat"] == "io"]
    assert {e["args"]["direction"] for e in io} == {"read", "write"}
    assert {"weights", "exp_avg", "checkpoints"} <= {e["args"]["state"] for e in io}
    assert all(0 < e["args"]["bytes"] <= 4 * 2**20 for e in io)


def test_step_breakdown_measures_each_resource(traced):
    trace, events, _ = traced
    busy = step_breakdown(events, trace.last.index)
    assert busy["step"] > 0 and busy["compute"] > 0 and busy["ssd"] > 0 and busy["optimizer"] > 0, busy
    assert busy["compute"] + busy["waits"] <= busy["step"] * 1.01, busy


def test_without_trace_path_the_engine_records_no_spans(tmp_path):
    trace = _run(tmp_path).engine.trace
    assert not trace.enabled
    assert [len(s.tasks) for s in trace.steps] == [len(trace.last.tasks)] * STEPS and trace.last.fetches
    assert all(s.spans == [] for s in trace.steps)


def test_a_trace_path_that_cannot_be_a_file_is_refused_at_once(tmp_path):
    with pytest.raises(ValueError, match="trace_path=.*is a directory"):
        GreedySnakeStrategy(trace_path=tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="trace_path=.*cannot be written"):
        check_trace_path(blocker / "run.json")


def test_the_hydra_flag_writes_the_trace_into_the_output_directory(tmp_path):
    from hydra import compose, initialize_config_dir

    from snake_strategy.train import CONFIG_DIR, run

    overrides = ["trace_path=timeline.json", "trainer.max_steps=2", "save_final=false", "run_validation=false",
                 "data.max_bytes=200000", "data.context_len=16", "data.micro_batch_size=1", "storage=ssd",
                 f"storage.ssd_dir={tmp_path / 'ssd'}", f"hydra.run.dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    report = run(cfg)
    assert report["trace"] == str(tmp_path / "timeline.json")
    by_lane = lanes(read_trace(tmp_path / "timeline.json"))
    assert [e["name"] for e in by_lane["steps"]] == ["step 1", "step 2"]
    assert sum(e["cat"] == "task" for e in by_lane["compute"]) > 0
