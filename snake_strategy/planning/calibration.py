"""The prediction corrected by what the steps measure, the re-plan it leads to, and the knee of the run.

A prediction before step 1 comes from the hardware probe (planning/hardware.py): a few seconds of
synthetic work, on a machine whose rates move by 1.5x from one day to the next and whose cores the
compute and the optimizer share in ways a probe does not see. The engine measures each resource's busy
time in every step (``StepStats``: the main thread's compute, the SSD's busy time, the optimizer worker's),
so after the first steady step (step 1 also allocates, measures kept graphs and writes the first file
versions) the rates are taken from it:

- compute FLOP/s: the forward's and the backward's rates scaled so that the step's FLOPs
  (``planner.step_flops_split``) take the main thread's compute seconds;
- SSD: the probe's read and write rates scaled so that the step's bytes take the measured busy seconds;
- optimizer params/s = trainable parameters / the worker's busy seconds.

These rates were measured while compute and the optimizer shared the cores, so the corrected profile
says so (``HardwareProfile.measured_in_step``) and the CPU-sharing term is not added again. When the
prediction missed the measured step by more than ``REPLAN_MISS``, the settings that depend on rates are
chosen again with the corrected ones (``planning.prediction.recalibrated``): today the prefetch depth (``planner.prefetch_depth``),
which the engine changes at a step boundary without touching the math. Everything else the planner chose
does not depend on rates (the placement fills the budget by bytes moved per byte stored, alpha is the
forward's share of the compute), so the corrected prediction is the only other change.

The knee (``knee``): the tokens per step from which compute outlasts every other resource. Below it
the step waits on the SSD (or the optimizer) and more micro-batches cost little; above it every micro-batch
adds its compute.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from snake_strategy.config import StorageConfig
from snake_strategy.planning.planner import HardwareProfile, ModelShape, StepPrediction, compute_seconds, predict

# A prediction further than this from the measured step is re-planned with the measured rates.
REPLAN_MISS = 0.15
# The steps whose measurements correct the prediction: the first after the warm-up step, and the next ones up
# to CALIBRATION_STEPS steady steps, each checked against the median of the steady steps so far. One slow step
# on a shared machine (measured: 22% above the next three at gpt_1b) must not set the rates the run reports.
STEADY_STEP = 2
CALIBRATION_STEPS = 3
# The knee is searched up to this many micro-batches per step.
KNEE_MAX_MICRO = 4096
COMPUTE_BOUNDS = ("compute", "cpu")


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


@dataclass(frozen=True)
class Knee:
    """Where this run turns compute-bound: ``tokens_per_step`` (None: not below ``KNEE_MAX_MICRO``
    micro-batches), the bound below it, and at the run's own tokens per step the share of the step
    that waits on that bound (0 when compute-bound)."""

    tokens_per_step: int | None
    bound_below: str
    run_tokens_per_step: int
    waiting_share: float

    def describe(self) -> str:
        if self.bound_below in COMPUTE_BOUNDS:
            return "compute-bound at any tokens per step"
        if self.tokens_per_step is None:
            return (f"{self.bound_below}-bound up to {KNEE_MAX_MICRO} micro-batches (more micro-batches are "
                    "almost free)")
        text = f"{self.bound_below}-bound below ~{self.tokens_per_step} tokens/step"
        if self.waiting_share > 0:
            text += (f"; at {self.run_tokens_per_step} tokens/step {100 * self.waiting_share:.0f}% of the step "
                     f"waits on the {self.bound_below}")
        else:
            text += f"; this run ({self.run_tokens_per_step} tokens/step) is compute-bound"
        return text

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def knee(shape: ModelShape, hw: HardwareProfile, storage: StorageConfig, kind: str, alpha: float,
         speculative: bool = False) -> Knee:
    """The smallest tokens per step (more micro-batches of this run's size) at which the predicted bound is
    compute, for this placement and schedule (``planner.predict`` at each count)."""
    tokens_per_micro = shape.tokens_per_micro
    here = predict(shape, hw, storage, kind, alpha, speculative)
    below = predict(dataclasses.replace(shape, num_micro=1), hw, storage, kind, alpha, speculative)
    run_tokens = shape.num_micro * tokens_per_micro
    waiting = 0.0 if here.bound in COMPUTE_BOUNDS else 1.0 - here.compute_s / here.roofline_s
    if below.bound in COMPUTE_BOUNDS:
        return Knee(tokens_per_micro, below.bound, run_tokens, waiting)
    lo, hi = 1, KNEE_MAX_MICRO  # bisect: compute grows with micro-batches faster than any other term
    if predict(dataclasses.replace(shape, num_micro=hi), hw, storage, kind, alpha, speculative).bound \
            not in COMPUTE_BOUNDS:
        return Knee(None, below.bound, run_tokens, waiting)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        bound = predict(dataclasses.replace(shape, num_micro=mid), hw, storage, kind, alpha, speculative).bound
        lo, hi = (lo, mid) if bound in COMPUTE_BOUNDS else (mid, hi)
    return Knee(hi * tokens_per_micro, below.bound, run_tokens, waiting)
