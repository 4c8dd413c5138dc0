"""Host memory: the budget check fires before any step with the numbers, and peak RSS of an
SSD-resident run does not grow with depth."""
import json
import subprocess
import sys

import pytest
import torch

import lightning as L

import snake_strategy
from snake_strategy.gpt import GPTConfig
from snake_strategy.planning.memory_model import LOSS_HEAD_LOGITS_COPIES, RSS_SLACK_BYTES
from tests.helpers import SMALL_GPT, run_snake

RSS_SCRIPT = r"""
import json, resource, sys, time, torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
import snake_strategy
from snake_strategy.gpt import GPTConfig, GPTModule
layers, width, ssd_dir, slow = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
keep, budget_bytes = (sys.argv[5] if sys.argv[5] == "auto" else int(sys.argv[5])), int(sys.argv[6])
cfg = GPTConfig(vocab_size=256, d_model=width, num_layers=layers, num_heads=4, context_len=32, tied_head=True)
x = torch.randint(0, 256, (2 * 4, 33))
loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
storage = snake_strategy.StorageConfig(ssd_dir=ssd_dir, weights={"ssd": 1.0}, optimizer={"ssd": 1.0},
    gradients={"ssd": 1.0}, checkpoints={"ssd": 1.0}, checkpoint_host_ends=0, host_budget_bytes=budget_bytes,
    optimizer_chunk_elems=64 * 4096)
# Delay injection through the public test hooks: a slow optimizer worker, or a slow SSD.
hooks = snake_strategy.EngineHooks(
    before_optimizer_chunk=(lambda unit: time.sleep(0.03)) if slow == "optimizer" else None,
    before_ssd_transfer=(lambda direction, n: time.sleep(0.002)) if slow == "ssd" else None)
strategy = snake_strategy.GreedySnakeStrategy(storage=storage, schedule={"num_micro_batches": 4,
    "keep_activations": keep}, hooks=hooks)
plan, waits, peak = {}, [], []
class Plan(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        engine = trainer.strategy.engine
        plan.update(engine.host_bytes_plan(engine.checkpoint_bytes))
        waits.append(engine.last_step.backpressure_wait_s)
    def on_train_end(self, trainer, *args):
        # The training peak, before teardown gives the trained weights back to the module (they are the
        # model's own size, not the engine's working set).
        trainer.strategy.engine.flush()
        peak.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
module = GPTModule(cfg)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                    default_root_dir=ssd_dir + "-root",  # weights over the budget are written there after fit
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[Plan()])
trainer.fit(module, train_dataloaders=loader)
print(json.dumps({"peak": peak[0], "base": base, "planned": sum(plan.values()), "kept_graphs": plan.get("kept_graphs", 0),
                  "kept_units": len(strategy.plan.kept_units or ()), "params": cfg.num_params(),
                  "backpressure_s": sum(waits)}))
"""


def _peak_rss(layers, tmp_path, width=256, slow="none", keep="0", budget_bytes=512 * 2**20):
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(layers), str(width),
                          str(tmp_path / f"ssd{layers}-{slow}-{keep}"), slow, keep, str(budget_bytes)],
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("slow", ["optimizer", "ssd"])
def test_peak_rss_does_not_grow_with_depth_when_a_consumer_is_slow(tmp_path, slow):
    """With the optimizer (or the SSD) slowed down, producers wait instead of queueing buffers: peak RSS
    stays at baseline + plan + memory_model.RSS_SLACK_BYTES and does not grow with the number of units.
    keep_activations=0 (the _peak_rss default): kept graphs grow with depth up to the host budget, which
    is the next test's bound, not this one's (with "auto" the 32-layer run keeps 31 units' graphs, 62 MiB)."""
    shallow, deep = _peak_rss(4, tmp_path, slow=slow), _peak_rss(32, tmp_path, slow=slow)
    state_growth = (deep["params"] - shallow["params"]) * 16  # weights + 2 moments + gradient, fp32
    assert state_growth > 300 * 2**20  # the deep model's extra state would be visible if it lived in RAM
    growth = deep["peak"] - shallow["peak"]
    # Fixed overhead of the process (Python, torch, Lightning) is the same for both; the plan is tiny.
    assert growth < 48 * 2**20, (growth, shallow, deep)
    for run in (shallow, deep):
        assert run["peak"] <= run["base"] + run["planned"] + RSS_SLACK_BYTES, run
    if slow == "optimizer":
        # The bound was exercised: the backward waited for the slowed optimizer to give buffers back.
        assert deep["backpressure_s"] > 0, deep


def test_kept_graphs_are_bounded_by_the_budget_not_by_depth(tmp_path):
    """keep_activations="auto" keeps units' forward graphs while the host budget has room: a deep model
    under a tight budget keeps some of its units, not all, and its peak RSS stays within the plan (kept
    graphs included) + slack. Peak RSS therefore grows with depth only up to the budget."""
    budget_bytes = 40 * 2**20  # the plan without graphs is ~24 MiB here: room for about 8 units' graphs
    run = _peak_rss(16, tmp_path, keep="auto", budget_bytes=budget_bytes)
    assert 0 < run["kept_units"] < 15, run  # 15 candidates (the last unit is fused): the budget decided
    assert run["kept_graphs"] > 0 and run["planned"] <= budget_bytes, run
    assert run["peak"] <= run["base"] + run["planned"] + RSS_SLACK_BYTES, run


def test_wide_units_over_few_tokens_stay_within_their_plan(tmp_path):
    """Few tokens through wide units: a unit's weight gradients as autograd returns them (200 MB at d=2048, one
    tensor per leaf, before they are added into the gradient buffer) outweigh its activations. The plan counts
    them (``weight_gradients``), so the peak stays within it; without that item it did not (a 7B layer's is
    0.8 GB)."""
    run = _peak_rss(2, tmp_path, width=2048, budget_bytes=3 * 2**30)
    assert run["peak"] <= run["base"] + run["planned"] + RSS_SLACK_BYTES, run


def test_budget_check_planner_and_activation_store_share_one_memory_model(tmp_path):
    from snake_strategy.planning.memory_model import checkpoint_tiers, host_plan
    from snake_strategy.planning.placement import memory_inputs
    from snake_strategy.planning.time_model import HardwareProfile

    storage = {"ssd_dir": str(tmp_path / "s"), "weights": "ssd", "optimizer": "ssd", "checkpoints": {"ssd": 0.5},
               "checkpoint_host_ends": 1}
    seen = {}

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            engine = trainer.strategy.engine
            seen["budget"] = engine.host_bytes_plan(engine.checkpoint_bytes)
            seen["measured"] = engine.measured_host_items()
            seen["tiers"] = [engine.activations.tier_of(m) for m in range(6)]
            seen["shape"] = trainer.strategy.model_shape
            seen["ssd_ckpt_writes"] = engine.last_step.traffic.get("ssd/checkpoints/write", 0)
            seen["storage"], seen["alpha"] = engine.storage, engine.alpha

    run_snake(SMALL_GPT, 1, 6, 1, "32-true", storage=storage, callbacks=[Capture()])
    shape = seen["shape"]
    # The first step measured the loss head's logits (unbatched: one micro-batch's) and keeps no graphs here.
    logits_bytes = shape.tokens_per_micro * SMALL_GPT.vocab_size * 4
    planned = host_plan(memory_inputs(shape, HardwareProfile(), seen["storage"], "vertical", seen["alpha"],
                                      loss_logits_bytes=logits_bytes))
    assert seen["measured"] == {}
    assert planned == seen["budget"]
    assert planned["compute_workspace"] >= LOSS_HEAD_LOGITS_COPIES * logits_bytes
    tiers = checkpoint_tiers(seen["storage"], 6)
    assert seen["tiers"] == tiers and tiers.count("ssd") == 3
    # The store really put those micro-batches on the SSD: one checkpoint per (unit, ssd micro-batch).
    assert seen["ssd_ckpt_writes"] == tiers.count("ssd") * shape.num_units * shape.checkpoint_bytes


def test_host_budget_error_before_any_step(tmp_path):
    cfg = GPTConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, context_len=16)
    steps_run = []
    import lightning as L

    class Count(L.Callback):
        def on_train_batch_end(self, *args):
            steps_run.append(1)

    # A manual plan (everything on the host) over the budget: refused with the placement's numbers.
    with pytest.raises(ValueError, match=r"host_budget_bytes allows 0.00 GiB \(1000 bytes\)") as err:
        run_snake(cfg, 2, 4, 2, "32-true", storage={"host_budget_bytes": 1000, "ssd_dir": str(tmp_path),
                                                    "placement": "manual"}, callbacks=[Count()])
    assert "needs" in str(err.value) and "ssd" in str(err.value)
    # The planner (a mapping that places nothing): even all on the SSD the working set does not fit.
    with pytest.raises(ValueError, match=r"cannot hold the working set of .*raise the budget"):
        run_snake(cfg, 2, 4, 2, "32-true", storage={"host_budget_bytes": 1000, "ssd_dir": str(tmp_path / "auto")},
                  callbacks=[Count()])
    assert steps_run == []


def test_host_budget_counts_checkpoints_at_first_step(tmp_path):
    """The static plan fits; the activation checkpoints, known at the first batch, do not."""
    cfg = GPTConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, context_len=16)
    # A budget just above the static plan: setup passes, the first batch's checkpoints do not fit.
    with pytest.raises(ValueError, match="checkpoints"):
        run_snake(cfg, 1, 4, 64, "32-true",
                  storage={"ssd_dir": str(tmp_path / "b"), "host_budget_bytes": _static_plan(cfg) + 1024})


def _static_plan(cfg):
    from snake_strategy.engine import DtypePolicy, EngineRuntime, SnakeEngine
    from snake_strategy.gpt import GPTModule
    from snake_strategy.planning.run_plan import resolve
    from snake_strategy.planning.time_model import HardwareProfile
    module = GPTModule(cfg)
    with torch.device("meta"):
        module.configure_model()
    optimizer = module.configure_optimizers()
    plan = resolve(module, optimizer, snake_strategy.StorageConfig(), snake_strategy.ScheduleConfig(kind="vertical"),
                   DtypePolicy(torch.float32, torch.float32), torch.device("cpu"), HardwareProfile())
    engine = SnakeEngine(module, optimizer, plan, EngineRuntime(DtypePolicy(torch.float32, torch.float32),
                                                                torch.device("cpu")))
    try:
        return sum(engine.host_bytes_plan().values())
    finally:
        engine.close()


def test_in_step_items_count_what_coincides():
    """The plan's in-step transients are what can be live at once: the transient gradient of ONE non-layer
    backward (the head's or the embedding's, in different tasks: the largest), and the larger of the loss
    head's tensors and the blocks' backward workspace (the head runs first in the last unit's task)."""
    import dataclasses

    from snake_strategy.config import StorageConfig
    from snake_strategy.planning.memory_model import WORKSPACE_CHECKPOINTS_PER_BLOCK, MemoryInputs, host_plan

    inputs = MemoryInputs(unit_params=(4096,) * 3, nonlayer_params=3000, compute_bytes=4, master_bytes=4,
                          device_is_cpu=True, storage=StorageConfig(), micro_per_backward_task=2,
                          checkpoint_bytes=1000)
    workspace = WORKSPACE_CHECKPOINTS_PER_BLOCK * 2 * 1000
    whole = host_plan(inputs)
    split = host_plan(dataclasses.replace(inputs, nonlayer_largest=1000))
    # moments, gradient and compute copy for all 3000; the transient gradient for 3000 (unknown) or 1000
    assert whole["nonlayer_params_and_state"] - split["nonlayer_params_and_state"] == 2000 * 4
    assert whole["compute_workspace"] == workspace
    small_head = host_plan(dataclasses.replace(inputs, loss_logits_bytes=workspace // (2 * LOSS_HEAD_LOGITS_COPIES)))
    assert small_head["compute_workspace"] == workspace
    big_head = host_plan(dataclasses.replace(inputs, loss_logits_bytes=workspace))
    assert big_head["compute_workspace"] == LOSS_HEAD_LOGITS_COPIES * workspace
    assert sum(big_head.values()) - sum(whole.values()) == (LOSS_HEAD_LOGITS_COPIES - 1) * workspace
