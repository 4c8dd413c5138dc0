"""The planner's traffic model, roofline and choices, checked against hand calculations."""
import dataclasses

import pytest

from snake_strategy.config import StorageConfig
from snake_strategy.planning.calibration import UnitTiming
from snake_strategy.planning.memory_model import host_plan
from snake_strategy.planning.placement import choose_alpha, memory_inputs, plan
from snake_strategy.planning.time_model import (HardwareProfile, ModelShape, compute_seconds, predict, step_flops,
                                                step_flops_split, weight_fetches_per_step)

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


def test_forward_and_backward_at_their_own_rates_and_the_timed_nonlayer_work_instead_of_the_head_flops():
    shape = ModelShape(num_units=2, params_per_unit=8192, nonlayer_params=0, head_params=1000, tokens_per_micro=10,
                       num_micro=2, checkpoint_bytes=100)
    # per micro-batch: unit 0 forward + recompute + backward (input and weight gradients), unit 1 forward +
    # backward; the head 2 x 1000 x 10 forward, twice that backward
    forward, backward = step_flops_split(shape)
    assert (forward, backward) == (2 * (3 * 163_840 + 20_000), 2 * (4 * 163_840 + 40_000))
    hw = dataclasses.replace(HW, backward_flops_per_s=0.5e9)
    assert compute_seconds(shape, hw) == pytest.approx(forward / 1e9 + backward / 0.5e9)
    timed = dataclasses.replace(hw, nonlayer_s_per_token=1e-3)  # 20 tokens a step
    assert compute_seconds(shape, timed) == pytest.approx((forward - 40_000) / 1e9 + (backward - 80_000) / 0.5e9
                                                          + 20e-3)


def test_the_cpu_bound_adds_what_shares_the_cores():
    hw = dataclasses.replace(HW, ssd_cpu_s_per_gb=2.0, flops_per_s=1e12)
    p = predict(SHAPE, hw, StorageConfig(weights={"host": 0.5, "ssd": 0.5}), "vertical", alpha=0.0)
    assert p.host_copy_s > 0 and p.ssd_read_bytes > 0
    assert p.bound == "cpu"
    assert p.roofline_s == pytest.approx(p.compute_s + p.optimizer_s + p.host_copy_s
                                         + (p.ssd_read_bytes + p.ssd_write_bytes) / 1e9 * 2.0)


def test_a_timed_unit_gives_the_rates_of_its_own_flops():
    shape = dataclasses.replace(SHAPE, attention_flops_per_token_per_unit=100.0)
    timing = UnitTiming(forward_s=0.5, backward_s=2.0, params=8192, trained=4096, tokens=10, kept_units=1,
                        graph_bytes_per_unit=64, nonlayer_s=0.1)
    forward = (2 * 8192 + 100) * 10
    assert timing.rates(shape) == pytest.approx({"flops_per_s": forward / 0.5,
                                                 "backward_flops_per_s": 1.5 * forward / 2.0,
                                                 "nonlayer_s_per_token": 0.01})


def test_a_deferring_step_waits_in_the_forward_for_its_whole_optimizer_traffic():
    # Moments on the SSD, everything else in memory; a disk fast enough for the whole step's traffic (0.61 ms
    # against 2.29 ms of compute) but not for the forward's 0.33 ms when every update runs there.
    hw = dataclasses.replace(HW, ssd_read_gb_per_s=0.4, ssd_write_gb_per_s=0.8, optimizer_params_per_s=1e9,
                             device_is_cpu=False)
    storage = StorageConfig(optimizer="ssd", rollback="ssd")
    forward_s = 2 * 163_840 / 1e9  # unit 0's forward, both micro-batches: the forward pass
    backward_s = 2 * 7 * 163_840 / 1e9 - forward_s
    speculated = predict(SHAPE, hw, storage, "vertical", alpha=0.5, speculative=True)
    # the forward part's updates (half the moments, 65,536 bytes each way) fit under the forward's compute
    assert speculated.bound == "compute" and speculated.roofline_s == pytest.approx(forward_s + backward_s)
    deferring = predict(SHAPE, hw, storage, "vertical", alpha=0.5, speculative=True, deferring=True)
    # the forward reads both units' moments (2 x 65,536) and the backward parts' raw gradients saved in the
    # rollback store (2 x 4096 x 4 bytes, written by the backward), and writes the moments back
    forward_ssd_s = (2 * 65_536 + 2 * 16_384) / 0.4e9 + 2 * 65_536 / 0.8e9
    assert (deferring.ssd_read_bytes, deferring.ssd_write_bytes) == (2 * 65_536 + 2 * 16_384,
                                                                     2 * 65_536 + 2 * 16_384)
    assert deferring.bound == "ssd" and deferring.roofline_s == pytest.approx(forward_ssd_s + backward_s)
    # the whole step's SSD time alone is under its compute: without phases the floor would be compute
    assert deferring.ssd_s < deferring.compute_s < deferring.roofline_s
