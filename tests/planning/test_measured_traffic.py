"""Byte counters against the traffic model (docs/design.md, "Traffic model" and "Optimizer overlap").

- Compute weights: one unit is resident at a time, so the bytes fetched are exactly
  ``schedule.weight_fetches`` x the unit's bytes; vertical does not depend on M, horizontal grows.
- Gradients: vertical never writes a partial gradient; with the optimizer overlap only the forward
  part (``alpha`` share) of each complete gradient is parked in the gradient store, once per step, and
  read back once in the next step's forward. Horizontal additionally writes and re-reads the whole
  partial gradient after every micro-batch but the last.
- Optimizer: every unit's master weights and both moments are read and written once per step.

The optimizer worker runs concurrently with the compute, so which phase's counters
(``last_step.traffic`` or ``.optimizer_traffic``) receive its bytes depends on timing.
Compute-weight fetches are only separable from optimizer traffic when the master copy is a separate
store (bf16-true); otherwise the tests compare whole-step counter deltas, measured by a callback from
``on_train_batch_start`` to ``on_train_batch_end``, or whole-run totals.
"""
from __future__ import annotations

from collections import Counter

import lightning as L
import pytest

from snake_strategy.gpt import GPTModule
from snake_strategy.schedule import build_tasks, weight_fetches
from snake_strategy.storage import round_up
from tests.helpers import SMALL_GPT, fit_snake, token_loader

MICRO_SIZE = 1
STEPS = 2
ACT_BYTES = MICRO_SIZE * SMALL_GPT.context_len * SMALL_GPT.d_model * 4  # one fp32 checkpoint
FP32, BF16 = 4, 2
N_LAYERS = SMALL_GPT.num_layers
P = SMALL_GPT.block_params()


class StepStats(L.Callback):
    """Copies the engine's per-step stats and unit geometry while the engine is alive.

    ``run_total`` is the counter delta from before the first step to after the last one, including
    the forward parts still pending at the end (applied with ``engine.flush()``).
    """

    def __init__(self) -> None:
        self.traffic: list[dict[str, int]] = []
        self.optimizer_traffic: list[dict[str, int]] = []
        self.units: list[dict] = []
        self.tasks = None
        self.step_deltas: list[dict[str, int]] = []
        self._start: dict = {}
        self._batch_start: dict = {}
        self.run_total: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module):
        self._start = trainer.strategy.engine.counters.snapshot()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._batch_start = trainer.strategy.engine.counters.snapshot()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        self.step_deltas.append(_delta(self._batch_start, engine.counters.snapshot()))
        self.traffic.append(dict(engine.last_step.traffic))
        self.optimizer_traffic.append(dict(engine.last_step.optimizer_traffic))
        self.tasks = list(engine.trace.last.tasks)
        self.units = engine.storage_layout()

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        engine.flush()
        self.run_total = Counter(_delta(self._start, engine.counters.snapshot()))

    def step_total(self, step: int) -> Counter:
        """Every byte counted during one Lightning batch (independent of when the optimizer worker ran)."""
        return Counter(self.step_deltas[step])

    def total(self, key: str) -> int:
        return sum(u[key] for u in self.units)


def _delta(before: dict, after: dict) -> dict[str, int]:
    return {"/".join(k): v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def run(tmp_path, storage: dict, kind: str, micro: int, precision: str = "32-true", blocks_per_unit: int = 1,
        alpha: float | None = None, steps: int = STEPS, callbacks: tuple = ()) -> StepStats:
    schedule = {"kind": kind, "num_micro_batches": micro, "blocks_per_unit": blocks_per_unit}
    if alpha is not None:
        schedule["alpha"] = alpha
    stats = StepStats()
    fit_snake(GPTModule(SMALL_GPT, learning_rate=1e-3),
              token_loader(steps * micro * MICRO_SIZE, micro * MICRO_SIZE, SMALL_GPT.context_len, SMALL_GPT.vocab_size),
              steps=steps, storage=dict(storage, ssd_dir=str(tmp_path / f"ssd-{kind}-{micro}-{alpha}")),
              schedule=schedule, precision=precision, callbacks=[stats, *callbacks], record=None, seed=None)
    assert len(stats.traffic) == steps
    return stats


SSD_WEIGHTS = {"weights": "ssd", "optimizer": "ssd"}  # gradients (and bf16-true's master) on the host
ALL_SSD = {"weights": "ssd", "master": "ssd", "optimizer": "ssd", "gradients": "ssd"}


def test_unit_ssd_bytes_are_page_rounded(tmp_path):
    stats = run(tmp_path, SSD_WEIGHTS, "vertical", 2, steps=1)
    assert len(stats.units) == N_LAYERS
    for unit in stats.units:
        assert unit["numel"] == P
        assert unit["weights_ssd"] == round_up(P * FP32)
        assert unit["weights_ssd"] % 4096 == 0 and unit["weights_ssd"] >= P * FP32
        assert unit["weights_is_master"]  # fp32: the compute copy is the master copy, stored once
        assert unit["forward_end"] % 4096 == 0 and 0 <= unit["forward_end"] < P


# ---------------------------------------------------------------------------------------- weights
@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
@pytest.mark.parametrize("micro", [2, 4])
@pytest.mark.parametrize("blocks_per_unit", [1, 2, 4])
def test_compute_weight_reads_follow_weight_fetches(tmp_path, kind, micro, blocks_per_unit):
    # bf16-true: the compute copy is its own store, so "ssd/weights/read" counts fetches only.
    stats = run(tmp_path, SSD_WEIGHTS, kind, micro, precision="bf16-true", blocks_per_unit=blocks_per_unit)
    num_units = N_LAYERS // blocks_per_unit
    fetches = weight_fetches(build_tasks(kind, num_units, micro))
    if kind == "vertical":
        assert len(fetches) == 2 * num_units - 1
    else:
        assert len(fetches) == micro * (2 * num_units - 1) - (micro - 1)
    assert all(u["weights_ssd"] == round_up(u["numel"] * BF16) for u in stats.units)
    expected = sum(stats.units[u]["weights_ssd"] for u in fetches)
    for step in range(STEPS):
        assert stats.traffic[step]["ssd/weights/read"] == expected, (step, stats.traffic[step])
        assert "ssd/weights/read" not in stats.optimizer_traffic[step]
    assert stats.run_total["ssd/weights/read"] == STEPS * expected


def test_vertical_weight_traffic_independent_of_m_horizontal_grows(tmp_path):
    reads = {}
    for kind in ("vertical", "horizontal"):
        for micro in (2, 4):
            stats = run(tmp_path, SSD_WEIGHTS, kind, micro, precision="bf16-true", steps=1)
            reads[kind, micro] = stats.traffic[0]["ssd/weights/read"]
    unit_bytes = round_up(P * BF16)
    assert reads["vertical", 2] == reads["vertical", 4] == (2 * N_LAYERS - 1) * unit_bytes
    assert reads["horizontal", 2] == (2 * (2 * N_LAYERS - 1) - 1) * unit_bytes
    assert reads["horizontal", 4] == (4 * (2 * N_LAYERS - 1) - 3) * unit_bytes
    assert reads["horizontal", 4] > reads["horizontal", 2] > reads["vertical", 2]


def test_mixed_weight_split_host_and_ssd_reads(tmp_path):
    storage = {"weights": {"host": 0.5, "ssd": 0.5}, "optimizer": "ssd"}
    stats = run(tmp_path, storage, "vertical", 3, precision="bf16-true")
    fetches = weight_fetches(stats.tasks)
    assert len(fetches) == 2 * N_LAYERS - 1
    for unit in stats.units:
        assert unit["weights_host"] > 0 and unit["weights_ssd"] > 0
    for step in range(STEPS):
        traffic = stats.traffic[step]
        assert traffic["ssd/weights/read"] == sum(stats.units[u]["weights_ssd"] for u in fetches)
        assert traffic["host/weights/read"] == sum(stats.units[u]["weights_host"] for u in fetches)


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_fp32_weight_store_reads_are_fetches_plus_one_master_read(tmp_path, kind, alpha):
    # fp32: the optimizer reads and writes the same store the compute fetches from.
    micro = 3
    stats = run(tmp_path, SSD_WEIGHTS, kind, micro, alpha=alpha)
    fetch_bytes = sum(stats.units[u]["weights_ssd"] for u in weight_fetches(stats.tasks))
    master = stats.total("weights_ssd")
    backward_parts = sum(round_up((u["numel"] - u["forward_end"]) * FP32) for u in stats.units)
    assert (backward_parts == master) == (alpha == 0.0)
    # Step 1 steps only the backward parts; from step 2 on the previous step's forward parts join.
    assert stats.step_total(0)["ssd/weights/read"] == fetch_bytes + backward_parts
    assert stats.step_total(0)["ssd/weights/write"] == backward_parts
    assert stats.step_total(1)["ssd/weights/read"] == fetch_bytes + master
    assert stats.step_total(1)["ssd/weights/write"] == master
    assert stats.run_total["ssd/weights/read"] == STEPS * (fetch_bytes + master)
    assert stats.run_total["ssd/weights/write"] == STEPS * master


# ---------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("alpha", [0.0, 0.25])
@pytest.mark.parametrize("micro", [2, 3])
def test_gradient_traffic_vertical_once_horizontal_per_micro_batch(tmp_path, micro, alpha):
    vertical = run(tmp_path, ALL_SSD, "vertical", micro, alpha=alpha)
    horizontal = run(tmp_path, ALL_SSD, "horizontal", micro, alpha=alpha)
    full = vertical.total("grads_ssd")
    assert full == N_LAYERS * round_up(P * FP32)
    forward_parts = sum(u["forward_end"] * FP32 for u in vertical.units)  # splits are page multiples
    assert (forward_parts == 0) == (alpha == 0.0)
    for step in range(STEPS):
        v, h = vertical.step_total(step), horizontal.step_total(step)
        parked_before = forward_parts if step else 0  # read back by this step's forward
        # Vertical: only the forward part of each complete gradient leaves, once.
        assert v["ssd/gradients/write"] == forward_parts, (step, v)
        assert v["ssd/gradients/read"] == parked_before, (step, v)
        # Horizontal: every micro-batch but the last writes the partial sum, the next re-reads it.
        assert h["ssd/gradients/write"] == (micro - 1) * full + forward_parts, (step, h)
        assert h["ssd/gradients/read"] == (micro - 1) * full + parked_before, (step, h)
    assert vertical.run_total["ssd/gradients/write"] == vertical.run_total["ssd/gradients/read"] == STEPS * forward_parts


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
def test_host_gradient_and_checkpoint_bytes(tmp_path, kind):
    micro = 3
    stats = run(tmp_path, SSD_WEIGHTS, kind, micro, alpha=0.0)
    step = stats.step_total(1)
    # alpha=0: a complete gradient goes straight to the optimizer, never into the store.
    assert step["host/gradients/write"] == step["host/gradients/read"] == (
        0 if kind == "vertical" else (micro - 1) * N_LAYERS * P * FP32)
    # Checkpoints: the input of every unit for every micro-batch is stored once; forward tasks read
    # units 0..N-2, backward tasks read every unit.
    for traffic in stats.traffic:
        assert traffic["host/checkpoints/write"] == N_LAYERS * micro * ACT_BYTES
        assert traffic["host/checkpoints/read"] == (2 * N_LAYERS - 1) * micro * ACT_BYTES


# ---------------------------------------------------------------------------------------- optimizer
@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
def test_optimizer_reads_and_writes_each_state_once_per_unit_per_step(tmp_path, kind):
    stats = run(tmp_path, SSD_WEIGHTS, kind, 2)
    moments = {state: stats.total(f"{state}_ssd") for state in ("exp_avg", "exp_avg_sq")}
    assert moments["exp_avg"] == moments["exp_avg_sq"] == N_LAYERS * round_up(P * FP32)
    for state, nbytes in moments.items():
        assert stats.step_total(1)[f"ssd/{state}/read"] == nbytes
        assert stats.step_total(1)[f"ssd/{state}/write"] == nbytes
        assert stats.run_total[f"ssd/{state}/read"] == STEPS * nbytes
        assert stats.run_total[f"ssd/{state}/write"] == STEPS * nbytes
    # fp32 keeps no separate master store.
    assert not any("/master/" in key for key in stats.run_total)


def test_bf16_true_separate_master_once_per_step(tmp_path):
    stats = run(tmp_path, ALL_SSD, "vertical", 2, precision="bf16-true")
    fetch_bytes = sum(stats.units[u]["weights_ssd"] for u in weight_fetches(stats.tasks))
    for unit in stats.units:
        assert not unit["weights_is_master"]
        assert unit["weights_ssd"] == round_up(P * BF16) and unit["master_ssd"] == round_up(P * FP32)
    master, weights = stats.total("master_ssd"), stats.total("weights_ssd")
    forward_parts = sum(u["forward_end"] * FP32 for u in stats.units)
    expected_run = {
        "ssd/master/read": STEPS * master, "ssd/master/write": STEPS * master,
        "ssd/exp_avg/read": STEPS * master, "ssd/exp_avg/write": STEPS * master,
        "ssd/exp_avg_sq/read": STEPS * master, "ssd/exp_avg_sq/write": STEPS * master,
        "ssd/gradients/read": STEPS * forward_parts, "ssd/gradients/write": STEPS * forward_parts,
        "ssd/weights/read": STEPS * fetch_bytes,  # compute fetches only: the optimizer reads the master
        "ssd/weights/write": STEPS * weights,  # the new bf16 compute copy, once per step
    }
    assert {k: v for k, v in stats.run_total.items() if k.startswith("ssd/")} == expected_run


# ---------------------------------------------------------------------------------------- per-step stats
class SlowHooks(L.Callback):
    """Lightning hooks between the engine's compute phase and its optimizer phase that take a while
    (a logger flushing, a callback computing a norm): the optimizer worker finishes meanwhile.

    Waiting for the worker here (rather than sleeping) makes that timing deterministic under load."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        trainer.strategy.engine.flush()  # waits for the worker's backward parts (nothing else is pending)


def test_step_stats_account_for_every_byte(tmp_path):
    stats = run(tmp_path, ALL_SSD, "vertical", 2, callbacks=(SlowHooks(),))
    for step in range(STEPS):
        phases = Counter(stats.traffic[step]) + Counter(stats.optimizer_traffic[step])
        assert phases == stats.step_total(step), step


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
@pytest.mark.parametrize("prefetch_depth", [0, 2])
def test_prefetch_depth_does_not_change_weight_bytes(tmp_path, kind, prefetch_depth):
    micro = 3
    stats = StepStats()
    fit_snake(GPTModule(SMALL_GPT), token_loader(micro, micro, SMALL_GPT.context_len, SMALL_GPT.vocab_size), steps=1,
              storage=dict(SSD_WEIGHTS, ssd_dir=str(tmp_path / "ssd")),
              schedule={"kind": kind, "num_micro_batches": micro, "prefetch_depth": prefetch_depth},
              precision="bf16-true", callbacks=[stats], record=None, seed=None)
    fetches = weight_fetches(build_tasks(kind, N_LAYERS, micro))
    assert stats.traffic[0]["ssd/weights/read"] == len(fetches) * round_up(P * BF16)
