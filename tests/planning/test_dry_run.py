"""The dry run (snake_strategy/dry_run.py, ``python -m snake_strategy.plan``): the plan a fit of the same settings
uses, built without a weight; whether it fits and what to change; the predicted step, the bytes per step and the
SSD wear; the command line on the training app's own config groups, at gpt_4b in seconds."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import snake_strategy
from snake_strategy.dry_run import plan_run
from snake_strategy.gpt import GPTModule
from snake_strategy.planning.run_prediction import days_to_endurance
from tests.helpers import SMALL_GPT, fit_snake, token_loader

MICRO, MICRO_SIZE = 2, 2
REPO = Path(__file__).resolve().parents[2]


def _loader(steps=1):
    return token_loader(steps * MICRO * MICRO_SIZE, MICRO * MICRO_SIZE, SMALL_GPT.context_len, SMALL_GPT.vocab_size)


def _settings(tmp_path):
    return dict(storage={"weights": "ssd", "optimizer": {"host": 0.5, "ssd": 0.5}, "ssd_dir": str(tmp_path / "ssd")},
                schedule={"num_micro_batches": MICRO})


def test_the_dry_run_is_the_plan_fit_uses(tmp_path):
    module = GPTModule(SMALL_GPT)
    dry = plan_run(module, snake_strategy.GreedySnakeStrategy(**_settings(tmp_path)), next(iter(_loader())))
    assert all(p.is_meta for p in module.parameters())  # no weight was built
    assert dry.fits and not dry.problems
    assert dry.tokens_per_step == MICRO * MICRO_SIZE * SMALL_GPT.context_len
    assert dry.predicted_s_per_step > 0 and dry.tokens_per_s > 0
    assert dry.bytes_per_step["ssd/read"] > 0 and dry.bytes_per_step["ssd/write"] > 0
    assert dry.ssd_write_bytes_per_1000_steps == 1000 * dry.bytes_per_step["ssd/write"]
    assert dry.ssd_bytes > 0 and dry.ssd_free_bytes > dry.ssd_bytes
    json.dumps(dry.as_dict(), default=str)  # the JSON the command line writes
    text = dry.describe()
    assert "fits: yes" in text and "TB written per 1,000 steps" in text and "TBW" in text

    run = fit_snake(GPTModule(SMALL_GPT), _loader(), steps=1, record=None, **_settings(tmp_path))
    fitted = run.strategy.plan
    assert fitted.storage == dry.plan.storage and fitted.schedule.kind == dry.plan.schedule.kind
    assert fitted.schedule.alpha == dry.plan.schedule.alpha and fitted.host_bytes == dry.plan.host_bytes
    # The prediction before step 1: the same bytes, the same kept graphs, compute timed on the same unit's shapes
    # (the dry run's on random weights, the fit's on its own: the same FLOPs, timings apart by the machine's noise)
    before = fitted.setup_prediction
    assert (before.ssd_read_bytes, before.ssd_write_bytes) == (dry.bytes_per_step["ssd/read"],
                                                               dry.bytes_per_step["ssd/write"])
    assert dry.plan.hardware.backward_flops_per_s is not None  # the unit was timed, not the probe's matmul taken
    assert fitted.kept_units and dry.host_items["kept_graphs"] > 0  # "auto" keeps graphs; the dry run expected it
    assert before.compute_s == pytest.approx(dry.plan.prediction.compute_s, rel=0.5)


def test_a_run_that_does_not_fit_says_what_to_change():
    module = GPTModule(SMALL_GPT)
    strategy = snake_strategy.GreedySnakeStrategy(storage={"placement": "manual", "host_budget_bytes": 4096},
                                                  schedule={"num_micro_batches": MICRO})
    dry = plan_run(module, strategy, next(iter(_loader())))
    assert not dry.fits
    assert any("storage.host_budget_bytes=4096" in p and "'ssd'" in p for p in dry.problems)
    assert "fits: NO" in dry.describe()


def test_wear_arithmetic():
    # 1 GB written a step, a step a second: 86.4 TB a day; a 600 TBW drive lasts 6.94 days.
    assert days_to_endurance(600, 10**9, 1.0) == pytest.approx(600e12 / 86.4e12)
    assert days_to_endurance(600, 0, 1.0) is None
    with pytest.raises(ValueError, match="ssd_endurance_tbw"):
        snake_strategy.StorageConfig(ssd_endurance_tbw=0)


def test_the_command_line_takes_the_training_apps_config_at_gpt_4b(tmp_path):
    """gpt_4b in a 16 GiB budget: answered within 60 s, the plan in plan.json, nothing materialized."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "snake_strategy.plan", "model=gpt_4b", "storage.host_budget_bytes=17179869184",
         f"storage.ssd_dir={tmp_path / 'ssd'}", f"hydra.run.dir={tmp_path / 'out'}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.perf_counter() - start < 60
    assert "fits: yes" in done.stdout and "TB written per 1,000 steps" in done.stdout
    report = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert report["fits"] and report["host_budget_bytes"] <= 17179869184
    assert report["host_peak_bytes"] - report["plan"]["process_baseline_bytes"] <= 17179869184
    assert report["ssd_bytes"] > 30e9  # 4B parameters' state, mostly on the SSD
    assert not (tmp_path / "ssd").exists() or not any((tmp_path / "ssd").iterdir())  # nothing written there
