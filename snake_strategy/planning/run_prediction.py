"""The prediction of one fit, from before step 1 to its calibration: the one object the strategy asks.

``RunPredictor`` keeps what a fit's prediction needs between steps (the model's shape at the step's batch,
the machine's rates, the unit timed before step 1, the steady steps measured) and turns a plan into the
plan with its prediction:

- ``predict(plan, engine, batch, at_setup=True)``: before step 1, from shapes and rates only. Under a probed
  profile (``hardware`` None or "probe") unit 0's forward and backward are timed on the engine (this model's
  own compute rate, and its forward graph's size: how many units "auto" will keep), the activations and the
  loss head are sized from shapes; the prediction is kept as ``plan.setup_prediction``, and its SSD wear is
  logged once.
- ``predict(plan, engine, batch)`` again after step 1, with what it measured (kept graphs, checkpoints).
- ``calibrate(plan, engine, step_s)`` after each of the first steady steps (``planning.prediction.recalibrated``).

The engine is read through its public surface only (shapes, sizes, the timing, the host plan); which
settings the engine then runs stays the strategy's call (``SnakeEngine.use_plan``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from snake_strategy.planning.run_plan import RunPlan
from snake_strategy.planning.calibration import MeasuredStep, UnitTiming
from snake_strategy.planning.time_model import HardwareProfile, ModelShape, StepPrediction
from snake_strategy.planning.prediction import first_prediction, recalibrated, ssd_wear, with_prediction

log = logging.getLogger(__name__)


class RunPredictor:
    """See the module docstring. ``hardware``: the strategy's (``"probe"``, None or a ``HardwareProfile``);
    ``log_wear``: this process says the run's SSD wear (rank 0)."""

    def __init__(self, hardware: HardwareProfile | str | None, device: torch.device, log_wear: bool) -> None:
        self.hardware, self.device, self.log_wear = hardware, device, log_wear
        self.model_shape: ModelShape | None = None  # the planner's view of the model, at the step's shapes
        self.hardware_profile: HardwareProfile | None = None  # the rates of the latest prediction
        self.prediction: StepPrediction | None = None
        self.timing: UnitTiming | None = None  # this model's unit timed before step 1 (probed rates)
        self.steady_steps: list[MeasuredStep] = []  # what the steady steps so far measured

    def predict(self, plan: RunPlan, engine: Any, batch: Any, at_setup: bool = False) -> RunPlan:
        """``plan`` with the prediction for ``batch``'s shapes (see the module docstring)."""
        micro_batch = engine.micro_batches(batch)[0][0]
        # Before the first forward the activations are sized from shapes; after it, as measured.
        sized = engine.activation_sizes(micro_batch) if at_setup and not engine.checkpoint_bytes else 0
        shape = engine.model_shape(micro_batch, sized)
        if self.timing is None and self.hardware in (None, "probe"):
            # This model's own unit, forward and backward, timed once before step 1 (a few % of a step); its
            # forward graph's size says how many units "auto" will keep (no recompute for them).
            start_s = time.perf_counter()
            self.timing = engine.time_unit(batch, shape.checkpoint_bytes)
            timing_s = time.perf_counter() - start_s
            rates = self.timing.rates(shape)
            log.info("planner: unit 0's forward over %d tokens took %.3f s (%.1f GFLOP/s), its backward %.3f s "
                     "(%.1f GFLOP/s), the embedding and head %s before step 1 (the timing took %.1f s); %d units "
                     "expected to keep their forward graph", self.timing.tokens, self.timing.forward_s,
                     rates["flops_per_s"] / 1e9, self.timing.backward_s, rates["backward_flops_per_s"] / 1e9,
                     "untimed" if self.timing.nonlayer_s is None else f"{self.timing.nonlayer_s:.3f} s", timing_s,
                     self.timing.kept_units)
        expected_graphs = 0
        if at_setup and not engine.kept_units and self.timing is not None:
            shape = dataclasses.replace(shape, kept_units=self.timing.kept_units)
            expected_graphs = self.timing.kept_units * self.timing.graph_bytes_per_unit
        self.model_shape = shape
        prediction, self.hardware_profile = first_prediction(
            plan, shape, engine.alpha, self.hardware, self.device, engine.ssd.path if engine.ssd else None,
            engine.largest_block_matrix(), self.hardware == "probe", engine.optimizer, engine.dtypes.master,
            self.timing)
        # "auto" decides the kept graphs at the first step
        kept = plan.kept_units if at_setup else engine.kept_units
        plan = with_prediction(plan, shape, self.hardware_profile, prediction, engine.alpha, kept)
        # What the steps hold: with the activations sized from shapes before step 1, as measured after it.
        plan = dataclasses.replace(plan, step_host_bytes=expected_graphs + sum(engine.host_bytes_plan(
            engine.checkpoint_bytes or shape.checkpoint_bytes).values()))
        if self.prediction is None:  # the run's first prediction: before step 1
            plan = dataclasses.replace(plan, setup_prediction=prediction)
            if self.log_wear:
                log.info("planner: %s", ssd_wear(plan.storage, prediction))  # said once
        self.prediction = prediction
        return plan

    def calibrate(self, plan: RunPlan, engine: Any, step_s: float) -> RunPlan:
        """After one of the first steady steps (``step_s`` of wall time): the prediction against the median of
        what they measured, re-planned with the measured rates when it missed."""
        self.steady_steps.append(MeasuredStep.from_stats(step_s, engine.last_step))
        plan = recalibrated(plan, self.model_shape, MeasuredStep.median(self.steady_steps), engine.step_count,
                            engine.alpha, len(self.steady_steps))
        self.prediction = plan.prediction
        return plan
