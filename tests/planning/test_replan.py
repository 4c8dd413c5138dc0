"""The prediction is checked against the first steady step; a wrong one is re-planned with the measured rates
(planning/calibration.py), the run switches to the re-planned settings between steps, and the math does not
change: fp64 against plain Lightning, every step, before and after the switch."""
from __future__ import annotations

import time

import lightning as L
import torch

import snake_strategy
from snake_strategy.planning.time_model import HardwareProfile
from tests.helpers import SMALL_GPT, fit_snake, run_reference, token_loader
from snake_strategy.gpt import GPTModule

STEPS, MICRO, MICRO_SIZE = 5, 4, 2
# The disk, slowed down deterministically: every SSD chunk sleeps as if moved at this rate per I/O thread.
SLOW_SSD_BYTES_PER_S = 2e6
IO_THREADS = 2


# The second fit of test_a_prediction_within_15_percent_is_kept must see the first one's rates: a disk twice as
# slow again makes sleeping most of its step, so a machine whose load changes between the two fits moves the
# step less (two busy loops started beside the test: 1 of 2 runs missed by 18% at SLOW_SSD_BYTES_PER_S, 1 of 12
# at this rate).
SLOWER_SSD_BYTES_PER_S = 1e6


def _slow_disk(direction: str, num_bytes: int, bytes_per_s: float = SLOW_SSD_BYTES_PER_S) -> None:
    time.sleep(num_bytes / bytes_per_s)


def _slower_disk(direction: str, num_bytes: int) -> None:
    _slow_disk(direction, num_bytes, SLOWER_SSD_BYTES_PER_S)


class _AheadAtStep(L.Callback):
    """How many units each step had on their way when it needed one (``TaskTrace``'s fetch records): the
    prefetch depth the engine really ran."""

    def __init__(self) -> None:
        self.ahead: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        fetches = trainer.strategy.engine.trace.last.fetches
        self.ahead.append(max((sum(1 for other in fetches[i + 1:] if other.issued_s < f.needed_s)
                               for i, f in enumerate(fetches)), default=0))


def test_a_profile_off_by_3x_is_replanned_after_the_first_steady_step_and_the_math_stays():
    # The profile says the disk is 3x faster than it is, and the compute of a slow machine (0.08 GFLOP/s):
    # the first plan thinks compute hides the disk (one unit ahead); the steps measure a disk that outlasts it.
    # The margins hold on a loaded machine: the slowed disk takes about 2.5x the real compute of an idle one,
    # so compute at a third of its speed (the suite beside another job) still does not hide it.
    profile = HardwareProfile(ssd_read_gb_per_s=3 * IO_THREADS * SLOW_SSD_BYTES_PER_S / 1e9,
                              ssd_write_gb_per_s=3 * IO_THREADS * SLOW_SSD_BYTES_PER_S / 1e9, flops_per_s=8e7)
    ahead = _AheadAtStep()
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true")
    loader = token_loader(STEPS * MICRO * MICRO_SIZE, MICRO * MICRO_SIZE, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    run = fit_snake(lambda: GPTModule(SMALL_GPT, learning_rate=1e-3), loader, steps=STEPS, precision="64-true",
                    storage={"weights": "ssd", "optimizer": "ssd", "gradients": "host", "checkpoints": "host"},
                    schedule={"num_micro_batches": MICRO}, callbacks=[ahead], hardware=profile, record="last",
                    hooks=snake_strategy.EngineHooks(before_ssd_transfer=_slow_disk))
    plan = run.strategy.plan
    c = plan.calibration
    assert c is not None and c["step"] == 2 and c["replanned"], c
    # Corrected: the disk path. "ssd" and "optimizer" tie here (the optimizer worker's busy time includes its own
    # state's reads and writes on the slowed disk: see test_a_prediction_within_15_percent_is_kept).
    assert c["predicted_bound"] in ("compute", "cpu") and c["corrected_bound"] in ("ssd", "optimizer"), c
    assert abs(c["error"]) > 0.15 and c["changes"] == {"prefetch_depth": [1, 2]}, c
    assert plan.schedule.prefetch_depth == 2 and "busier than compute" in plan.reasons["prefetch_depth"]
    assert "corrected after step 2" in plan.describe() and plan.prediction.bound in ("ssd", "optimizer")
    # The engine ran one unit ahead up to the switch and two after it.
    assert ahead.ahead[:2] == [1, 1] and ahead.ahead[2:] == [2, 2, 2], ahead.ahead
    # The corrected prediction is the measured step's rates: it lands near the steps that follow.
    assert plan.hardware.measured_in_step
    # Parameters read only at the end (reading them between steps would apply the deferred updates there).
    for name, ref_value in ref[-1].items():
        torch.testing.assert_close(run.states[-1][name], ref_value, rtol=0, atol=1e-10, msg=name)


def test_a_prediction_within_15_percent_is_kept():
    # The profile from the steps themselves: a second run with the first run's measured rates is predicted
    # within 15% and not re-planned.
    loader = token_loader(3 * MICRO * MICRO_SIZE, MICRO * MICRO_SIZE, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    storage = {"weights": "ssd", "optimizer": "ssd", "gradients": "host", "checkpoints": "host"}
    schedule = {"num_micro_batches": MICRO}
    hooks = snake_strategy.EngineHooks(before_ssd_transfer=_slower_disk)
    first = fit_snake(lambda: GPTModule(SMALL_GPT, learning_rate=1e-3), loader, steps=3, precision="64-true",
                      storage=storage, schedule=schedule, record=None, hooks=hooks)
    measured = first.strategy.plan.hardware
    assert measured.measured_in_step  # the default probe missed the slowed disk by far more than 15%
    second = fit_snake(lambda: GPTModule(SMALL_GPT, learning_rate=1e-3), loader, steps=3, precision="64-true",
                       storage=storage, schedule=schedule, record=None, hooks=hooks, hardware=measured)
    c = second.strategy.plan.calibration
    assert c is not None and abs(c["error"]) <= 0.15 and not c["replanned"], c
    # The disk path, not compute, bounds it. Which of its two names wins is a tie: the optimizer worker's busy
    # time includes reading and writing its own state on the slowed disk, so both measure the same seconds
    # (measured on an AMD EPYC: ssd 0.4665 s, optimizer 0.4663 s; on an Intel Xeon ssd came out ahead).
    assert second.strategy.plan.prediction.bound in ("ssd", "optimizer")
    assert "-bound, " in second.strategy.plan.describe()


def test_a_rate_that_moves_mid_run_is_re_planned_after_the_calibration_steps_and_the_math_stays():
    # The disk binds from the start (slowed, so a load spike in compute does not decide the calibration at steps
    # 2-4) and slows down to half its speed from step 6 on: the watch over the last three steps re-plans once
    # their median has moved, from their rates; the math is fp64 against plain Lightning throughout.
    steps = 9
    slowed = {"on": False}

    def disk(direction: str, num_bytes: int) -> None:
        (_slower_disk if slowed["on"] else _slow_disk)(direction, num_bytes)

    class SlowerFromStep6(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            slowed["on"] = trainer.global_step >= 5

    ref = run_reference(SMALL_GPT, steps, MICRO, MICRO_SIZE, "64-true")
    loader = token_loader(steps * MICRO * MICRO_SIZE, MICRO * MICRO_SIZE, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    run = fit_snake(lambda: GPTModule(SMALL_GPT, learning_rate=1e-3), loader, steps=steps, precision="64-true",
                    storage={"weights": "ssd", "optimizer": "ssd", "gradients": "host", "checkpoints": "host"},
                    schedule={"num_micro_batches": MICRO}, callbacks=[SlowerFromStep6()], record="last",
                    hooks=snake_strategy.EngineHooks(before_ssd_transfer=disk))
    plan = run.strategy.plan
    c = plan.calibration
    # The slower steps are 6, 7, ...: their median leads from step 7 (two of three), at the latest from step 8.
    assert c is not None and c["replanned"] and c["step"] in (7, 8), c
    assert c["corrected_bound"] in ("ssd", "optimizer") and c["corrected_s"] > 1.5 * c["predicted_s"], c
    assert c["steps_measured"] == 3 and c["checks"][-1]["step"] == c["step"]
    assert plan.prediction.bound in ("ssd", "optimizer") and f"corrected after step {c['step']}" in plan.describe()
    for name, ref_value in ref[-1].items():
        torch.testing.assert_close(run.states[-1][name], ref_value, rtol=0, atol=1e-10, msg=name)
