"""``python -m snake_strategy.tune``: the grid around the planner's choice, the ranking and its summary, and
one real sweep of two configurations on the tiny preset."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from snake_strategy.tune import AXES, DEFAULT_NAME, build_grid, merge_runs, rank, run_order, summarize, table

REPO = Path(__file__).resolve().parents[2]


def _plan(alpha=0.2, depth=1, keep="auto", batched=True, blocks=1, weights_ssd=0.0, optimizer_ssd=0.0):
    """The parts of a ``RunPlan.as_dict()`` the grid reads."""
    return {"schedule": {"alpha": alpha, "prefetch_depth": depth, "keep_activations": keep, "batched_forward": batched,
                         "batched_backward": batched, "split_backward": False, "blocks_per_unit": blocks},
            "storage": {"weights": {"device": 0.0, "host": 1 - weights_ssd, "ssd": weights_ssd},
                        "optimizer": {"device": 0.0, "host": 1 - optimizer_ssd, "ssd": optimizer_ssd}}}


def _run(name, s_per_step=None, predicted=None, status="ok"):
    if status != "ok":
        return {"name": name, "status": status, "error": "does not fit the host budget"}
    return {"name": name, "status": "ok", "s_per_step": s_per_step, "predicted_s_per_step": predicted,
            "prediction_error": predicted / s_per_step - 1, "bound": "ssd", "peak_rss_bytes": 2**30,
            "planned_host_bytes": 2**29}


def test_grid_leaves_out_what_the_default_already_runs():
    names = [v.name for v in build_grid(list(AXES), _plan(alpha=0.25, depth=2, weights_ssd=1.0))]
    assert names == ["alpha=0.0", "alpha=0.5", "prefetch_depth=1", "prefetch_depth=3", "keep_activations=0",
                     "batching=unbatched", "blocks_per_unit=2", "optimizer=ssd"]
    # Without the default's plan (refused or failed) every value runs: a sweep of 15, not a product of 432.
    assert len(build_grid(list(AXES))) == 14


def test_grid_variants_set_one_setting_each():
    by_name = {v.name: v for v in build_grid(["batching", "host_shares", "keep_activations"])}
    assert by_name["batching=unbatched"].schedule == {"batched_forward": False, "batched_backward": False}
    assert by_name["weights=ssd"].storage == {"weights": {"ssd": 1.0}} and not by_name["weights=ssd"].schedule
    assert by_name["keep_activations=0"].schedule == {"keep_activations": 0}
    # "auto" that kept no graph at the first step already runs what 0 runs; one that kept some does not
    assert [v.name for v in build_grid(["keep_activations"], {**_plan(), "kept_units": []})] == []
    assert [v.name for v in build_grid(["keep_activations"], {**_plan(), "kept_units": [3]})] == ["keep_activations=0"]
    # a plan running the split backward is not "batched" nor "unbatched" in the grid's sense
    split = _plan(batched=False)
    split["schedule"]["split_backward"] = True
    assert [v.name for v in build_grid(["batching"], split)] == ["batching=batched", "batching=unbatched"]
    with pytest.raises(ValueError, match="unknown axes"):
        build_grid(["alpha", "colour"])


def test_rank_and_summary():
    runs = [_run(DEFAULT_NAME, 1.1, 1.0), _run("alpha=0.0", 1.0, 1.2), _run("weights=ssd", status="refused"),
            _run("prefetch_depth=3", 1.5, 1.5)]
    assert [r["name"] for r in rank(runs)] == ["alpha=0.0", DEFAULT_NAME, "prefetch_depth=3", "weights=ssd"]
    summary = summarize(runs)
    assert summary["best"] == "alpha=0.0" and summary["default_rank"] == 2
    assert summary["default_over_best"] == pytest.approx(1.1)
    assert (summary["measured"], summary["refused"], summary["failed"]) == (3, 1, 0)
    assert summary["median_abs_prediction_error"] == pytest.approx(1 - 1.0 / 1.1)  # of 0.09, 0.2 and 0
    text = table(runs)
    assert "default ranks 2 of 3: within 10.0% of the best (alpha=0.0" in text
    assert "refused: does not fit the host budget" in text
    # the default refused: no rank for it, the best is still named
    assert "default_rank" not in summarize([_run(DEFAULT_NAME, status="refused"), _run("alpha=0.0", 1.0, 1.0)])


def test_rounds_alternate_and_rank_by_the_median():
    """Rounds run every configuration again, every other round reversed (the one-round sweep's default at both
    ends is the CLI test's). A configuration's s/step is the median of its measured runs; a failed run does not
    count."""
    names = [DEFAULT_NAME, "a", "b"]
    assert run_order(names, 1) == names
    assert run_order(names, 3) == [DEFAULT_NAME, "a", "b", "b", "a", DEFAULT_NAME, DEFAULT_NAME, "a", "b"]
    merged = merge_runs([_run("a", 2.0, 2.2), _run("a", status="failed"), _run("a", 1.0, 1.0), _run("a", 1.5, 1.2)])
    assert merged["s_per_step"] == 1.5 and merged["s_per_step_runs"] == [2.0, 1.0, 1.5]
    assert merged["predicted_s_per_step"] == 1.2 and merged["prediction_error"] == pytest.approx(0.0)
    assert merge_runs([_run("a", status="refused")])["status"] == "refused"


def test_cli_sweeps_two_configurations_on_tiny(tmp_path):
    """One real sweep (two child runs of two steps, ~10 s): the default and blocks_per_unit=2, each
    measured, predicted and planned, the settings each ran with in its plan. Nominal rates: no probe of
    the disk in the suite."""
    out = tmp_path / "tune.json"
    proc = subprocess.run([sys.executable, "-m", "snake_strategy.tune", "--preset", "tiny", "--num-micro", "2",
                           "--steps", "2", "--grid", "blocks_per_unit", "--ssd-dir", str(tmp_path),
                           "--hardware", "nominal", "--json-out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {DEFAULT_NAME, "blocks_per_unit=2"}, proc.stderr[-3000:]
    for run in runs.values():
        assert run["status"] == "ok", run
        assert len(run["step_s"]) == len(run["losses"]) == 2 and run["predicted_s_per_step"] > 0 and run["bound"]
        assert run["peak_rss_bytes"] > run["planned_host_bytes"] > 0
    other = runs["blocks_per_unit=2"]
    assert other["s_per_step"] == other["step_s"][1]
    assert other["prediction_error"] == pytest.approx(other["predicted_s_per_step"] / other["s_per_step"] - 1)
    # the default ran first and again last: ranked by the mean of the two
    default = runs[DEFAULT_NAME]
    assert len(default["s_per_step_runs"]) == 2 and default["s_per_step"] == pytest.approx(
        sum(default["s_per_step_runs"]) / 2)
    assert runs["blocks_per_unit=2"]["plan"]["schedule"]["blocks_per_unit"] == 2
    assert runs[DEFAULT_NAME]["plan"]["schedule"]["blocks_per_unit"] == 1
    assert report["summary"]["measured"] == 2 and "default_rank" in report["summary"]
    assert "default ranks" in proc.stdout and "[2/3] blocks_per_unit=2" in proc.stderr
    assert "[3/3] default" in proc.stderr
    assert not [p for p in tmp_path.iterdir() if p.name != "tune.json"]  # every run's SSD folder removed
