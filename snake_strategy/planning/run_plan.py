"""The run plan: every effective setting of a run, decided once at setup (``resolve``) and carried by the
``RunPlan`` the engines run. ``schedule.kind="auto"`` and ``storage.placement="auto"`` (the defaults of
``GreedySnakeStrategy()``) become concrete settings from the model's shape, the host budget and the machine;
settings given explicitly are kept as given.

Choices (docs/design.md, "The planner drives the run", says why each is made):

- **placement** (``placement.place_states``): everything on the host when the whole run fits the host budget
  (nothing is faster); otherwise ``placement.plan`` fills the budget with the states that move the most bytes
  per byte stored (weights, then Adam moments) and puts the rest on the SSD. The budget is
  ``machine.host_budget``: the tightest of ``storage.host_budget_bytes``, a share of MemAvailable and a share
  of what the memory cgroup still allows (``RunPlan.host_budget_source`` says which);
  ``ACTIVATION_RESERVE_SHARE`` of it is left for the activations (sized at the first step, when the host
  budget is checked again with them).
- **order**: vertical (the horizontal order moves every unit's weights M times more).
- **batching**: batched forward and backward passes when the module declares that its blocks treat
  samples independently (``LayeredModule.independent_samples``; the GPT and HuggingFace modules do): on
  the measured presets they are the fastest. Otherwise the unbatched passes, which are exact for any block,
  with ``split_backward`` when ``SPLIT_BACKWARD_WINS`` (measured, see that constant).
- **alpha** and the **optimizer step's mode**, decided here only (the engine and ``placement.plan`` take
  them as given): ``placement.choose_alpha`` (the forward's share of the block compute). Norm clipping and
  fp16 loss scaling need the global norm / the overflow flag before any update: by default the step is
  speculative (``schedule.speculation="on"``: the units are stepped at that alpha, rolled back when the
  clip factor was not 1 or a gradient overflowed, engine/optimizer/rollback.py), and the rollback state goes on the
  host when the budget left after placement holds it, else on the SSD; ``speculation="off"`` runs alpha 1
  (every whole update deferred), and the parked gradients are sized with that.
- **prefetch depth**: ``placement.prefetch_depth``: deeper when the weights are partly on the SSD (a unit's
  read then takes longer than a unit's compute on the measured machines). A given depth is the one every
  candidate placement is sized with.
- **kept activations**: the effective policy, with its reason: none where the schedule cannot keep a graph
  (the split backward, or a forward and backward that group micro-batches differently) and none for
  ``"auto"`` on a GPU (the graphs would live in device memory, which the host budget does not see); else
  the given count, or ``"auto"``: the engine measures a unit's graph at the first step and keeps the top
  units whose graphs fit the budget left after the plan (engine/step/kept_graphs.py, ``RunPlan.kept_units``).
- **the model's shape** (``setup_layouts``): the units and the bytes of every stored state in the dtypes
  that run (half-precision weight storage included), the one ``ModelShape`` the planner places and the
  engine checks.

The step-time prediction needs the tokens per micro-batch: it is made on this plan by planning/run_prediction.py,
at setup from ``example_batch`` when the loader allows it, and again after the first step, with the kept graphs
decided.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from snake_strategy.config import STATES, ScheduleConfig, StorageConfig, TierShares
from snake_strategy.contract import check_trainable
from snake_strategy.planning.machine import SOURCE_AVAILABLE, host_budget, process_baseline_bytes
from snake_strategy.planning.memory_model import (MemoryInputs, format_plan, host_plan, rollback_copied_elems,
                                                  rollback_held_bytes)
from snake_strategy.planning.placement import (choose_alpha, kept_activations, memory_inputs, place_rollback,
                                               place_states, prefetch_depth)
from snake_strategy.planning.time_model import HardwareProfile, Knee, ModelShape, StepPrediction
from snake_strategy.precision import DtypePolicy
from snake_strategy.optimizers.kind import scratch_elems
from snake_strategy.optimizers.spec import OptimizerSpec, inspect_optimizer, step_kind
from snake_strategy.units import UnitLayout, WeightFormat, build_layouts

log = logging.getLogger(__name__)

# Activation checkpoints and the compute workspace are sized only at the first step (they need the tokens
# per micro-batch): the placement leaves this share of the budget for them (checked then, item by item).
ACTIVATION_RESERVE_SHARE = 0.25
# Measured on this project's CPU benchmarks (docs/dev/LOG.md, "LayerPipe's split backward for real"): whether
# the split backward beats the unbatched backward it replaces for models whose blocks may mix samples.
SPLIT_BACKWARD_WINS = False


STEP_MODES = ("overlapped", "speculative", "deferred")


@dataclass(frozen=True)
class RunPlan:
    """What the planner chose for this run, and why (``strategy.plan``): every decided value. The engines
    read it and decide none of it again (the memory they check is ``host_items``, the check
    ``check_host_budget``)."""

    storage: StorageConfig  # concrete: every state placed
    schedule: ScheduleConfig  # concrete: every field set
    reasons: dict[str, str]  # setting -> "given" or why the planner chose it
    host_budget_bytes: int  # machine.host_budget: the tightest bound, which every reader uses
    host_bytes: int  # memory_model.host_plan of the chosen settings (checkpoints not yet counted)
    host_budget_source: str = SOURCE_AVAILABLE  # which bound it was (machine.SOURCE_*)
    host_budget_detail: str = ""  # the numbers behind it
    prediction: StepPrediction | None = None  # the floor of one step, from the first batch's shapes
    # The prediction made before step 1 ran (from shapes and probed rates only), kept as it was: ``prediction``
    # is replaced by the first step's measured sizes and by the calibration.
    setup_prediction: StepPrediction | None = None
    # Seconds the timing of this model's unit and non-layer work before step 1 took (None: not timed, the
    # strategy was given a HardwareProfile): what the prediction before step 1 cost the run.
    setup_timing_s: float | None = None
    kept_units: list[int] | None = None  # units whose forward graph is kept (known after the first step)
    # The model laid out in units and its shape before any batch (setup_layouts): what the engine builds
    # from, so the model is laid out and checked once. Not part of as_dict (module references).
    layouts: list[UnitLayout] = dataclasses.field(default_factory=list, repr=False)
    shape: ModelShape | None = dataclasses.field(default=None, repr=False)
    optimizer: OptimizerSpec | None = dataclasses.field(default=None, repr=False)  # its state's slots (training)
    # The optimizer step that runs: "overlapped" (no global decision needed), "speculative" (norm clipping
    # or fp16 loss scaling, rolled back when wrong) or "deferred" (alpha 1: whole updates deferred).
    step_mode: str = "overlapped"
    # What the prediction takes the steps to be under a speculative step: deferring (the step after a clipped
    # one applies every whole update at the next forward) under norm clipping, whose early steps clip (a
    # model's norm is far above max_norm at init: 143 for gpt_1b); speculated under fp16 loss scaling, whose
    # overflows are rare. The steps themselves decide (``SpeculationPolicy``); the calibration follows what
    # they measured (``RunPredictor.after_step``).
    deferring: bool = False
    rollback_bytes: int = 0  # the speculative step's rollback copies, on storage.rollback
    rollback_held_bytes: int = 0  # and the SSD bytes its held state versions keep (disk only)
    # The host budget less ACTIVATION_RESERVE_SHARE: what the placement filled (the reserve is left for the
    # activation checkpoints and the compute workspace, sized at the first step).
    placement_budget_bytes: int = 0
    device_is_cpu: bool = True  # on a CPU "device" the device shares live in host memory too
    evaluating: bool = False  # the forward-only engine's plan: only the compute weights are stored
    # The process's resident memory at setup besides the module's tensors (interpreter, libraries): the plan's
    # host bytes come on top of it, so their sum is the process's expected peak.
    process_baseline_bytes: int = 0
    # The engine's host items once the first step measured the checkpoints and kept graphs: what the steps hold.
    step_host_bytes: int | None = None
    hardware: HardwareProfile | None = dataclasses.field(default=None, repr=False)  # the prediction's rates
    knee: Knee | None = None  # where this run turns compute-bound (with the prediction)
    # The prediction against the first steady steps (planning/calibration.py): measured (their median), error,
    # the corrected prediction and the settings re-planned with the measured rates; every check's error in
    # "checks". None before the first steady step.
    calibration: dict[str, Any] | None = None

    def memory_inputs(self, checkpoint_bytes: int = 0, shard_rank: int = 0, loss_logits_bytes: int = 0) -> MemoryInputs:
        """What the memory model sees of this plan, with checkpoints of ``checkpoint_bytes`` and the loss head's
        output of ``loss_logits_bytes`` per backward task (both known after the first step) on rank
        ``shard_rank`` of partitioned moments: the plan's and the engine's numbers."""
        assert self.shape is not None, "a plan from planning.run_plan.resolve carries the model's shape"
        s = self.schedule
        return memory_inputs(
            dataclasses.replace(self.shape, checkpoint_bytes=checkpoint_bytes),
            HardwareProfile(device_is_cpu=self.device_is_cpu), self.storage, s.kind, s.alpha, s.prefetch_depth,
            self.step_mode == "speculative", blocks_per_unit=s.blocks_per_unit,
            # the split backward keeps every micro-batch's Linear inputs and output gradients until W(u)
            micro_per_backward_task=s.num_micro_batches if s.batched_backward or s.split_backward else 1,
            shard_rank=shard_rank, evaluating=self.evaluating, loss_logits_bytes=loss_logits_bytes)

    def loss_logits_bytes(self, per_micro_batch: int) -> int:
        """The loss head's output over the micro-batches one backward task runs (all of them when batched),
        from one micro-batch's (``contract.loss_head_bytes``)."""
        s = self.schedule
        return per_micro_batch * (s.num_micro_batches if s.batched_backward or s.batched_forward else 1)

    def largest_block_matrix(self) -> tuple[int, int]:
        """(out, in) of the largest 2-D block parameter: the matmul shape the compute roof is probed at."""
        shapes = [s.shape for layout in self.layouts for s in layout.slots if len(s.shape) == 2]
        return tuple(max(shapes, key=lambda sh: sh[0] * sh[1])) if shapes else (1, 1)

    def host_items(self, checkpoint_bytes: int = 0, shard_rank: int = 0, loss_logits_bytes: int = 0) -> dict[str, int]:
        """Host bytes of this plan, item by item (``memory_model.host_plan``)."""
        return host_plan(self.memory_inputs(checkpoint_bytes, shard_rank, loss_logits_bytes))

    def check_host_budget(self, items: dict[str, int]) -> None:
        """The host-budget check of both engines: ``items`` (their host plan, ``host_items`` and what the
        first step measured) must fit ``storage.host_budget_bytes`` when it is given. That cap is a
        refusal; a budget from MemAvailable or the cgroup is an estimate the plan fills, never a refusal."""
        budget = self.storage.host_budget_bytes
        needed = sum(items.values())
        if budget is None or needed <= budget:
            return
        if self.evaluating:
            fixes = ("move the weights share to 'ssd' (storage.weights), lower schedule.prefetch_depth or "
                     "schedule.blocks_per_unit, or raise storage.host_budget_bytes")
        else:
            fixes = ("move weights/optimizer/gradients/checkpoints shares (or storage.rollback) to 'ssd', lower "
                     "schedule.prefetch_depth, use smaller units (schedule.blocks_per_unit), fewer micro-batches "
                     "or a smaller micro-batch, or raise storage.host_budget_bytes")
        raise ValueError(
            f"{'evaluation' if self.evaluating else 'the plan'} needs {needed / 2**30:.2f} GiB ({needed} bytes) of "
            f"host memory but storage.host_budget_bytes allows {budget / 2**30:.2f} GiB ({budget} bytes): "
            f"{format_plan(items)}. To fit: {fixes}")

    def describe(self) -> str:
        s, st = self.schedule, self.storage
        batching = ("split backward" if s.split_backward else
                    f"batched forward={s.batched_forward} backward={s.batched_backward}")
        places = ", ".join(f"{state} {_split_text(getattr(st, state))}" for state in STATES)
        kept = s.keep_activations if self.kept_units is None else f"{len(self.kept_units)} units"
        step = self.step_mode
        if step == "speculative":
            step = (f"speculative (rollback state {self.rollback_bytes / 2**30:.2f} GiB copied to the {st.rollback}, "
                    f"{self.rollback_held_bytes / 2**30:.2f} GiB held as SSD file versions; predicted "
                    + ("deferring: the steps after a clipped one apply whole updates at the next forward)"
                       if self.deferring else "speculated)"))
        text = (f"{s.kind}, {s.num_micro_batches} micro-batches, {batching}, alpha {s.alpha}, optimizer step "
                f"{step}, prefetch {s.prefetch_depth}, keep activations {kept}; {places}; host "
                f"{self.host_bytes / 2**30:.2f} of {self.host_budget_bytes / 2**30:.2f} GiB (bounded by "
                f"{self.host_budget_source}: {self.host_budget_detail})")
        if self.step_host_bytes is not None:
            text += f", {self.step_host_bytes / 2**30:.2f} GiB in the steps with the activations"
        text += f", above the process's {self.process_baseline_bytes / 2**30:.2f} GiB at setup"
        if self.optimizer is not None:
            step_s = self.prediction.optimizer_s if self.prediction is not None else None
            text += "; " + self.optimizer.describe(self.shape.state_bytes, self.shape.moment_elems,
                                                   2 * self.shape.master_bytes, step_s)
        if self.setup_prediction is not None:
            text += f"; predicted before step 1 {self.setup_prediction.roofline_s:.3f} s/step"
            if self.setup_timing_s is not None:
                text += f" (its timing took {self.setup_timing_s:.1f} s)"
        if self.prediction is not None:
            text += f"; predicted {self.prediction.roofline_s:.3f} s/step ({self.prediction.bound}-bound"
            c = self.calibration
            if c is not None and c["replanned"]:
                measured = (f"{c['measured']['step_s']:.3f} s measured" if c.get("steps_measured", 1) == 1 else
                            f"{c['measured']['step_s']:.3f} s the median of steps {c['step'] - c['steps_measured'] + 1}"
                            f"-{c['step']}")
                text += (f", corrected after step {c['step']} from the measured rates: {c['predicted_s']:.3f} s "
                         f"({c['predicted_bound']}) predicted, {measured}")
            elif c is not None:
                text += f", {100 * c['error']:+.0f}% against step {c['step']}"
            text += ")"
        if self.knee is not None:
            text += f"; {self.knee.describe()}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"schedule": dataclasses.asdict(self.schedule),
                "storage": {k: (dataclasses.asdict(v) if isinstance(v, TierShares) else v)
                            for k, v in dataclasses.asdict(self.storage).items()},
                "reasons": dict(self.reasons), "host_budget_bytes": self.host_budget_bytes,
                "host_budget_source": self.host_budget_source, "host_budget_detail": self.host_budget_detail,
                "host_bytes": self.host_bytes, "step_host_bytes": self.step_host_bytes,
                "process_baseline_bytes": self.process_baseline_bytes,
                "kept_units": self.kept_units, "step_mode": self.step_mode, "deferring": self.deferring,
                "rollback_bytes": self.rollback_bytes,
                "rollback_held_bytes": self.rollback_held_bytes,
                "placement_budget_bytes": self.placement_budget_bytes, "evaluating": self.evaluating,
                "prediction": self.prediction.as_dict() if self.prediction is not None else None,
                "setup_prediction": self.setup_prediction.as_dict() if self.setup_prediction is not None else None,
                "setup_timing_s": self.setup_timing_s,
                "knee": self.knee.as_dict() if self.knee is not None else None,
                "calibration": self.calibration,
                "hardware": dataclasses.asdict(self.hardware) if self.hardware is not None else None,
                "optimizer": None if self.optimizer is None else {
                    "class": self.optimizer.class_name, "kind": self.optimizer.kind.name,
                    "state_bytes_per_param": self.shape.state_bytes,
                    "slots": {slot.name: str(slot.dtype).removeprefix("torch.") for slot in self.optimizer.slots}}}


# Non-layer parameters up to this many elements are probed at their own shape (optimizers stepped per tensor).
PROBED_NONLAYER_ELEMS = 2**22


def setup_layouts(module: nn.Module, optimizer: torch.optim.Optimizer | None, blocks_per_unit: int, num_micro: int,
                  dtypes: DtypePolicy, chunk_elems: int) -> tuple[list[UnitLayout], ModelShape, OptimizerSpec | None]:
    """The model's units, the planner's view of them before any batch is seen (tokens and checkpoint
    sizes are 0) and what the optimizer keeps per parameter (optimizers/spec.py). The only place a run lays
    its model out and builds its shape: the engines take all three from the plan. Training stores the
    weights as ``dtypes`` says (half-precision matmul weights with their full-precision tail, the master
    copy separately) and the optimizer's state in its own dtypes, laid out as its kind lays it out (slots,
    the worker's scratch for chunks of ``chunk_elems``); evaluation stores the compute weights only."""
    spec = None
    if optimizer is None:  # evaluation: no optimizer, the compute weights are all that is stored
        groups = {id(p): 0 for p in module.parameters()}
        stored, half, kind = "compute", None, None
    else:
        kind = step_kind(optimizer)  # refuses what cannot be stepped exactly, before anything is built
        groups = check_trainable(module, optimizer)  # the engine's refusals, with their messages
        stored, half = "weights", dtypes.half_weights
    layouts = build_layouts(module.blocks, blocks_per_unit, groups, align_params=kind is not None and kind.whole_tensors)
    formats = [WeightFormat.for_layout(layout, half, dtypes.master) for layout in layouts] if half else []
    shape = ModelShape.from_layouts(layouts, module, num_micro, dtypes.bytes_per(stored), dtypes.bytes_per("master"),
                                    compute_bytes=dtypes.bytes_per("compute"),
                                    weight_formats=[(f.main_numel, f.tail_bytes) for f in formats])
    if optimizer is not None:
        params = [(layout.group_of(s), tuple(s.shape)) for layout in layouts for s in layout.trainable_slots]
        block_ids = {id(p) for p in module.blocks.parameters()}
        nonlayer = [(groups[id(p)], tuple(p.shape)) for p in module.parameters()
                    if p.requires_grad and id(p) not in block_ids]
        # A class stepped per tensor is probed at each shape: the non-layer ones too, unless one is so large
        # that a probe off the meta device would cost (its state is then counted at the blocks' average).
        probed = [(g, s) for g, s in nonlayer if math.prod(s) <= PROBED_NONLAYER_ELEMS]
        spec = inspect_optimizer(optimizer, kind, params + probed, dtypes.master)
        shape = dataclasses.replace(shape, state_bytes_per_elem=spec.bytes_per_elem(params),
                                    **state_footprint(spec, layouts, nonlayer, probed, chunk_elems))
    return layouts, shape, spec


def state_footprint(spec: OptimizerSpec, layouts: list[UnitLayout], nonlayer: list[tuple[int, tuple[int, ...]]],
                    probed: list[tuple[int, tuple[int, ...]]], chunk_elems: int) -> dict[str, Any]:
    """The ``ModelShape`` fields of the optimizer's state as the engine allocates it: each slot's bytes per
    element, lengths (a slot indexed by its own elements) and worker scratch; the worker's chunk when chunks
    are whole tensors; the non-layer parameters' state bytes (exact for the ``probed`` (group, shape)s)."""
    chunk, scratch = scratch_elems(spec, layouts, [(0, layout.train_end) for layout in layouts], chunk_elems)
    slots = []
    for slot in spec.slots:
        own = [spec.kind.slot_offsets(spec, slot, layout) for layout in layouts]
        numels = tuple(o[1] for o in own) if any(o is not None for o in own) else ()
        slots.append((slot.dtype.itemsize, numels, scratch[slot.name] if numels else 0))
    average = spec.bytes_per_elem([(layout.group_of(s), tuple(s.shape)) for layout in layouts
                                   for s in layout.trainable_slots])
    nonlayer_bytes = sum(slot.dtype.itemsize * spec.slot_numel(slot, g, s) for g, s in probed for slot in spec.slots)
    nonlayer_bytes += math.ceil(average * sum(math.prod(s) for g, s in nonlayer if (g, s) not in probed))
    return {"state_slots": tuple(slots), "optimizer_chunk_elems": chunk if spec.kind.whole_tensors else 0,
            "nonlayer_state_bytes": nonlayer_bytes}


def resolve(module: nn.Module, optimizer: torch.optim.Optimizer | None, storage: StorageConfig,
            schedule: ScheduleConfig, dtypes: DtypePolicy, device: torch.device, hardware: HardwareProfile,
            processes_per_node: int = 1, optimizer_shards: int = 1, clip: tuple[str, float] | None = None) -> RunPlan:
    """Concrete storage and schedule for this run (explicit settings kept), with the reasons. ``optimizer``
    None: evaluation (the forward-only engine's plan).
    ``processes_per_node``: the ranks sharing this machine's memory split the default budget.
    ``optimizer_shards``: partitioned moments, cut over that many ranks (each plans its share).
    ``clip`` (Trainer's gradient_clip_algorithm, gradient_clip_val) and fp16 loss scaling (``dtypes``)
    decide the optimizer step's mode and with it the alpha that runs (the one place it is decided)."""
    evaluating = optimizer is None
    layouts, shape, spec = setup_layouts(module, optimizer, schedule.blocks_per_unit, schedule.num_micro_batches,
                                         dtypes, storage.optimizer_chunk_elems)
    shape = dataclasses.replace(shape, optimizer_shards=optimizer_shards)
    hardware = dataclasses.replace(hardware, device_is_cpu=device.type == "cpu")
    bounded = host_budget(storage.host_budget_bytes, processes_per_node)
    budget = bounded.budget_bytes
    # Activation checkpoints and the compute workspace are sized at the first step: every placement below
    # fills the budget less their reserve.
    placement_budget = int(budget * (1 - ACTIVATION_RESERVE_SHARE))
    reasons: dict[str, str] = {}
    kind = "vertical" if schedule.kind == "auto" else schedule.kind
    reasons["kind"] = "given" if schedule.kind != "auto" else "vertical: one weight fetch per unit per pass"
    alpha = schedule.alpha if schedule.alpha is not None else choose_alpha(shape)
    reasons["alpha"] = "given" if schedule.alpha is not None else "the forward's share of the block compute"
    speculation = schedule.speculation or "on"
    reasons["speculation"] = "given" if schedule.speculation is not None else "on by default"
    # evaluation steps no optimizer: nothing waits for a global norm or overflow flag
    global_decision = not evaluating and (dtypes.loss_scaling or (clip is not None and clip[0] == "norm"))
    if global_decision and speculation == "off" and alpha != 1.0:
        alpha = 1.0
        reasons["alpha"] = ("1: norm clipping / fp16 loss scaling with schedule.speculation='off' defer every "
                            "unit's whole update until the global norm / overflow flag is known")
    speculative = global_decision and speculation == "on" and alpha < 1.0
    step_mode = "speculative" if speculative else "deferred" if global_decision else "overlapped"
    rollback_given = storage.rollback  # None: placed after the states (placement sets every field)
    given_depth = schedule.prefetch_depth  # None: each candidate placement gets its own (placement.prefetch_depth)
    try:
        try:
            storage, placed = place_states(shape, hardware, storage, kind, alpha, placement_budget, given_depth,
                                           speculative, evaluating)
        except ValueError:
            if schedule.alpha is not None or step_mode == "deferred" or alpha == 0.0 or evaluating:
                raise  # a given alpha, or the deferred step's 1, is the run's: never lowered behind the user
            # The forward part's gradients wait on the host for the next forward; at alpha 0 none wait (the
            # whole update overlaps the backward) and the working set is smallest.
            storage, placed = place_states(shape, hardware, storage, kind, 0.0, placement_budget, given_depth,
                                           speculative, evaluating)
            reasons["alpha"] = (f"0: the gradients parked at alpha {alpha:g} for the next forward do not fit the "
                                "host budget; the whole update overlaps the backward")
            alpha = 0.0
    except ValueError as err:
        # the placement's figure alone reads as the user's setting: say what it is a share of, and whence
        raise ValueError(f"{err}. The placement gets {1 - ACTIVATION_RESERVE_SHARE:.0%} of the host budget "
                         f"{budget / 2**30:.2f} GiB (the rest is kept for the activations), bounded by "
                         f"{bounded.source}: {bounded.detail}") from None
    reasons.update(placed)
    if given_depth is not None:
        depth, reasons["prefetch_depth"] = given_depth, "given"
    else:
        depth, reasons["prefetch_depth"] = prefetch_depth(storage)
    batching, why = _batching(module, schedule, kind)
    reasons.update(why)
    concrete = dataclasses.replace(schedule, kind=kind, alpha=alpha, prefetch_depth=depth, speculation=speculation,
                                   **batching)
    keep, reasons["keep_activations"] = kept_activations(concrete, device)
    concrete = dataclasses.replace(concrete, keep_activations=keep)
    storage, reasons["rollback"] = place_rollback(shape, hardware, storage, rollback_given, kind, alpha, depth,
                                                  placement_budget, speculative)
    if schedule.split_backward:
        log.info("schedule.split_backward=true: LayerPipe's split backward (input gradients per micro-batch, Linear "
                 "weight gradients as one product per unit)")
    run_plan = RunPlan(storage, concrete, reasons, budget, 0, bounded.source, bounded.detail,
                       process_baseline_bytes=process_baseline_bytes([*module.parameters(), *module.buffers()]),
                       layouts=layouts,
                       shape=shape, optimizer=spec, step_mode=step_mode,
                       deferring=speculative and clip is not None and clip[0] == "norm",
                       placement_budget_bytes=placement_budget,
                       device_is_cpu=device.type == "cpu", evaluating=evaluating)
    inputs = run_plan.memory_inputs()
    rollback_bytes = sum(rollback_copied_elems(inputs)) * shape.master_bytes
    if storage.checkpoints.ssd > 0 and concrete.num_micro_batches <= 2 * storage.checkpoint_host_ends:
        log.warning(
            "storage.checkpoints puts %.0f%% on the SSD, but with schedule.num_micro_batches=%d and "
            "storage.checkpoint_host_ends=%d every micro-batch is a turning point kept on the host: no "
            "activation checkpoint will reach the SSD. Lower checkpoint_host_ends or raise num_micro_batches",
            100 * storage.checkpoints.ssd, concrete.num_micro_batches, storage.checkpoint_host_ends)
    return dataclasses.replace(run_plan, host_bytes=sum(host_plan(inputs).values()), rollback_bytes=rollback_bytes,
                               rollback_held_bytes=rollback_held_bytes(inputs))


def _batching(module: nn.Module, schedule: ScheduleConfig, kind: str) -> tuple[dict[str, bool], dict[str, str]]:
    """batched_forward / batched_backward / split_backward: the given ones kept, the others chosen to match
    (a random block needs the forward and the recompute grouped alike)."""
    names = ("batched_forward", "batched_backward", "split_backward")
    given = {n: getattr(schedule, n) for n in names if getattr(schedule, n) is not None}
    reasons = {n: "given" for n in given}
    if kind != "vertical":
        return {n: given.get(n, False) for n in names}, {**{n: "horizontal order" for n in names}, **reasons}
    if given.get("split_backward") or given.get("batched_backward") is False or given.get("batched_forward") is False:
        # An unbatched pass was asked for: keep the other unbatched too (the dropout rule), split as measured.
        split = given.get("split_backward", SPLIT_BACKWARD_WINS and not given.get("batched_backward"))
        chosen = {"batched_forward": False, "batched_backward": False, "split_backward": split}
        why = "unbatched passes, as asked"
    elif given.get("batched_backward") or given.get("batched_forward"):
        chosen = {"batched_forward": True, "batched_backward": True, "split_backward": False}
        why = "batched passes, as asked (both, so dropout masks replay)"
    elif getattr(module, "independent_samples", False):
        chosen = {"batched_forward": True, "batched_backward": True, "split_backward": False}
        why = "batched passes: the module declares independent samples (fastest measured)"
    else:
        chosen = {"batched_forward": False, "batched_backward": False, "split_backward": SPLIT_BACKWARD_WINS}
        why = ("unbatched passes: the module does not declare independent samples "
               "(LayeredModule.independent_samples)")
    chosen.update(given)
    reasons.update({n: why for n in names if n not in given})
    return chosen, reasons


def _split_text(split: TierShares) -> str:
    parts = [f"{tier} {getattr(split, tier):g}" for tier in ("device", "host", "ssd") if getattr(split, tier)]
    return "/".join(parts)
