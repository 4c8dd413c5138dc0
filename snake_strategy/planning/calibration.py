"""Calibration: what this run measured of itself, and the machine's rates that reproduce it.

Two measurements. Before step 1, the run's own unit timed forward and backward (``UnitTiming``, made by
engine/step/unit_timing.py): this model's compute rates at its shapes and precision. After the first steady
steps, what each resource was busy for (``MeasuredStep``): a prediction before step 1 comes from the hardware
probe (planning/machine.py), a few seconds of synthetic work on a machine whose rates move by 1.5x from one
day to the next and whose cores the compute and the optimizer share in ways a probe does not see. The engine
measures each resource's busy time in every step (``StepStats``: the main thread's compute, the SSD's busy
time, the optimizer worker's), so after the first steady step (step 1 also allocates, measures kept graphs
and writes the first file versions) the rates are taken from it (``calibrated``):

- compute FLOP/s: the forward's and the backward's rates scaled so that the step's FLOPs
  (``time_model.step_flops_split``) take the main thread's compute seconds;
- SSD: the probe's read and write rates scaled so that the step's bytes take the measured busy seconds;
- optimizer params/s = trainable parameters / the worker's busy seconds.

These rates were measured while compute and the optimizer shared the cores, so the corrected profile
says so (``HardwareProfile.measured_in_step``) and the CPU-sharing term is not added again. When the
prediction missed the measured step by more than ``REPLAN_MISS``, the settings that depend on rates are
chosen again with the corrected ones (``run_prediction.recalibrated``): today the prefetch depth
(``placement.prefetch_depth``), which the engine changes at a step boundary without touching the math.
Everything else the planner chose does not depend on rates (the placement fills the budget by bytes moved
per byte stored, alpha is the forward's share of the compute), so the corrected prediction is the only other
change.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from snake_strategy.moved import renamed
from snake_strategy.planning.time_model import HardwareProfile, ModelShape, StepPrediction, compute_seconds

# A prediction further than this from the measured step is re-planned with the measured rates.
REPLAN_MISS = 0.15
# The steps whose measurements correct the prediction: the first after the warm-up step, and the next ones up
# to CALIBRATION_STEPS steady steps, each checked against the median of the steady steps so far; every later step
# against the median of the last CALIBRATION_STEPS (run_prediction.RunPredictor.after_step). One slow step on a
# shared machine (measured: 22% above the next three at gpt_1b) must not set the rates the run reports.
STEADY_STEP = 2
CALIBRATION_STEPS = 3


@dataclass(frozen=True)
class MeasuredStep:
    """What one steady step measured, in seconds (``StepStats`` and the step's wall time)."""

    step_s: float
    compute_s: float  # the main thread's forward and backward work, waits excluded
    ssd_busy_s: float  # the disk moving any chunk
    optimizer_busy_s: float  # the optimizer worker stepping

    @classmethod
    def from_stats(cls, step_s: float, stats) -> MeasuredStep:
        """From the engine's ``StepStats`` of the step and its wall time."""
        compute = stats.train_s - stats.io_wait_s - stats.backpressure_wait_s
        return cls(step_s, max(compute, 0.0), stats.ssd_busy_s, stats.optimizer_busy_s)

    @classmethod
    def median(cls, steps: list[MeasuredStep]) -> MeasuredStep:
        """Every field's median over ``steps`` (the middle two's mean for an even count)."""
        assert steps, "a median needs at least one step"
        return cls(*(statistics.median(getattr(m, f.name) for m in steps) for f in dataclasses.fields(cls)))


@dataclass(frozen=True)
class UnitTiming:
    """One unit's forward and backward timed before step 1 (engine/step/unit_timing.py): this model's compute
    rates at the run's shapes and precision, and the kept graphs "auto" is expected to choose from the size
    of the forward graph it recorded."""

    forward_s: float
    backward_s: float
    params: int  # the timed unit's parameters
    trained: int  # of which have a weight gradient
    tokens: int  # in the timed pass
    kept_units: int  # units the first step is expected to keep the forward graph of
    graph_bytes_per_unit: int
    nonlayer_s: float | None = None  # the non-layer work over the same tokens, forward and backward (None: untimed)

    def rates(self, shape: ModelShape) -> dict[str, float]:
        """The ``HardwareProfile`` rates this timing gives, its FLOPs counted as ``time_model.step_flops_split``
        counts a step's: a forward of ``params`` over ``tokens``, a backward of the input gradient (one forward's
        worth) and the weight gradient (the ``trained`` share of one)."""
        forward = (2 * self.params + shape.attention_flops_per_token_per_unit) * self.tokens
        backward = forward * (1 + self.trained / max(1, self.params))
        rates = {"flops_per_s": forward / self.forward_s, "backward_flops_per_s": backward / self.backward_s}
        if self.nonlayer_s is not None:
            rates["nonlayer_s_per_token"] = self.nonlayer_s / self.tokens
        return rates


def calibrated(hw: HardwareProfile, shape: ModelShape, prediction: StepPrediction,
               measured: MeasuredStep) -> HardwareProfile:
    """The profile whose rates give this step's measured busy times (a rate with nothing measured, such as
    the SSD's when nothing is on it, stays the probe's)."""
    rates: dict[str, float] = {"measured_in_step": True}
    if measured.compute_s > 0:
        faster = compute_seconds(shape, hw) / measured.compute_s
        rates["flops_per_s"] = hw.flops_per_s * faster
        if hw.backward_flops_per_s is not None:
            rates["backward_flops_per_s"] = hw.backward_flops_per_s * faster
        if hw.nonlayer_s_per_token is not None:
            rates["nonlayer_s_per_token"] = hw.nonlayer_s_per_token / faster
    if measured.ssd_busy_s > 0 and prediction.ssd_s > 0:
        faster = prediction.ssd_s / measured.ssd_busy_s
        rates["ssd_read_gb_per_s"] = hw.ssd_read_gb_per_s * faster
        rates["ssd_write_gb_per_s"] = hw.ssd_write_gb_per_s * faster
    params = sum(shape.trainable) + shape.nonlayer_params
    if measured.optimizer_busy_s > 0 and params:
        rates["optimizer_params_per_s"] = params / measured.optimizer_busy_s
    return dataclasses.replace(hw, **rates)


def missed(prediction: StepPrediction, measured: MeasuredStep) -> float:
    """The prediction's relative error against the measured step (positive: pessimistic)."""
    return prediction.roofline_s / measured.step_s - 1.0 if measured.step_s > 0 else 0.0


__getattr__ = renamed(__name__)  # the old paths of Knee and knee, which the time model holds (snake_strategy/moved.py)
