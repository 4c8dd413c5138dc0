"""The Hydra app: every config composes and instantiates, run() trains, and a -m sweep runs in one process."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue

from snake_strategy import GreedySnakeStrategy, ScheduleConfig, StorageConfig
from snake_strategy.data import TextDataModule
from snake_strategy.gpt import GPTConfig, GPTModule
from snake_strategy.train import CONFIG_DIR, run, trainer_kwargs

GROUPS = ("model", "data", "storage", "schedule", "trainer", "experiment")
BIG_MODELS = {"gpt_1b", "gpt_4b"}  # compose and check their configs; never build them
# Small and fast: short windows, one window per micro-batch, a 200 kB corpus, one validation batch.
FAST = ["data.max_bytes=200000", "data.context_len=16", "data.micro_batch_size=1", "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def compose_train(overrides: list[str], tmp_path: Path | None = None) -> DictConfig:
    extra = [f"hydra.run.dir={tmp_path}"] if tmp_path is not None else []
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=overrides + extra, return_hydra_config=True)


def test_every_group_has_its_configs():
    assert set(options("model")) >= {"tiny", "small", "r1", "io_bound", "gpt_1b", "gpt_4b"}
    assert set(options("data")) >= {"stdlib", "textfile"}
    assert set(options("storage")) >= {"device", "host", "ssd", "ssd_all"}
    assert set(options("schedule")) >= {"vertical", "horizontal"}
    assert set(options("trainer")) >= {"default"}
    assert set(options("experiment")) >= {"r1_bench", "io_bound_bench", "tiny_ssd_all"}


def check_instantiates(cfg: DictConfig, tmp_path: Path) -> None:
    storage = instantiate(cfg.storage, _convert_="all")
    schedule = instantiate(cfg.schedule, _convert_="all")
    assert isinstance(storage, StorageConfig) and isinstance(schedule, ScheduleConfig)
    data = instantiate(cfg.data, _convert_="all")
    assert isinstance(data, TextDataModule)
    assert data.num_micro_batches == schedule.num_micro_batches
    gpt = GPTConfig.from_any(cfg.model.config)
    assert data.context_len <= gpt.context_len
    if cfg.model.config not in BIG_MODELS:
        model = instantiate(cfg.model, _convert_="all")
        assert isinstance(model, GPTModule) and model.config == gpt
    kwargs = trainer_kwargs(cfg, tmp_path)
    assert kwargs["default_root_dir"] == str(tmp_path)
    L.Trainer(strategy=GreedySnakeStrategy(storage=storage, schedule=schedule), logger=False, **kwargs)


@pytest.mark.parametrize("group", ["model", "data", "storage", "schedule", "trainer"])
def test_every_config_composes_and_instantiates(group, tmp_path):
    for name in options(group):
        if group == "model" and name.startswith("hf_"):
            continue  # HuggingFace models, not GPT presets: tests/hf/test_hf_models.py composes them
        overrides = [f"{group}={name}"]
        if (group, name) == ("data", "textfile"):
            corpus = tmp_path / "corpus.txt"
            corpus.write_text("hello snake " * 100)
            with pytest.raises(MissingMandatoryValue):
                instantiate(compose_train(overrides).data)
            overrides.append(f"data.source={corpus}")
        cfg = compose_train(overrides)
        assert cfg.hydra.runtime.choices[group] == name
        check_instantiates(cfg, tmp_path)


def test_context_len_follows_the_model_preset():
    # HF configs set their own; so does tiny (shorter windows keep the main job's activations in its budget).
    for name in [n for n in options("model") if not n.startswith("hf_") and n != "tiny"]:
        cfg = compose_train([f"model={name}"])
        assert cfg.data.context_len == GPTConfig.from_any(name).context_len
    assert compose_train([]).data.context_len == 32 < GPTConfig.from_any("tiny").context_len
    assert compose_train(["model=small", "data.context_len=8"]).data.context_len == 8


def test_storage_layouts():
    ssd = instantiate(compose_train(["storage=ssd"]).storage)
    assert ssd.ssd_dir is None and ssd.weights.ssd == ssd.optimizer.ssd == ssd.master.ssd == 1.0
    assert ssd.gradients.host == ssd.checkpoints.host == 1.0
    ssd_all = instantiate(compose_train(["storage=ssd_all"]).storage)
    assert ssd_all.checkpoints.ssd == 1.0
    assert not instantiate(compose_train(["storage=device"]).storage).uses_ssd()
    assert not instantiate(compose_train(["storage=host"]).storage).uses_ssd()


def test_every_storage_override_works_on_the_default_auto_storage(tmp_path):
    """`storage.weights=ssd` on the default `storage=auto`: every StorageConfig field is in auto.yaml (null
    states: the planner decides), so no override needs Hydra's `+`."""
    import dataclasses

    # The yaml states exactly the defaults (for a model that sets no auto_host_budget_bytes)...
    assert instantiate(compose_train(["model=small"]).storage, _convert_="all") == StorageConfig(placement="auto")
    # ...and the main job's tiny model plans within its own budget (test_main_job_shows_the_ssd_tier).
    default = instantiate(compose_train([]).storage, _convert_="all")
    assert default == StorageConfig(placement="auto", host_budget_bytes=16 * 2**20)
    assert default.unset() == ["weights", "master", "optimizer", "gradients", "checkpoints"]
    values = {"ssd_dir": str(tmp_path / "nvme"), "weights": "ssd", "master": "host", "optimizer": "{host: 0.5, ssd: 0.5}",
              "gradients": "host", "checkpoints": "ssd", "checkpoint_host_ends": "1", "use_o_direct": "false",
              "num_io_threads": "4", "keep_ssd_files": "true", "host_budget_bytes": "1000000000",
              "optimizer_chunk_elems": "8192", "placement": "manual", "rollback": "ssd",
              "export_dir": str(tmp_path / "weights"), "ssd_endurance_tbw": "1200"}
    assert set(values) == {f.name for f in dataclasses.fields(StorageConfig)}  # a new field needs a line here
    for field, value in values.items():
        storage = instantiate(compose_train([f"storage.{field}={value}"]).storage, _convert_="all")
        assert storage != default, field
    pinned = instantiate(compose_train(["storage.weights=ssd", "storage.optimizer={host: 0.5, ssd: 0.5}"]).storage,
                         _convert_="all")
    assert pinned.placement == "auto" and pinned.weights.ssd == 1.0 and pinned.optimizer.ssd == 0.5
    assert pinned.unset() == ["master", "gradients", "checkpoints"]  # still the planner's


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes(experiment, tmp_path):
    cfg = compose_train([f"experiment={experiment}"])
    assert cfg.hydra.runtime.choices["experiment"] == experiment
    check_instantiates(cfg, tmp_path)


def test_run_trains_on_ssd(tmp_path):
    cfg = compose_train(["trainer.max_steps=2", "storage=ssd", "schedule=vertical", *FAST], tmp_path)
    report = run(cfg)
    assert report["steps"] == 2 and len(report["losses"]) == 2
    assert math.isfinite(report["final_train_loss"])
    assert report["val_loss"] is not None and math.isfinite(report["val_loss"])
    assert report["bytes_per_tier"]["ssd"] > 0
    assert report["bytes_total"]["ssd/weights/read"] > 0
    assert report["step_bytes_mean"]["ssd/weights/read"] > 0
    assert report["median_s_per_step"] > 0 and report["tokens_per_s"] > 0
    # the prediction made before step 1 and what its timing took, beside the measurement
    assert report["predicted_before_step_1_s_per_step"] > 0 and report["setup_timing_s"] > 0
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["final_train_loss"] == pytest.approx(report["final_train_loss"])
    # The trained model is saved by default: a resumable directory checkpoint and one consolidated file.
    from snake_strategy.checkpoint import read_manifest
    from snake_strategy.gpt import GPTModule

    assert read_manifest(report["saved"]["checkpoint"])["step_count"] == 2
    loaded = GPTModule.load_from_checkpoint(report["saved"]["model"], map_location="cpu")
    assert not any(p.is_meta for p in loaded.parameters())


def test_multirun_sweep_in_one_process(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "snake_strategy.train", "-m", "storage=device,host,ssd", "trainer.max_steps=2",
           "run_validation=false", f"hydra.sweep.dir={sweep}", *FAST]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = sorted(sweep.glob("*/report.json"))
    assert len(reports) == 3, list(sweep.rglob("*"))
    by_storage = {}
    for path in reports:
        report = json.loads(path.read_text())
        assert math.isfinite(report["final_train_loss"])
        by_storage[report["choices"]["storage"]] = report
    assert set(by_storage) == {"device", "host", "ssd"}
    assert by_storage["ssd"]["bytes_per_tier"]["ssd"] > 0
    assert by_storage["device"]["bytes_per_tier"]["ssd"] == 0
    assert by_storage["host"]["bytes_per_tier"]["ssd"] == 0
    assert not (tmp_path / "outputs").exists()  # hydra.job.chdir stays false and the sweep dir was used


def test_main_job_shows_the_ssd_tier(tmp_path):
    """`python -m snake_strategy.train` as the README runs it, no overrides: the tiny model's host budget
    makes the planner put state on the SSD tier, and the report says what moved, what was exposed and why."""
    cmd = [sys.executable, "-m", "snake_strategy.train", f"hydra.run.dir={tmp_path / 'run'}"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["bytes_per_tier"]["ssd"] > 0
    assert report["plan"]["storage"]["optimizer"]["ssd"] > 0
    assert report["plan"]["host_budget_source"] == "storage.host_budget_bytes"
    assert report["exposed_io_s"] >= 0 and report["train_s"] > report["exposed_io_s"]
    out = proc.stdout
    assert "bytes moved (whole run):" in out and "ssd 0 B" not in out
    assert "exposed I/O: compute waited" in out
    assert "plan: weights host" in out
    assert any(line.startswith("  ") and "optimizer" in line and "planner.plan" in line for line in out.splitlines())
