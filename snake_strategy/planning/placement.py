"""The placement search: where each state of a run lives (host, SSD) within its host budget, the overlap
share alpha that sizes the parked gradients, the prefetch depth and the kept activations. Pure functions
of plain data: the memory model (planning/memory_model.py) sizes every candidate, the time model
(planning/time_model.py) gives the rates the prefetch depth follows.

The order the budget is filled in (``plan``): the states that move the most bytes per byte stored first
(weights, then the optimizer's moments, then the activation checkpoints), the rest on the SSD.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from snake_strategy.config import STATES, ScheduleConfig, StorageConfig, TierShares
from snake_strategy.planning.memory_model import MemoryInputs, checkpoint_tiers, host_plan
from snake_strategy.planning.time_model import HardwareProfile, ModelShape, StepPrediction
from snake_strategy.progress import format_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """A placement: where each state lives, planned for the forward share ``alpha``. The prefetch depth,
    the host bytes and the prediction of a run are the run plan's (``run_plan.resolve``), from this placement."""

    storage: StorageConfig
    alpha: float


def choose_alpha(shape: ModelShape) -> float:
    """The forward pass's share of the block compute, capped at 0.5.

    The forward part's update runs during the forward and the backward part's during the backward;
    splitting the parameters in proportion to the two passes' durations hides both equally.
    """
    fwd = shape.num_units - 1  # forward-only unit passes
    total = fwd + 3 * shape.num_units  # recompute + backward (2x) for every unit, plus the forwards
    return min(0.5, round(fwd / total, 3)) if total else 0.0


def memory_inputs(shape: ModelShape, hw: HardwareProfile, storage: StorageConfig, kind: str, alpha: float,
                  prefetch_depth: int = 1, speculative: bool = False, *, blocks_per_unit: int = 1,
                  micro_per_backward_task: int = 1, shard_rank: int = 0, evaluating: bool = False,
                  loss_logits_bytes: int = 0) -> MemoryInputs:
    """The memory model's view of a run: the one place ``MemoryInputs`` is built, for the planner (a shape
    planned on paper: uniform units) and for the engine (its laid-out shape: exact units). ``speculative``:
    the speculative optimizer step's rollback state is counted (on ``storage.rollback``); ``evaluating``:
    the forward-only engine's memory (the compute weights only); ``loss_logits_bytes``: the loss head's output
    over one backward task's micro-batches, once the first step has measured it."""
    L = shape.num_units
    uniform_elems = (shape.weight_elems_per_unit,) * L if shape.weight_elems_per_unit else ()
    return MemoryInputs(
        unit_params=shape.unit_params or (shape.params_per_unit,) * L, nonlayer_params=shape.nonlayer_params,
        nonlayer_largest=shape.nonlayer_largest_params, loss_logits_bytes=loss_logits_bytes,
        compute_bytes=shape.compute_bytes or shape.weight_bytes, master_bytes=shape.master_bytes,
        state_vectors=shape.state_bytes / shape.master_bytes, state_slots=shape.state_slots,
        optimizer_chunk=shape.optimizer_chunk_elems, nonlayer_state_bytes=shape.nonlayer_state_bytes,
        device_is_cpu=hw.device_is_cpu, unit_weight_elems=shape.unit_weight_elems or uniform_elems,
        weight_bytes=shape.weight_bytes if shape.compute_bytes else 0,
        unit_weight_tail_bytes=shape.unit_weight_tail_bytes or (shape.weight_tail_bytes_per_unit,) * L,
        unit_trainable=shape.trainable_per_unit, nonlayer_frozen=shape.nonlayer_frozen_params,
        storage=storage, kind=kind, num_micro=shape.num_micro, alpha=alpha, prefetch_depth=prefetch_depth,
        blocks_per_unit=blocks_per_unit, micro_per_backward_task=micro_per_backward_task,
        checkpoint_bytes=shape.checkpoint_bytes, shard_world_size=shape.optimizer_shards, shard_rank=shard_rank,
        speculative=speculative, evaluating=evaluating)


# Units fetched ahead of the one computing: from memory one unit ahead hides a copy; from the SSD two when
# the disk is busier than compute (a unit's read then queues behind the optimizer's state traffic). The
# placement's working set is sized for the deeper one, so the rates can choose either at any step.
PREFETCH_FROM_MEMORY = 1
PREFETCH_FROM_SSD = 2


def prefetch_depth(storage: StorageConfig, prediction: StepPrediction | None = None) -> tuple[int, str]:
    """(units fetched ahead of the one computing, why) for this placement and, once the step's rates are
    known, its ``prediction``: the one rule, which the placement's working set, the plan and the re-plan
    after the first steady step use (``run_plan.resolve``, planning/calibration.py)."""
    if storage.weights.ssd == 0:
        return PREFETCH_FROM_MEMORY, "weights in memory: one unit ahead hides a copy"
    if prediction is None:
        return PREFETCH_FROM_SSD, "weights on the SSD, rates not known yet: the deeper prefetch"
    if prediction.ssd_s > prediction.compute_s:
        return PREFETCH_FROM_SSD, (f"weights on the SSD, which is busier than compute ({prediction.ssd_s:.2f} s "
                                   f"against {prediction.compute_s:.2f} s per step): two units ahead")
    return PREFETCH_FROM_MEMORY, (f"weights on the SSD, compute busier than the disk ({prediction.compute_s:.2f} s "
                                  f"against {prediction.ssd_s:.2f} s per step): one unit ahead hides a read")


def plan(shape: ModelShape, hw: HardwareProfile, host_budget_bytes: int, kind: str = "vertical",
         ssd_dir: str | None = None, *, alpha: float, speculative: bool = False, depth: int | None = None) -> Placement:
    """Fill the host budget with the states that move the most bytes per byte stored; the rest on SSD.

    ``alpha`` is the one that runs (``run_plan.resolve`` decides it: 1 when norm clipping or fp16 defer
    whole updates): it sizes the parked gradients. ``speculative``: the speculative step's rollback state
    exists; it is planned on the SSD here (it moves one byte per byte stored, less than any state above,
    so the budget goes to them first; ``resolve`` moves it to the host when what is left allows).
    ``depth``: the given prefetch depth; None: ``prefetch_depth``'s for weights on the SSD, the most the
    choice below can lead to, so its buffers are planned from the start.

    Order: weights (read twice per step by compute, once more by the optimizer: ~4 bytes moved per
    byte stored), then Adam moments (read + written: 2), then activation checkpoints (2). The working set
    (pools, gradient forward parts, turning-point checkpoints) is ``memory_model.host_plan`` of the all-SSD
    layout; the returned ``host_bytes`` is ``memory_model.host_plan`` of the chosen one. Raises ValueError when
    even the working set does not fit.
    """
    P = shape.params_per_unit * shape.num_units
    separate_master = shape.weight_bytes != shape.master_bytes
    all_ssd = StorageConfig(ssd_dir=ssd_dir, weights="ssd", master="ssd", optimizer="ssd", gradients="host",
                            checkpoints="ssd", rollback="ssd")
    depth = prefetch_depth(all_ssd)[0] if depth is None else depth
    working_set = host_plan(memory_inputs(shape, hw, all_ssd, kind, alpha, depth, speculative))
    fixed = sum(working_set.values())
    if fixed > host_budget_bytes:
        items = ", ".join(f"{name} {size / 2**30:.2f}" for name, size in
                          sorted(working_set.items(), key=lambda kv: -kv[1]) if size)
        raise ValueError(
            f"host_budget_bytes={host_budget_bytes / 2**30:.2f} GiB ({host_budget_bytes} bytes) cannot hold the "
            f"working set of {fixed / 2**30:.2f} GiB ({fixed} bytes) with every state on the SSD (GiB: {items}); "
            "raise the budget, use more, smaller units (schedule.blocks_per_unit), fewer micro-batches, or an "
            "optimizer with a smaller state for the non-layer parameters"
        )
    free = host_budget_bytes - fixed
    fractions = {}
    trained = sum(shape.trainable)  # frozen elements have no master copy and no moments
    weight_bytes = P * shape.weight_bytes + (trained * shape.master_bytes if separate_master else 0)
    order = (("weights", weight_bytes), ("optimizer", int(shape.moment_elems * shape.state_bytes)))
    if trained < P:
        # Fine-tuning: the small trainable state is read and written every step, the frozen weights only
        # read: moments first. The trainable part leads each unit's weights, so a weights host share of
        # at least t/n also keeps its master copy off the SSD.
        order = order[::-1]
    for state, nbytes in order:
        on_host = min(1.0, free / nbytes) if nbytes else 1.0
        on_host = int(on_host * 1000) / 1000  # keep it a clean fraction
        fractions[state] = TierShares(host=on_host, ssd=1.0 - on_host)
        free -= int(on_host * nbytes)
    ckpt_ssd = checkpoint_tiers(all_ssd, shape.num_micro).count("ssd")
    ckpt_total = ckpt_ssd * shape.num_units * shape.checkpoint_bytes
    ckpt_host = 1.0 if ckpt_total <= free else max(0.0, free / max(ckpt_total, 1))
    fractions["checkpoints"] = TierShares(host=round(ckpt_host, 3), ssd=round(1 - round(ckpt_host, 3), 3))
    storage = StorageConfig(ssd_dir=ssd_dir, weights=fractions["weights"], master=fractions["weights"],
                            optimizer=fractions["optimizer"], gradients=TierShares(host=1.0),
                            checkpoints=fractions["checkpoints"], rollback="ssd")
    return Placement(storage, alpha)


def kept_activations(schedule: ScheduleConfig, device: torch.device) -> tuple[int | str, str]:
    """(the effective ``keep_activations``, why) for a concrete schedule: engine/step/kept_graphs.py keeps exactly this."""
    keep = schedule.keep_activations
    if keep == 0:
        return 0, "given (0 is an explicit kind's default)"
    if schedule.split_backward:
        return 0, "0: the split backward defers a recompute's weight gradients, so no graph is kept"
    if schedule.kind == "vertical" and schedule.batched_forward != schedule.batched_backward:
        return 0, "0: a kept graph covers one forward task, and the forward and backward group micro-batches differently"
    if keep != "auto":
        return keep, "given"
    if device.type != "cpu":
        log.info("schedule.keep_activations='auto' keeps no graph on %s: they would live in device memory. "
                 "Set an integer to keep the top units' graphs there", device.type)
        return 0, (f"0: on {device.type} the graphs would live in device memory, which the host budget does not "
                   "see; set an integer to keep the top units' graphs there")
    return "auto", ("auto: the top units whose forward graph fits the host budget left by the plan, measured at the "
                    "first step")


def place_states(shape: ModelShape, hw: HardwareProfile, storage: StorageConfig, kind: str, alpha: float,
                 budget: int, depth: int | None, speculative: bool = False,
                 evaluating: bool = False) -> tuple[StorageConfig, dict[str, str]]:
    """(placed storage, reasons) within ``budget`` (the host budget less the activation reserve). States
    given explicitly keep their split. ``depth``: the given prefetch depth, else each candidate's own
    (``prefetch_depth``). The rollback state is placed afterwards (``place_rollback``), so it is
    counted on the SSD here. ``evaluating``: only the compute weights are stored (no moments, gradients or
    optimizer working set), so they get their own split."""
    unset = storage.unset()
    given = {state: getattr(storage, state) for state in STATES if state not in unset}
    reasons = {state: "given" for state in given}
    if not unset:
        return storage, reasons
    host = TierShares()
    all_host = dataclasses.replace(storage, placement="manual", rollback=storage.rollback or "ssd",
                                   **{s: given.get(s, host) for s in STATES})

    def host_bytes(placed: StorageConfig) -> int:
        ahead = prefetch_depth(placed)[0] if depth is None else depth
        return sum(host_plan(memory_inputs(shape, hw, placed, kind, alpha, ahead, speculative,
                                           evaluating=evaluating)).values())

    needed = host_bytes(all_host)
    if needed <= budget:
        reasons.update({s: f"host: the run needs {needed / 2**30:.2f} GiB of the {budget / 2**30:.2f} GiB budget"
                        for s in unset})
        return all_host, reasons
    if evaluating:  # ``plan`` sizes a training step's working set, which evaluation never holds
        weights_bytes = shape.num_units * shape.params_per_unit * shape.weight_bytes
        # What the host keeps besides a share of the weights: the streamed units, the non-layer parameters.
        free = budget - host_bytes(dataclasses.replace(all_host, weights=TierShares(host=0.0, ssd=1.0)))
        host = max(0.0, min(1.0, int(100 * free / weights_bytes) / 100)) if weights_bytes else 1.0
        split = TierShares(host=host, ssd=round(1.0 - host, 2))
        reasons.update({s: f"evaluation: the compute weights ({weights_bytes / 2**30:.2f} GiB), {host:.0%} of them "
                           f"in the {budget / 2**30:.2f} GiB budget" for s in unset})
        return dataclasses.replace(storage, placement="manual", **{s: given.get(s, split) for s in STATES}), reasons
    # raises when not even the working set fits
    chosen = plan(shape, hw, budget, kind, storage.ssd_dir, alpha=alpha, speculative=speculative, depth=depth)
    placed = dataclasses.replace(storage, placement="manual",
                                 **{s: given.get(s, getattr(chosen.storage, s)) for s in STATES})
    reasons.update({s: f"planner.plan: {format_bytes(needed)} all on the host exceeds the "
                       f"{format_bytes(budget)} budget" for s in unset})
    return placed, reasons


def place_rollback(shape: ModelShape, hw: HardwareProfile, storage: StorageConfig, given: str | None, kind: str,
                   alpha: float, depth: int, room: int, speculative: bool) -> tuple[StorageConfig, str]:
    """The rollback state's tier: given, else the host when the placed plan with it there still fits ``room``
    (the budget less the activation reserve), else the SSD. Placed after the states: per byte stored it moves
    one byte per step (written once), the states two or more."""
    if given is not None:
        return dataclasses.replace(storage, rollback=given), "given"
    if not speculative:
        return dataclasses.replace(storage, rollback="host"), "no speculative step: nothing to keep"
    on_host = dataclasses.replace(storage, rollback="host")
    needed = sum(host_plan(memory_inputs(shape, hw, on_host, kind, alpha, depth, True)).values())
    if needed <= room:
        return on_host, f"host: the plan with it needs {needed / 2**30:.2f} of {room / 2**30:.2f} GiB"
    return (dataclasses.replace(storage, rollback="ssd"),
            f"ssd: on the host the plan would need {needed / 2**30:.2f} GiB of {room / 2**30:.2f} GiB")
