"""Host memory: the budget check fires before any step with the numbers, and peak RSS of an
SSD-resident run does not grow with depth."""
import json
import subprocess
import sys

import pytest
import torch

import snake_strategy
from snake_strategy.gpt import GPTConfig
from tests.helpers import run_snake

RSS_SCRIPT = r"""
import json, resource, sys, torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
import snake_strategy
from snake_strategy.gpt import GPTConfig, GPTModule
layers, ssd_dir = int(sys.argv[1]), sys.argv[2]
cfg = GPTConfig(vocab_size=256, d_model=256, num_layers=layers, num_heads=4, context_len=32, tied_head=True)
x = torch.randint(0, 256, (3 * 4, 33))
loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
storage = snake_strategy.StorageConfig(ssd_dir=ssd_dir, weights={"ssd": 1.0}, optimizer={"ssd": 1.0},
    gradients={"ssd": 1.0}, checkpoints={"ssd": 1.0}, checkpoint_host_ends=0, host_budget_bytes=256 * 2**20)
strategy = snake_strategy.GreedySnakeStrategy(storage=storage, schedule={"num_micro_batches": 4})
plan = {}
class Plan(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        plan.update(trainer.strategy.engine.host_bytes_plan(trainer.strategy.engine.checkpoint_bytes))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[Plan()])
trainer.fit(GPTModule(cfg), train_dataloaders=loader)
print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "base": base,
                  "planned": sum(plan.values()), "params": cfg.num_params()}))
"""


def _peak_rss(layers, tmp_path):
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(layers), str(tmp_path / f"ssd{layers}")],
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_does_not_grow_with_depth(tmp_path):
    shallow, deep = _peak_rss(4, tmp_path), _peak_rss(32, tmp_path)
    state_growth = (deep["params"] - shallow["params"]) * 16  # weights + 2 moments + gradient, fp32
    assert state_growth > 300 * 2**20  # the deep model's extra state would be visible if it lived in RAM
    growth = deep["peak"] - shallow["peak"]
    # Fixed overhead of the process (Python, torch, Lightning) is the same for both; the plan is tiny.
    assert growth < 48 * 2**20, (growth, shallow, deep)
    for run in (shallow, deep):
        assert run["peak"] <= run["base"] + run["planned"] + 400 * 2**20, run


def test_host_budget_error_before_any_step(tmp_path):
    cfg = GPTConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, context_len=16)
    steps_run = []
    import lightning as L

    class Count(L.Callback):
        def on_train_batch_end(self, *args):
            steps_run.append(1)

    with pytest.raises(ValueError, match=r"host_budget_bytes allows 0.00 GiB \(1000 bytes\)") as err:
        run_snake(cfg, 2, 4, 2, "32-true", storage={"host_budget_bytes": 1000, "ssd_dir": str(tmp_path)},
                  callbacks=[Count()])
    assert "needs" in str(err.value) and "ssd" in str(err.value)
    assert steps_run == []


def test_host_budget_counts_checkpoints_at_first_step(tmp_path):
    """The static plan fits; the activation checkpoints, known at the first batch, do not."""
    cfg = GPTConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, context_len=16)
    # A budget just above the static plan: setup passes, the first batch's checkpoints do not fit.
    with pytest.raises(ValueError, match="checkpoints"):
        run_snake(cfg, 1, 4, 64, "32-true",
                  storage={"ssd_dir": str(tmp_path / "b"), "host_budget_bytes": _static_plan(cfg) + 1024})


def _static_plan(cfg):
    from snake_strategy.engine import SnakeEngine, DtypePolicy
    from snake_strategy.gpt import GPTModule
    module = GPTModule(cfg)
    with torch.device("meta"):
        module.configure_model()
    optimizer = module.configure_optimizers()
    engine = SnakeEngine(module, optimizer, snake_strategy.StorageConfig(), snake_strategy.ScheduleConfig(),
                         DtypePolicy(torch.float32, torch.float32), torch.device("cpu"))
    try:
        return sum(engine.host_bytes_plan().values())
    finally:
        engine.close()
