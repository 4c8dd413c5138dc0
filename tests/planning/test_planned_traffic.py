"""The planner's predicted bytes per optimizer step (``strategy.prediction``, from the first step's
shapes) equal the bytes the engine really moves in a steady-state step (its counters).

The prediction has the SSD bytes (``ssd_read_bytes``, ``ssd_write_bytes``) and the host-copy time,
``host_copy_s = host bytes / host_copy_gb_per_s``, whose host bytes cover the compute weights and the
optimizer states (master, moments); the host's gradient and checkpoint traffic is not part of it.
A steady-state step is measured from one ``on_train_batch_start`` to the next (step 2 to step 3), so
the deferred forward-part updates of the previous step are inside the window, as in the model.
"""
from collections import Counter

import lightning as L
import pytest

from snake_strategy.gpt import GPTModule
from tests.helpers import SMALL_GPT, fit_snake, token_loader

MICRO, STEPS, CONTEXT = 6, 4, 16  # 6 micro-batches: 2 per unit are off the turning points (SSD checkpoints)
LAYOUTS = {
    "host": {},
    "ssd": {"weights": "ssd", "master": "ssd", "optimizer": "ssd"},
    "ssd_all": {"weights": "ssd", "master": "ssd", "optimizer": "ssd", "checkpoints": "ssd"},
}
HOST_MODELLED = ("weights", "master", "exp_avg", "exp_avg_sq")


class _Window(L.Callback):
    def __init__(self):
        self.snapshots = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.snapshots.append(trainer.strategy.engine.counters.snapshot())


def _measure(module, kind, layout, precision, ssd_dir):
    window = _Window()
    strategy = fit_snake(module, token_loader(STEPS * MICRO, MICRO, CONTEXT, 64), steps=STEPS,
                         storage=dict(LAYOUTS[layout], ssd_dir=str(ssd_dir)),
                         schedule={"kind": kind, "num_micro_batches": MICRO, "alpha": 0.25}, precision=precision,
                         callbacks=[window], record=None).strategy
    assert len(window.snapshots) == STEPS
    before, after = window.snapshots[2], window.snapshots[3]
    delta = Counter({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)})
    prediction, hardware = strategy.prediction, strategy.hardware_profile
    measured = {
        "ssd_read": sum(v for (tier, _, d), v in delta.items() if tier == "ssd" and d == "read"),
        "ssd_write": sum(v for (tier, _, d), v in delta.items() if tier == "ssd" and d == "write"),
        "host": sum(v for (tier, state, _), v in delta.items() if tier == "host" and state in HOST_MODELLED),
    }
    predicted = {
        "ssd_read": prediction.ssd_read_bytes,
        "ssd_write": prediction.ssd_write_bytes,
        "host": round(prediction.host_copy_s * hardware.host_copy_gb_per_s * 1e9),
    }
    return predicted, measured, delta


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
def test_predicted_ssd_bytes_equal_measured_for_a_gpt(tmp_path, kind):
    predicted, measured, delta = _measure(GPTModule(SMALL_GPT), kind, "ssd", "32-true", tmp_path / "ssd")
    assert predicted == measured, (predicted, measured, sorted(delta.items()))


@pytest.mark.parametrize("layout", ["ssd", "host"])
def test_planner_bytes_equal_counters_with_half_storage(tmp_path, layout):
    predicted, measured, delta = _measure(GPTModule(SMALL_GPT), "vertical", layout, "bf16-mixed", tmp_path / layout)
    assert predicted == measured, (predicted, measured, sorted(delta.items()))
    assert measured["ssd_read"] > 0 or layout == "host"
