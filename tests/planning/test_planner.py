"""The planner's traffic model, roofline and choices, checked against hand calculations."""
import pytest

from snake_strategy.config import StorageConfig
from snake_strategy.planning.memory import host_plan
from snake_strategy.planning.planner import (HardwareProfile, ModelShape, choose_alpha, memory_inputs, plan, predict,
                                             step_flops, weight_fetches_per_step)

# 8192 parameters per unit: 32 KiB in fp32, whole pages (the engine page-rounds every SSD transfer), and
# an alpha=0.5 forward part of exactly 4096 elements (forward parts are page-aligned).
SHAPE = ModelShape(num_units=2, params_per_unit=8192, nonlayer_params=0, head_params=0, tokens_per_micro=10,
                   num_micro=2, checkpoint_bytes=100)
HW = HardwareProfile(ssd_read_gb_per_s=1.0, ssd_write_gb_per_s=2.0, host_copy_gb_per_s=10.0, flops_per_s=1e9,
                     optimizer_params_per_s=1e6, device_is_cpu=True)


def test_weight_fetches():
    assert weight_fetches_per_step("vertical", 4, 3) == 7
    assert weight_fetches_per_step("horizontal", 4, 3) == 3 * 7 - 2


def test_step_flops_by_hand():
    # forward of one unit on one micro-batch: 2 x 8192 params x 10 tokens = 163,840 FLOPs; per micro-batch
    # the units cost 3x forward each plus one recompute for all but the last: (4 x 2 - 1) x 163,840
    assert step_flops(SHAPE) == 2 * (7 * 163_840)


def test_prediction_by_hand():
    storage = StorageConfig(weights="ssd", optimizer="ssd")
    p = predict(SHAPE, HW, storage, "vertical", alpha=0.0)
    expected_read = 3 * 32768 + 16384 * 4 + 2 * 16384 * 4  # fetches + master + 2 moments (P = 16384)
    expected_write = 16384 * 4 + 2 * 16384 * 4
    assert (p.ssd_read_bytes, p.ssd_write_bytes) == (expected_read, expected_write)
    assert p.ssd_s == pytest.approx(expected_read / 1e9 + expected_write / 2e9)
    assert p.compute_s == pytest.approx(2 * 7 * 163_840 / 1e9)
    assert p.optimizer_s == pytest.approx(16384 / 1e6)
    assert p.bound == "cpu" and p.roofline_s == pytest.approx(p.compute_s + p.optimizer_s)


def test_horizontal_reads_more_and_alpha_parks_gradients():
    storage = StorageConfig(weights="ssd", optimizer="ssd", gradients="ssd")
    v = predict(SHAPE, HW, storage, "vertical", alpha=0.5)
    h = predict(SHAPE, HW, storage, "horizontal", alpha=0.5)
    assert v.ssd_read_bytes == 3 * 32768 + 3 * 65536 + 0.5 * 65536  # + half the gradient read back
    # horizontal: 2 x 3 - 1 = 5 fetches, and one partial gradient round trip for M=2
    assert h.ssd_read_bytes == 5 * 32768 + 3 * 65536 + 1.5 * 65536


def test_ssd_transfers_are_page_rounded_per_unit_and_checkpoints_read_twice():
    storage = StorageConfig(weights="ssd", checkpoints="ssd", checkpoint_host_ends=0)
    shape = ModelShape(num_units=3, params_per_unit=1000, nonlayer_params=0, head_params=0, tokens_per_micro=10,
                       num_micro=2, checkpoint_bytes=100)
    p = predict(shape, HW, storage, "vertical", alpha=0.0)
    # 5 fetches of a 4000-byte unit, each a whole 4096-byte page; the master is the weights (fp32): one
    # read per unit by the optimizer; 2 SSD checkpoints per unit, each read by the forward and the recompute
    # (the last unit's once): (2 x 3 - 1) x 2 x 100 bytes.
    assert p.ssd_read_bytes == 5 * 4096 + 3 * 4096 + 5 * 2 * 100
    assert p.ssd_write_bytes == 3 * 4096 + 3 * 2 * 100


def test_choose_alpha_is_the_forward_share():
    shape = ModelShape(4, 1, 0, 0, 1, 1, 1)
    assert choose_alpha(shape) == pytest.approx(3 / 15)
    assert choose_alpha(ModelShape(40, 1, 0, 0, 1, 1, 1)) <= 0.5


def test_plan_fills_the_host_budget_weights_first():
    shape = ModelShape(num_units=10, params_per_unit=1_000_000, nonlayer_params=0, head_params=0,
                       tokens_per_micro=16, num_micro=4, checkpoint_bytes=1000)
    everything = plan(shape, HW, host_budget_bytes=2**30, alpha=choose_alpha(shape))
    assert everything.storage.weights.host == 1.0 and everything.storage.optimizer.host == 1.0
    tight = plan(shape, HW, host_budget_bytes=100_000_000, alpha=choose_alpha(shape))  # working set ~36 MB, weights 40 MB, moments 80 MB
    assert tight.storage.weights.host == 1.0 and tight.storage.optimizer.host < 1.0
    needed = host_plan(memory_inputs(shape, HW, tight.storage, "vertical", tight.alpha, prefetch_depth=2))
    assert sum(needed.values()) <= 100_000_000


def test_plan_that_cannot_fit_names_the_numbers():
    shape = ModelShape(10, 1_000_000, 0, 0, 16, 4, 1000)
    with pytest.raises(ValueError, match=r"host_budget_bytes=0.00 GiB \(1000 bytes\) cannot hold the working set"):
        plan(shape, HW, host_budget_bytes=1000, alpha=choose_alpha(shape))
