"""The prediction of one run, from before step 1 to its calibration: the one object the strategy asks, and the
re-plan of the settings that depend on the machine's rates each time the rates become better known.

``RunPredictor`` keeps what a fit's prediction needs between steps (the model's shape at the step's batch,
the machine's rates, the unit timed before step 1, the steady steps measured) and turns a plan into the
plan with its prediction:

- ``predict(plan, engine, batch, at_setup=True)``: before step 1, from shapes and rates only (the batch from
  ``example_batch`` when the loader allows it). Under a probed profile (``hardware`` None or "probe") unit 0's
  forward and backward are timed on the engine (this model's own compute rate, and its forward graph's size:
  how many units "auto" will keep), the activations and the loss head are sized from shapes; the prediction is
  kept as ``plan.setup_prediction``, and its SSD wear is logged once.
- ``predict(plan, engine, batch)`` again after step 1, with what it measured (kept graphs, checkpoints).
- ``after_step(plan, engine, step_s)`` after every step: the first steady steps are checked against their
  median and re-planned with the measured rates when it missed (``recalibrated``; the rates themselves:
  planning/calibration.py); later steps re-plan when the median of the last few moves away from the
  prediction (a rate that changes mid-run). Under a speculative step the steps are predicted as the plan
  expects them (``RunPlan.deferring``) until the last steady steps all ran the other way.

Each prediction comes with the plan's knee and the settings that depend on rates (``with_prediction``: the
prefetch depth), and the strategy hands the engine the plan it then runs (``SnakeEngine.use_plan``). The
engine is read through its public surface only (shapes, sizes, the timing, the host plan).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from snake_strategy.config import StorageConfig
from snake_strategy.planning.calibration import (CALIBRATION_STEPS, REPLAN_MISS, STEADY_STEP, MeasuredStep, UnitTiming,
                                                 calibrated, missed)
from snake_strategy.planning.machine import matmul_flops_per_s, optimizer_params_per_s, probe_hardware
from snake_strategy.planning.placement import prefetch_depth
from snake_strategy.planning.run_plan import RunPlan
from snake_strategy.planning.time_model import HardwareProfile, ModelShape, StepPrediction, knee, predict

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
        self.timing_s: float | None = None  # what that timing took
        self.recent_steps: list[MeasuredStep] = []  # what the last CALIBRATION_STEPS steady steps measured
        self.recent_modes: list[bool] = []  # under a speculative step: whether each of them deferred

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
            self.timing_s = timing_s = time.perf_counter() - start_s
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
            plan = dataclasses.replace(plan, setup_prediction=prediction, setup_timing_s=self.timing_s)
            if self.log_wear:
                log.info("planner: %s", ssd_wear(plan.storage, prediction))  # said once
        self.prediction = prediction
        return plan

    def after_step(self, plan: RunPlan, engine: Any, step_s: float) -> RunPlan:
        """After each optimizer step of this process (``step_s`` of wall time; a resumed run counts from its
        own first step). The first steady steps calibrate: each is checked against the median of the steady
        steps so far and re-planned with the measured rates when it missed. Every later step watches for a rate
        that moves mid-run (an MoE's routing as its router learns, a disk that slows down): the prediction
        against the median of the last ``CALIBRATION_STEPS`` steps, re-planned from them when it misses by more
        than ``REPLAN_MISS`` (only those re-plans are recorded)."""
        step = engine.trace.last.index
        if step < STEADY_STEP or plan.prediction is None:
            return plan
        self.recent_steps = [*self.recent_steps, MeasuredStep.from_stats(step_s, engine.last_step)][-CALIBRATION_STEPS:]
        given = plan
        if plan.step_mode == "speculative":
            self.recent_modes = [*self.recent_modes, not engine.last_step.speculation][-CALIBRATION_STEPS:]
            if all(deferred != plan.deferring for deferred in self.recent_modes):
                plan = self._in_mode(plan, engine.alpha, deferring=not plan.deferring)
        checked = recalibrated(plan, self.model_shape, MeasuredStep.median(self.recent_steps), engine.step_count,
                               engine.alpha, len(self.recent_steps))
        if step >= STEADY_STEP + CALIBRATION_STEPS and checked.prediction is plan.prediction and plan is given:
            return plan  # a watched step within REPLAN_MISS: not recorded
        self.prediction = checked.prediction
        return checked

    def _in_mode(self, plan: RunPlan, alpha: float, deferring: bool) -> RunPlan:
        """``plan`` predicted again at its rates for steps that defer (or speculate), as the last steady
        steps all did: a fine-tune whose norms stay within max_norm speculates, a run from scratch defers."""
        plan = dataclasses.replace(plan, deferring=deferring)
        prediction = predict_plan(plan, self.model_shape, plan.hardware, alpha)
        log.info("planner: the last %d steps %s: predicted %.3f s/step (%s-bound) for such steps",
                 len(self.recent_modes), "deferred their whole updates (clipped norms)" if deferring else
                 "speculated (norms within max_norm)", prediction.roofline_s, prediction.bound)
        return with_prediction(plan, self.model_shape, plan.hardware, prediction, alpha, plan.kept_units)


def first_prediction(plan: RunPlan, shape: ModelShape, alpha: float, hardware: HardwareProfile | str | None,
                     device: torch.device, ssd_path: str | None, largest_block_matrix: tuple[int, int],
                     at_model_shape: bool, optimizer: torch.optim.Optimizer | None = None,
                     master_dtype: torch.dtype = torch.float32,
                     timing: UnitTiming | None = None) -> tuple[StepPrediction, HardwareProfile]:
    """The planner's roofline for this run from ``shape`` (the engine's, for the first micro-batch): the
    prediction and the machine's profile. ``hardware`` None or ``"probe"`` measures the machine (cached on
    disk for a few hours, a scratch file in ``ssd_path``); ``at_model_shape`` (the strategy's
    ``hardware="probe"``) also probes the compute roof at this model's own matmul with the rows one task
    multiplies (every micro-batch's tokens under batched passes); an ``optimizer`` off the fused Adam path is
    timed at the same matrix. ``timing``: the run's own unit timed at setup, whose forward and backward
    rates replace the probe's. A ``HardwareProfile`` is taken as given."""
    probing = hardware in ("probe", None)
    time_optimizer = (probing and optimizer is not None and plan.optimizer is not None
                      and not plan.optimizer.kind.own_kernel)
    if probing:
        hardware = probe_hardware(ssd_path, device)
    out_dim, in_dim = largest_block_matrix
    if timing is not None and probing:
        hardware = dataclasses.replace(hardware, **timing.rates(shape))
    elif at_model_shape and probing and shape.tokens_per_micro:
        s = plan.schedule
        rows = shape.tokens_per_micro * (s.num_micro_batches if s.batched_forward else 1)
        # The compute roof at this model's own matmul shape (rows x in) @ (in x out).
        hardware = dataclasses.replace(hardware, flops_per_s=matmul_flops_per_s(rows, in_dim, out_dim, device))
    if time_optimizer:
        rate = optimizer_params_per_s(optimizer, (out_dim, in_dim), master_dtype)
        hardware = dataclasses.replace(hardware, optimizer_params_per_s=rate)
    prediction = predict_plan(plan, shape, hardware, alpha)
    log.info("planner: predicted floor %.3f s/step (%s-bound; compute %.3f s, ssd %.3f s, optimizer %.3f s)",
             prediction.roofline_s, prediction.bound, prediction.compute_s, prediction.ssd_s, prediction.optimizer_s)
    return prediction, hardware


def predict_plan(plan: RunPlan, shape: ModelShape, hardware: HardwareProfile, alpha: float) -> StepPrediction:
    """``time_model.predict`` for ``plan``'s placement, order and optimizer step mode."""
    return predict(shape, hardware, plan.storage, plan.schedule.kind, alpha, plan.step_mode == "speculative",
                   plan.deferring)


def days_to_endurance(endurance_tbw: float, write_bytes_per_step: int, s_per_step: float) -> float | None:
    """Days of steps writing ``write_bytes_per_step`` every ``s_per_step`` until a drive rated for
    ``endurance_tbw`` terabytes written is used up; None when the steps write nothing."""
    if not write_bytes_per_step or not s_per_step:
        return None
    return endurance_tbw * 1e12 / (write_bytes_per_step * 86400.0 / s_per_step)


def ssd_wear(storage: StorageConfig, prediction: StepPrediction) -> str:
    """The SSD wear of a run at its predicted rate, in words (the dry run's line, logged once by a fit)."""
    written = prediction.ssd_write_bytes
    days = days_to_endurance(storage.ssd_endurance_tbw, written, prediction.roofline_s)
    if days is None:
        return "SSD wear: nothing written to the SSD"
    return (f"SSD wear: {1000 * written / 1e12:.2f} TB written per 1,000 steps; {days:,.0f} days of this run to the "
            f"drive's rated {storage.ssd_endurance_tbw:,.0f} TBW (storage.ssd_endurance_tbw)")


def with_prediction(plan: RunPlan, shape: ModelShape, hardware: HardwareProfile, prediction: StepPrediction,
                    alpha: float, kept_units: list[int] | None) -> RunPlan:
    """The plan with this prediction (of ``hardware``'s rates), its knee and the settings that depend on
    rates: the prefetch depth, unless given (``placement.prefetch_depth``; the engine follows at a step
    boundary, ``SnakeEngine.use_plan``)."""
    s, reasons = plan.schedule, dict(plan.reasons)
    depth = s.prefetch_depth
    if reasons.get("prefetch_depth") != "given" and not plan.evaluating:
        depth, reasons["prefetch_depth"] = prefetch_depth(plan.storage, prediction)
    return dataclasses.replace(plan, schedule=dataclasses.replace(s, prefetch_depth=depth), reasons=reasons,
                               prediction=prediction, kept_units=kept_units, hardware=hardware,
                               knee=knee(shape, hardware, plan.storage, s.kind, alpha, plan.step_mode == "speculative",
                                         plan.deferring))


def recalibrated(plan: RunPlan, shape: ModelShape, measured: MeasuredStep, step: int, alpha: float,
                 steps_measured: int = 1) -> RunPlan:
    """The plan after a steady step (planning/calibration.py), ``measured`` the median of the last
    ``steps_measured`` steady steps: the prediction kept when it is within ``REPLAN_MISS`` of it, else
    predicted again with the measured rates and the rate-dependent settings chosen again with them (logged,
    with the reason). ``plan.calibration`` records the first check, or the last one that re-planned, with every
    check's error in ``checks``."""
    before = plan.prediction
    assert before is not None and plan.hardware is not None, "a plan is predicted before it is calibrated"
    error = missed(before, measured)
    checks = [*(plan.calibration or {}).get("checks", []), {"step": step, "error": error}]
    if abs(error) <= REPLAN_MISS and plan.calibration is not None:
        return dataclasses.replace(plan, calibration={**plan.calibration, "checks": checks})
    record: dict[str, Any] = {"step": step, "steps_measured": steps_measured, "measured": dataclasses.asdict(measured),
                              "predicted_s": before.roofline_s, "predicted_bound": before.bound, "error": error,
                              "replanned": False, "changes": {}, "checks": checks}
    if abs(error) <= REPLAN_MISS:
        return dataclasses.replace(plan, calibration=record)
    hardware = calibrated(plan.hardware, shape, before, measured)
    prediction = predict_plan(plan, shape, hardware, alpha)
    after = with_prediction(plan, shape, hardware, prediction, alpha, plan.kept_units)
    changes = {"prefetch_depth": [plan.schedule.prefetch_depth, after.schedule.prefetch_depth]} \
        if after.schedule.prefetch_depth != plan.schedule.prefetch_depth else {}
    record.update(replanned=True, changes=changes, corrected_s=prediction.roofline_s, corrected_bound=prediction.bound)
    log.info(
        "planner: step %d took %.2f s (the median of %d steady steps), the prediction was %.2f s (%s-bound, %+.0f%%): "
        "re-planned with the measured rates (compute %.3g FLOP/s, optimizer %.3g params/s, SSD x%.2f): %.2f s/step, "
        "%s-bound; %s", step, measured.step_s, steps_measured, before.roofline_s, before.bound, 100 * error,
        hardware.flops_per_s, hardware.optimizer_params_per_s, hardware.ssd_read_gb_per_s / plan.hardware.ssd_read_gb_per_s,
        prediction.roofline_s, prediction.bound,
        "; ".join(f"{k} {a} -> {b} ({after.reasons[k]})" for k, (a, b) in changes.items()) or "the settings stay")
    return dataclasses.replace(after, calibration=record)


def example_batch(trainer: Any) -> Any | None:
    """A global batch for the prediction at setup, collated from the first samples of the train loader
    when ``fit`` was given a map-style DataLoader (nothing is iterated: no worker starts, no sampler
    advances). None otherwise (a DataModule, an iterable dataset): the prediction then waits for step 1."""
    from torch.utils.data import DataLoader, IterableDataset  # only here: the planner itself needs no loader

    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)  # Lightning's (private) handle
    loader = getattr(source, "instance", None)
    if not isinstance(loader, DataLoader) or loader.batch_size is None or isinstance(loader.dataset, IterableDataset):
        return None
    try:
        if len(loader.dataset) < loader.batch_size:
            return None
        return loader.collate_fn([loader.dataset[i] for i in range(loader.batch_size)])
    except Exception as err:  # a dataset that cannot be indexed cheaply: predict at the first step instead
        log.debug("no example batch at setup (%s): the prediction comes at the first step", err)
        return None
