"""A dry run: the plan ``Trainer(strategy="greedysnake").fit`` would use, and what it predicts, without building
the model's weights or running a step.

    from snake_strategy.dry_run import plan_run
    report = plan_run(GPTModule("gpt_4b"), GreedySnakeStrategy(storage={"host_budget_bytes": 16 * 2**30}),
                      batch=next(iter(loader)), precision="32-true")
    print(report.describe())          # or report.as_dict() (JSON)

The command line takes the Hydra app's own config groups and overrides (``python -m snake_strategy.plan
model=gpt_4b storage.host_budget_bytes=17179869184``; snake_strategy/plan.py).

The module is built on the meta device (its structure, no weight), its optimizer inspected as at setup, and the
plan resolved by the same function the strategy calls (``planning.run_plan.resolve``): the dry run's plan is the
fit's. The prediction is the planner's roofline from the batch's shapes and the machine's rates as a fit
measures them before step 1: the probe's disk and copy rates (cached on disk, as the strategy's
``hardware="probe"``) and the model's own unit 0, forward and backward timed at the batch's shapes and the
run's precision on random weights (the only weights the dry run builds), whose forward graph also says how many
units "auto" keeps; step time, its bound, the tokens per step from which the run is compute-bound, the bytes
each tier moves per step. Memory: the host plan with the activation checkpoints and
the loss head's output sized from shapes (``pre_stage`` on meta copies of the batch), next to the host budget;
the SSD space next to the free space of ``storage.ssd_dir``. Wear: the SSD bytes one step writes, per 1,000
steps, and the days at this run's rate until the drive's rated endurance (``storage.ssd_endurance_tbw``,
terabytes written) is used up.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from snake_strategy.contract import (batch_size, check_contract, checkpoint_bytes_from_shapes, head_params,
                                     loss_head_bytes, meta_pre_stage, micro_batch_tokens, nonlayer_tensors,
                                     split_micro_batches, stack_side_inputs)
from snake_strategy.engine.step.batch_check import eval_mode
from snake_strategy.engine.step.kept_graphs import KeptGraphs
from snake_strategy.engine.step.unit_timing import time_forward_backward, time_nonlayer, timed_task
from snake_strategy.planning.run_plan import RunPlan, resolve
from snake_strategy.planning.time_model import HardwareProfile
from snake_strategy.planning.machine import SOURCE_GIVEN
from snake_strategy.planning.memory_model import ssd_plan, unplanned_room_bytes
from snake_strategy.planning.calibration import UnitTiming
from snake_strategy.planning.run_prediction import days_to_endurance, first_prediction, ssd_wear, with_prediction
from snake_strategy.precision import DtypePolicy, GreedySnakePrecision
from snake_strategy.storage.ssd_directory import ssd_location
from snake_strategy.strategy import GreedySnakeStrategy
from snake_strategy.units import WeightFormat

log = logging.getLogger(__name__)


@dataclass
class DryRun:
    """What a fit with these settings would do (see the module docstring). Bytes, seconds, days."""

    plan: RunPlan
    fits: bool
    problems: list[str]  # what does not fit, each with the setting to change
    predicted_s_per_step: float
    bound: str
    tokens_per_step: int
    compute_bound_from_tokens_per_step: int | None  # None: not below the planner's largest batch
    host_peak_bytes: int  # the process's baseline + the plan with activation checkpoints and the loss head
    host_items: dict[str, int]
    host_budget_bytes: int
    ssd_bytes: int
    ssd_free_bytes: int | None
    ssd_dir: str | None
    bytes_per_step: dict[str, int]  # tier/direction
    ssd_write_bytes_per_1000_steps: int
    tbw_bytes: int
    days_to_rated_endurance: float | None  # None: the run writes nothing to the SSD

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.predicted_s_per_step if self.predicted_s_per_step else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        out["tokens_per_s"] = self.tokens_per_s
        out["plan"] = self.plan.as_dict()
        return out

    def describe(self) -> str:
        gib, gb = 2**30, 1e9
        lines = [f"fits: {'yes' if self.fits else 'NO'}" + ("" if self.fits else " -- " + "; ".join(self.problems)),
                 f"predicted {self.predicted_s_per_step:.2f} s/step ({self.bound}-bound), "
                 f"{self.tokens_per_s:,.0f} tokens/s at {self.tokens_per_step:,} tokens/step"
                 + (f"; {self.plan.knee.describe()}" if self.plan.knee is not None else ""),
                 f"host RAM: the plan {sum(self.host_items.values()) / gib:.2f} GiB of a "
                 f"{self.host_budget_bytes / gib:.2f} GiB budget ({self.plan.host_budget_source}); peak "
                 f"{self.host_peak_bytes / gib:.2f} GiB with the process's "
                 f"{self.plan.process_baseline_bytes / gib:.2f} GiB",
                 f"SSD: {self.ssd_bytes / gb:.2f} GB in {self.ssd_dir or 'a temporary directory'}"
                 + (f" ({self.ssd_free_bytes / gb:.1f} GB free)" if self.ssd_free_bytes is not None else ""),
                 "per step: " + ", ".join(f"{k} {v / gb:.2f} GB" for k, v in self.bytes_per_step.items() if v),
                 ssd_wear(self.plan.storage, self.plan.prediction),
                 f"plan: {self.plan.describe()}"]
        return "\n".join(lines)


def plan_run(module: nn.Module, strategy: Any = None, batch: Any = None, *, precision: str | None = None,
             gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm",
             device: torch.device | str = "cpu") -> DryRun:
    """The dry run of ``module`` under ``strategy`` (a ``GreedySnakeStrategy``, default one with every setting
    "auto"), for batches like ``batch`` (one global batch: micro-batch size x ``num_micro_batches`` samples;
    None: shapes unknown, no activation sizes, no compute time). ``precision``: the Trainer's (default: the
    strategy's precision plugin's, else "32-true"). Builds no weight: the module's ``configure_model`` runs on
    the meta device."""
    strategy = strategy if strategy is not None else GreedySnakeStrategy()
    plugin = strategy.precision_plugin if isinstance(strategy.precision_plugin, GreedySnakePrecision) else None
    plugin = GreedySnakePrecision(precision or "32-true") if plugin is None or precision else plugin
    dtypes, device = plugin.dtypes, torch.device(device)
    with torch.device("meta"):
        if callable(getattr(module, "configure_model", None)):
            module.configure_model()
    check_contract(module)
    optimizer = _optimizer(module)
    storage, schedule = strategy.requested
    clip = (gradient_clip_algorithm, float(gradient_clip_val)) if gradient_clip_val else None
    hardware = strategy.hardware if isinstance(strategy.hardware, HardwareProfile) else HardwareProfile()
    plan = resolve(module, optimizer, storage, schedule, dtypes, device, hardware, clip=clip)
    ssd_dir = plan.storage.ssd_dir
    shape, checkpoint_bytes, logits_bytes, tokens = plan.shape, 0, 0, 0
    if batch is not None:  # sized as the engine sizes them before step 1
        micro = split_micro_batches(batch, plan.schedule.num_micro_batches)[0]
        tokens = micro_batch_tokens(micro)
        checkpoint_bytes = checkpoint_bytes_from_shapes(module, micro)
        logits_bytes = loss_head_bytes(module, micro)
        shape = dataclasses.replace(shape, head_params=head_params(module), tokens_per_micro=tokens,
                                    checkpoint_bytes=checkpoint_bytes)
    items = plan.host_items(checkpoint_bytes, loss_logits_bytes=plan.loss_logits_bytes(logits_bytes))
    timing = None
    if batch is not None and strategy.hardware in (None, "probe"):
        timing = _time_unit(module, plan, dtypes, device, batch, items)
    if timing is not None:
        shape = dataclasses.replace(shape, kept_units=timing.kept_units)
        if timing.kept_units:
            items["kept_graphs"] = timing.kept_units * timing.graph_bytes_per_unit
    probe_dir = ssd_dir if ssd_dir and os.path.isdir(ssd_dir) else None
    prediction, profile = first_prediction(plan, shape, plan.schedule.alpha, strategy.hardware, device, probe_dir,
                                           plan.largest_block_matrix(), strategy.hardware == "probe", optimizer,
                                           dtypes.master, timing)
    plan = with_prediction(plan, shape, profile, prediction, plan.schedule.alpha, plan.kept_units)
    s = plan.schedule
    host_peak = plan.process_baseline_bytes + sum(items.values())
    ssd_bytes = sum(ssd_plan(plan.memory_inputs(checkpoint_bytes)).values())
    free = shutil.disk_usage(ssd_location(ssd_dir)).free
    problems = []
    if plan.storage.host_budget_bytes is not None and sum(items.values()) > plan.storage.host_budget_bytes:
        problems.append(f"host RAM: the plan needs {sum(items.values()) / 2**30:.2f} GiB of "
                        f"storage.host_budget_bytes={plan.storage.host_budget_bytes}; move shares to 'ssd', use "
                        "fewer or smaller micro-batches, or raise storage.host_budget_bytes")
    elif host_peak > plan.host_budget_bytes + plan.process_baseline_bytes and plan.host_budget_bytes:
        problems.append(f"host RAM: a peak of {host_peak / 2**30:.2f} GiB above the machine's "
                        f"{(plan.host_budget_bytes + plan.process_baseline_bytes) / 2**30:.2f} GiB; set "
                        "storage.host_budget_bytes and move shares to 'ssd'")
    if free is not None and ssd_bytes > free:
        problems.append(f"SSD space: {ssd_bytes / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free in "
                        f"{ssd_dir or tempfile.gettempdir()}; set storage.ssd_dir to a larger disk")
    written = prediction.ssd_write_bytes
    tbw = int(plan.storage.ssd_endurance_tbw * 1e12)
    days = days_to_endurance(plan.storage.ssd_endurance_tbw, written, prediction.roofline_s)
    knee = plan.knee
    return DryRun(
        plan=plan, fits=not problems, problems=problems, predicted_s_per_step=prediction.roofline_s,
        bound=prediction.bound, tokens_per_step=tokens * s.num_micro_batches,
        compute_bound_from_tokens_per_step=knee.tokens_per_step if knee is not None else None,
        host_peak_bytes=host_peak, host_items=items, host_budget_bytes=plan.host_budget_bytes, ssd_bytes=ssd_bytes,
        ssd_free_bytes=free, ssd_dir=ssd_dir,
        bytes_per_step={"ssd/read": prediction.ssd_read_bytes, "ssd/write": prediction.ssd_write_bytes},
        ssd_write_bytes_per_1000_steps=1000 * written, tbw_bytes=tbw, days_to_rated_endurance=days)


def _time_unit(module: nn.Module, plan: RunPlan, dtypes: DtypePolicy, device: torch.device, batch: Any,
               items: dict[str, int]) -> UnitTiming | None:
    """Unit 0's forward and backward, and the embedding's and the head's, over the micro-batches one task runs
    (up to ``TIMED_TOKENS``), as a fit times them before step 1 (``engine.step.unit_timing``): on random
    weights of the unit's layout and random non-layer tensors (normal, std 0.02), with random inputs of the
    shapes ``pre_stage`` gives on meta; and the units "auto" keeps in the budget ``items`` leave."""
    s, layout = plan.schedule, plan.layouts[0]
    micro_batches = split_micro_batches(batch, s.num_micro_batches)
    timed, task = timed_task(micro_batches, s.batched_forward)
    micro_batches = micro_batches[:timed]
    staged = [meta_pre_stage(module, b) for b in micro_batches]
    if any(x is None for x in staged):
        log.warning("dry run: %s.pre_stage does not run on the meta device, so its blocks are not timed: the compute "
                    "rate is the probe's (a fit times them on its own weights)", type(module).__name__)
        return None
    hidden = torch.cat([_random_like(h, device) for h, _ in staged])
    side = stack_side_inputs([{k: _random_like(v, device) for k, v in side.items()} for _, side in staged],
                             [batch_size(b) for b in micro_batches])
    flat = torch.randn(layout.numel, dtype=dtypes.master, device=device) * 0.02
    if dtypes.half_weights is not None:
        fmt = WeightFormat.for_layout(layout, dtypes.half_weights, dtypes.master)
        main, tail = fmt.store(flat.cpu())
        leaves = fmt.leaves(layout, main.to(device), tail.to(device))
    else:
        leaves = layout.leaves(flat.to(dtypes.compute))
    kept = KeptGraphs.for_schedule(s, device)
    autocast = (lambda: torch.autocast(device.type, dtype=dtypes.autocast)) if dtypes.autocast else contextlib.nullcontext
    with eval_mode(list(module.blocks)):
        forward_s, backward_s, graph_bytes = time_forward_backward(
            lambda x, outs: layout.forward(leaves, x, side, None, outs), hidden, leaves, layout.num_trainable, kept,
            autocast, device)
    tensors = {n: _random_like(t, device).requires_grad_(t.requires_grad) if t.dtype.is_floating_point
               else _random_like(t, device) for n, t in nonlayer_tensors(module).items()}
    on_device = [apply_to_collection(b, torch.Tensor, lambda t: t.to(device)) for b in micro_batches]
    with eval_mode([module]):
        nonlayer_s = time_nonlayer(module, on_device, tensors, autocast, device)
    room = unplanned_room_bytes(plan.host_budget_bytes, plan.host_budget_source == SOURCE_GIVEN,
                                plan.process_baseline_bytes, sum(items.values()))
    units, per_unit = kept.expected_units(graph_bytes * task // timed, room, len(plan.layouts))
    return UnitTiming(forward_s, backward_s, layout.numel, layout.train_end,
                      sum(micro_batch_tokens(b) for b in micro_batches), units, per_unit, nonlayer_s)


def _random_like(value: Any, device: torch.device) -> Any:
    """A real tensor for a meta one (floats normal with std 0.02, integers 0, booleans True); other values as
    they are."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype.is_floating_point:
        return torch.randn(value.shape, dtype=value.dtype, device=device) * 0.02
    if value.dtype == torch.bool:
        return torch.ones(value.shape, dtype=torch.bool, device=device)
    return torch.zeros(value.shape, dtype=value.dtype, device=device)


def _optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``configure_optimizers`` returns (alone, in a list, or in Lightning's dict)."""
    out = module.configure_optimizers()
    if isinstance(out, dict):
        out = out["optimizer"]
    if isinstance(out, (list, tuple)):
        out = out[0]
        if isinstance(out, dict):
            out = out["optimizer"]
    if not isinstance(out, torch.optim.Optimizer):
        raise ValueError(f"configure_optimizers returned {type(out).__name__}; the dry run needs a "
                         "torch.optim.Optimizer (alone, in a list or in Lightning's dict)")
    return out
