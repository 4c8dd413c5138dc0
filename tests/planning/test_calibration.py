"""The rates a step measured (planning/calibration.py), the knee (planning/time_model.py) and the prefetch rule
(planning/placement.py), by hand."""
import dataclasses

import pytest

from snake_strategy.config import StorageConfig
from snake_strategy.planning.calibration import MeasuredStep, calibrated, missed
from snake_strategy.planning.placement import prefetch_depth
from snake_strategy.planning.time_model import HardwareProfile, ModelShape, knee, predict, step_flops

SHAPE = ModelShape(num_units=4, params_per_unit=8192, nonlayer_params=0, head_params=0, tokens_per_micro=10,
                   num_micro=2, checkpoint_bytes=100)
HW = HardwareProfile(ssd_read_gb_per_s=1.0, ssd_write_gb_per_s=2.0, host_copy_gb_per_s=1e3, flops_per_s=1e9,
                     optimizer_params_per_s=1e9, device_is_cpu=False)
SSD = StorageConfig(weights="ssd", optimizer="ssd")


def test_the_calibrated_profile_reproduces_the_measured_busy_times():
    before = predict(SHAPE, HW, SSD, "vertical", alpha=0.0)
    measured = MeasuredStep(step_s=1.0, compute_s=0.25, ssd_busy_s=0.5, optimizer_busy_s=0.125)
    hw = calibrated(HW, SHAPE, before, measured)
    after = predict(SHAPE, hw, SSD, "vertical", alpha=0.0)
    assert hw.measured_in_step and hw.flops_per_s == pytest.approx(step_flops(SHAPE) / 0.25)
    assert (after.compute_s, after.ssd_s, after.optimizer_s) == pytest.approx((0.25, 0.5, 0.125))
    assert after.bound == "ssd" and after.roofline_s == pytest.approx(0.5)
    assert missed(after, measured) == pytest.approx(-0.5)  # a floor below the step: pessimism is positive


def test_rates_measured_in_a_step_do_not_add_the_cpu_sharing_term_again():
    cpu = dataclasses.replace(HW, device_is_cpu=True)
    assert predict(SHAPE, cpu, SSD, "vertical", alpha=0.0).bound in ("cpu", "ssd")
    measured = dataclasses.replace(cpu, measured_in_step=True, flops_per_s=1.0)  # compute far the largest
    p = predict(SHAPE, measured, SSD, "vertical", alpha=0.0)
    assert p.bound == "compute" and p.roofline_s == p.compute_s


def test_a_resource_nothing_measured_keeps_the_probes_rate():
    host = StorageConfig()
    before = predict(SHAPE, HW, host, "vertical", alpha=0.0)
    hw = calibrated(HW, SHAPE, before, MeasuredStep(1.0, 0.5, 0.0, 0.1))
    assert (hw.ssd_read_gb_per_s, hw.ssd_write_gb_per_s) == (HW.ssd_read_gb_per_s, HW.ssd_write_gb_per_s)


def test_the_knee_is_the_first_micro_batch_count_where_compute_outlasts_the_disk():
    # 4 units on the SSD: the weights and the optimizer's bytes do not grow with micro-batches, compute does
    hw = dataclasses.replace(HW, flops_per_s=1e10)
    k = knee(SHAPE, hw, SSD, "vertical", 0.0)
    assert k.bound_below == "ssd" and k.tokens_per_step is not None
    micro = k.tokens_per_step // SHAPE.tokens_per_micro
    at = predict(dataclasses.replace(SHAPE, num_micro=micro), hw, SSD, "vertical", 0.0)
    below = predict(dataclasses.replace(SHAPE, num_micro=micro - 1), hw, SSD, "vertical", 0.0)
    assert at.bound == "compute" and below.bound == "ssd"
    here = predict(SHAPE, hw, SSD, "vertical", 0.0)
    assert k.waiting_share == pytest.approx(1 - here.compute_s / here.ssd_s)
    assert f"ssd-bound below ~{k.tokens_per_step} tokens/step; at 20 tokens/step" in k.describe()
    # all in memory: compute-bound at any size
    assert "compute-bound at any" in knee(SHAPE, hw, StorageConfig(), "vertical", 0.0).describe()


def test_prefetch_depth_follows_the_rates_only_with_weights_on_the_ssd():
    assert prefetch_depth(StorageConfig())[0] == 1
    assert prefetch_depth(SSD)[0] == 2  # rates unknown: the deeper one, which the placement is sized for
    disk_bound = predict(SHAPE, dataclasses.replace(HW, flops_per_s=1e12), SSD, "vertical", 0.0)
    compute_bound = predict(SHAPE, dataclasses.replace(HW, flops_per_s=1e3), SSD, "vertical", 0.0)
    assert prefetch_depth(SSD, disk_bound)[0] == 2 and prefetch_depth(SSD, compute_bound)[0] == 1


def test_the_steady_steps_median_sets_the_rates():
    """One slow step among the steady ones does not set the rates: the calibration takes every field's median."""
    steps = [MeasuredStep(45.0, 44.0, 11.5, 15.5), MeasuredStep(37.0, 36.0, 9.5, 14.5),
             MeasuredStep(33.0, 33.0, 8.0, 12.0)]
    assert MeasuredStep.median(steps) == MeasuredStep(37.0, 36.0, 9.5, 14.5)
    assert MeasuredStep.median(steps[:2]) == MeasuredStep(41.0, 40.0, 10.5, 15.0)
    assert MeasuredStep.median(steps[:1]) == steps[0]
