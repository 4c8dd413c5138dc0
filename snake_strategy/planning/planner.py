"""The planner: predict a step's time from the model's shape and the hardware, and choose alpha and a
placement. Pure functions of plain data, so every choice can be checked by hand.

Traffic per optimizer step (docs/design.md, "Traffic model"; P = block params, L = units, M = micro-batches):

    weights read   vertical  (2L-1) fetches x P/L x e_w      horizontal  M(2L-1)-(M-1) fetches
    optimizer      read and write master + its state once per step     (P x (e_m + e_s) each way; Adam e_s = 2 e_m)
    gradients      vertical: the forward part (alpha x P x e_m) written and read back once;
                   horizontal: also a partial sum written per micro-batch and read back (M-1 times)
    checkpoints    each SSD-resident (unit, micro) input written once, read twice (forward and
                   recompute; the last unit's once)
    Every SSD transfer is page-rounded per unit, as the engine's are.

Roofline, per resource: the step cannot be faster than the busiest resource's total work.
- ``compute``: block FLOPs (forward, recompute, backward = 4 x forward per unit except the last,
  which needs 3) plus the head, the forward FLOPs at the forward's measured rate, the backward's at its own;
- ``ssd``: read bytes / read bandwidth + write bytes / write bandwidth (one device does both);
- ``optimizer``: parameters / fused-AdamW rate;
- ``cpu``: on a CPU-only machine compute, the optimizer, the copies between the tiers in memory and the
  processor time of the SSD transfers share the same cores, so their sum.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from snake_strategy.config import ScheduleConfig, StorageConfig, TierShares
from snake_strategy.planning.memory_model import (MemoryInputs, checkpoint_tiers, forward_part_end, host_plan,
                                                  shard_bounds, unit_rollback_elems)
from snake_strategy.storage.tiered import tier_bytes
from snake_strategy.units import UnitLayout, nonlayer_numel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HardwareProfile:
    ssd_read_gb_per_s: float = 1.2
    ssd_write_gb_per_s: float = 1.8
    host_copy_gb_per_s: float = 8.0
    ssd_cpu_s_per_gb: float = 0.0  # processor seconds the process spends per GB moved to or from the SSD
    flops_per_s: float = 75e9  # forward (and recompute) FLOPs
    optimizer_params_per_s: float = 740e6
    # The backward's FLOP rate where it was measured apart from the forward's (a timed unit); None: the same.
    backward_flops_per_s: float | None = None
    # Seconds per token of the non-layer work (embedding, head, loss; forward and backward) where it was timed;
    # None: the head's FLOPs at the compute rates.
    nonlayer_s_per_token: float | None = None
    device_is_cpu: bool = True
    # Rates measured inside running steps (planning/calibration.py): compute and the optimizer already shared
    # the cores there, so the CPU term (their sum) would count the sharing twice.
    measured_in_step: bool = False


@dataclass(frozen=True)
class ModelShape:
    num_units: int
    params_per_unit: int
    nonlayer_params: int
    head_params: int  # parameters of the output projection (its matmul runs for every token)
    tokens_per_micro: int
    num_micro: int
    checkpoint_bytes: int  # one unit input of one micro-batch
    attention_flops_per_token_per_unit: float = 0.0
    weight_bytes: int = 4  # e_w: bytes per compute weight
    master_bytes: int = 4  # e_m: bytes per master weight / moment / gradient element
    # Frozen parameters: per unit, the elements with a master copy, moments and gradients (empty: all of
    # them); the lowest unit that needs a backward (units below it only run forward); nonlayer_params
    # counts the trainable non-layer parameters, nonlayer_frozen_params the others.
    trainable_per_unit: tuple[int, ...] = ()
    first_backward_unit: int = 0
    nonlayer_frozen_params: int = 0
    # The largest trainable non-layer parameter: one non-layer backward (the head's, the embedding's) holds
    # its transient gradient at a time. 0: unknown (a shape on paper), taken as all of nonlayer_params.
    nonlayer_largest_params: int = 0
    # Half-precision weight storage (mixed precision): elements of a unit's stored weight vector (0: all
    # its parameters) and the bytes of its full-precision tail, which stays in memory.
    weight_elems_per_unit: int = 0
    weight_tail_bytes_per_unit: int = 0
    # Units (the top ones below the last) whose forward graph is kept: their backward has no recompute.
    kept_units: int = 0
    # Partitioned optimizer state (data parallel): the ranks the moments are cut over. Placement is planned
    # for rank 0, whose shards are the largest, so every rank makes the same choice.
    optimizer_shards: int = 1
    # Exact per-unit sizes of a laid-out model (``from_layouts``): the memory model sums them unit by unit.
    # Empty: every unit has ``params_per_unit`` parameters (a model planned on paper).
    unit_params: tuple[int, ...] = ()
    unit_weight_elems: tuple[int, ...] = ()  # half-precision weight storage: a unit's stored vector
    unit_weight_tail_bytes: tuple[int, ...] = ()
    compute_bytes: int = 0  # bytes per compute-dtype element when it differs from ``weight_bytes``; 0: the same
    # Bytes of optimizer state per trainable element, as the optimizer keeps it (optimizers/spec.py); None:
    # Adam's two moments in the master dtype.
    state_bytes_per_elem: float | None = None
    # The optimizer's state as the engine lays it out (optimizers/kind.py), per slot: (bytes per element, per
    # unit its length when the slot is indexed by its own elements (empty: the unit's trainable elements), the
    # worker's scratch elements of it (0: one chunk)). Empty: Adam's two moments in the master dtype.
    state_slots: tuple[tuple[int, tuple[int, ...], int], ...] = ()
    # The worker's chunk of master weights and gradient when the optimizer's chunks are whole tensors (0: the
    # smaller of the largest unit and storage.optimizer_chunk_elems).
    optimizer_chunk_elems: int = 0
    # The non-layer parameters' optimizer state, bytes; -1: Adam's two moments in the master dtype.
    nonlayer_state_bytes: int = -1

    @classmethod
    def from_layouts(cls, layouts: Sequence[UnitLayout], module: nn.Module, num_micro: int, weight_bytes: int,
                     master_bytes: int, compute_bytes: int = 0,
                     weight_formats: Sequence[tuple[int, int]] = ()) -> ModelShape:
        """The shape of ``module`` laid out in units (``units.build_layouts``), before any batch: tokens,
        checkpoint sizes and the head are filled in from the first micro-batch (``dataclasses.replace``).
        ``weight_formats``: per unit, (stored weight elements, full-precision tail bytes) under half-precision
        weight storage. The planner at setup and the engine read the same shape from here."""
        trainable, frozen, largest = nonlayer_numel(module)
        unit_params = tuple(layout.numel for layout in layouts)
        return cls(num_units=len(layouts), params_per_unit=max(unit_params, default=0), nonlayer_params=trainable,
                   head_params=0, tokens_per_micro=0, num_micro=num_micro, checkpoint_bytes=0,
                   weight_bytes=weight_bytes, master_bytes=master_bytes,
                   trainable_per_unit=tuple(layout.train_end for layout in layouts), nonlayer_frozen_params=frozen,
                   nonlayer_largest_params=largest,
                   weight_elems_per_unit=max((e for e, _ in weight_formats), default=0),
                   weight_tail_bytes_per_unit=max((b for _, b in weight_formats), default=0),
                   unit_params=unit_params, unit_weight_elems=tuple(e for e, _ in weight_formats),
                   unit_weight_tail_bytes=tuple(b for _, b in weight_formats), compute_bytes=compute_bytes)

    @property
    def trainable(self) -> tuple[int, ...]:
        return self.trainable_per_unit or (self.params_per_unit,) * self.num_units

    @property
    def state_bytes(self) -> float:
        """e_s: bytes of optimizer state per trainable element."""
        return self.state_bytes_per_elem if self.state_bytes_per_elem is not None else 2.0 * self.master_bytes

    @property
    def moment_elems(self) -> int:
        """Elements of one Adam moment on rank 0 (every trainable element when not partitioned)."""
        return sum(hi - lo for lo, hi in (shard_bounds(t, self.optimizer_shards, 0) for t in self.trainable))

    @property
    def backward_from(self) -> int:
        """The lowest unit with a backward task (the last unit's fused task always runs)."""
        return min(self.first_backward_unit, self.num_units - 1)


@dataclass(frozen=True)
class StepPrediction:
    compute_s: float
    ssd_s: float
    host_copy_s: float
    optimizer_s: float
    roofline_s: float
    bound: str
    ssd_read_bytes: int
    ssd_write_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def weight_fetches_per_step(kind: str, num_units: int, num_micro: int, backward_from: int = 0) -> int:
    """Fetches per step; units below ``backward_from`` (frozen, feeding nothing trainable) have no backward."""
    passes = 2 * num_units - 1 - backward_from
    if kind == "vertical":
        return passes
    # Horizontal: the next micro-batch's forward starts on the unit the backward ended on only when that
    # is unit 0.
    return num_micro * passes - (num_micro - 1 if backward_from == 0 else 0)


def step_flops_split(shape: ModelShape) -> tuple[float, float]:
    """(forward FLOPs, backward FLOPs) of one optimizer step: 2 per parameter per token forward (recompute
    included), 4 backward.

    A unit's backward is its input gradient (one forward's worth) plus its weight gradient (one forward's
    worth times its trainable share); units below ``backward_from`` only run forward, and the lowest
    unit with a backward needs no input gradient when it is above unit 0."""
    fwd_unit = (2 * shape.params_per_unit + shape.attention_flops_per_token_per_unit) * shape.tokens_per_micro
    b0, last = shape.backward_from, shape.num_units - 1
    first_kept = last - shape.kept_units  # units [first_kept, last) keep their graph: no recompute
    forward = backward = 0.0
    for u, trained in enumerate(shape.trainable):
        forward += 1
        if u >= b0:
            forward += u < first_kept  # the recompute
            backward += (u > b0 or b0 == 0) + trained / max(1, shape.params_per_unit)
    head = 2 * shape.head_params * shape.tokens_per_micro
    return shape.num_micro * (fwd_unit * forward + head), shape.num_micro * (fwd_unit * backward + 2 * head)


def step_flops(shape: ModelShape) -> float:
    """FLOPs of one optimizer step (``step_flops_split``, forward and backward together)."""
    return sum(step_flops_split(shape))


def compute_seconds(shape: ModelShape, hw: HardwareProfile) -> float:
    """One step's forward and backward at ``hw``'s rates: the FLOPs at the forward's and the backward's, the
    non-layer work at its timed seconds per token where it was timed (its head FLOPs then not counted)."""
    forward, backward = step_flops_split(shape)
    tokens = shape.num_micro * shape.tokens_per_micro
    nonlayer_s = 0.0
    if hw.nonlayer_s_per_token is not None:
        forward -= 2 * shape.head_params * tokens
        backward -= 4 * shape.head_params * tokens
        nonlayer_s = hw.nonlayer_s_per_token * tokens
    return forward / hw.flops_per_s + backward / (hw.backward_flops_per_s or hw.flops_per_s) + nonlayer_s


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
        """The ``HardwareProfile`` rates this timing gives, its FLOPs counted as ``step_flops_split`` counts a
        step's: a forward of ``params`` over ``tokens``, a backward of the input gradient (one forward's worth)
        and the weight gradient (the ``trained`` share of one)."""
        forward = (2 * self.params + shape.attention_flops_per_token_per_unit) * self.tokens
        backward = forward * (1 + self.trained / max(1, self.params))
        rates = {"flops_per_s": forward / self.forward_s, "backward_flops_per_s": backward / self.backward_s}
        if self.nonlayer_s is not None:
            rates["nonlayer_s_per_token"] = self.nonlayer_s / self.tokens
        return rates


def predict(shape: ModelShape, hw: HardwareProfile, storage: StorageConfig, kind: str, alpha: float,
            speculative: bool = False) -> StepPrediction:
    """Predicted floor of one step's time for this placement and schedule (``speculative``: a committed
    speculative step, which also writes its rollback state; a rollback's redo is not in the floor).

    The bytes are exact: the same tier boundaries and page rounding as the engine's transfers
    (``storage.tiered.tier_bytes``), so they equal the engine's counters for a steady-state step.
    """
    u, L, M = shape.params_per_unit, shape.num_units, shape.num_micro
    e_w, e_m = shape.weight_bytes, shape.master_bytes
    separate_master = e_w != e_m
    states = shape.state_bytes / e_m  # the optimizer's state in master-dtype elements (2 for Adam's moments)
    fetches = weight_fetches_per_step(kind, L, M, shape.backward_from)
    weights = tier_bytes(shape.weight_elems_per_unit or u, storage.weights, e_w)
    # the tail: read by every fetch, rewritten by every step, kept in host memory (or on the device)
    tail = shape.weight_tail_bytes_per_unit if storage.weights.device < 1.0 else 0
    read, write = fetches * weights["ssd"], 0
    host_bytes = fetches * (weights["host"] + tail)
    partials = M - 1 if kind == "horizontal" else 0
    # Only a unit's trainable part [0, t) has a master copy, moments and gradients; frozen weights are read
    # by the fetches above and never written.
    for t in shape.trainable:
        master = tier_bytes(t, storage.master, e_m) if separate_master else tier_bytes(u, storage.weights, e_m, 0, t)
        moments = tier_bytes(t, storage.optimizer, e_m)
        grad_part = tier_bytes(t, storage.gradients, e_m, 0, forward_part_end(t, alpha))  # parked forward part
        grad_full = tier_bytes(t, storage.gradients, e_m)  # a horizontal partial sum
        # The optimizer reads and writes the master and both moments once; bf16-true refreshes the compute copy.
        moved = master["ssd"] + states * moments["ssd"] + grad_part["ssd"] + partials * grad_full["ssd"]
        read += moved
        write += moved
        host_bytes += 2 * master["host"] + 2 * states * moments["host"]
        if separate_master:
            refresh = tier_bytes(shape.weight_elems_per_unit or u, storage.weights, e_w, 0, t)
            write += refresh["ssd"]
            host_bytes += refresh["host"] + tail
        if speculative:  # the rollback copies (gradient + in-memory states); the states' SSD part is held
            _, copied, _ = unit_rollback_elems(t, u, alpha, storage, separate_master, shape.optimizer_shards, 0,
                                               states)
            rollback = tier_bytes(copied, TierShares(host=0.0, ssd=1.0) if storage.rollback == "ssd" else TierShares(),
                                  e_m)
            write += rollback["ssd"]
            host_bytes += rollback["host"]
    if L > 1:
        # Each SSD checkpoint (a unit's input) is written once and read by the unit's forward and by its
        # recompute; the last unit's input only once (its backward is fused with its forward), and units
        # without a backward (below backward_from) or with a kept graph are not recomputed.
        ckpt_ssd = checkpoint_tiers(storage, M).count("ssd") * shape.checkpoint_bytes
        write += L * ckpt_ssd
        read += (2 * L - 1 - shape.backward_from - shape.kept_units) * ckpt_ssd
    ssd_s = read / (hw.ssd_read_gb_per_s * 1e9) + write / (hw.ssd_write_gb_per_s * 1e9)
    host_copy_s = host_bytes / (hw.host_copy_gb_per_s * 1e9)
    compute_s = compute_seconds(shape, hw)
    optimizer_s = (sum(shape.trainable) + shape.nonlayer_params) / hw.optimizer_params_per_s
    bounds = {"compute": compute_s, "ssd": ssd_s, "host_copy": host_copy_s, "optimizer": optimizer_s}
    if hw.device_is_cpu and not hw.measured_in_step:
        bounds["cpu"] = compute_s + optimizer_s + host_copy_s + (read + write) / 1e9 * hw.ssd_cpu_s_per_gb
    bound = max(bounds, key=bounds.get)
    return StepPrediction(compute_s, ssd_s, host_copy_s, optimizer_s, bounds[bound], bound, int(read), int(write))


@dataclass(frozen=True)
class Placement:
    """A placement: where each state lives, planned for the forward share ``alpha``. The prefetch depth,
    the host bytes and the prediction of a run are the autoplan's (``resolve``), from this placement."""

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
    after the first steady step use (``autoplan.resolve``, planning/calibration.py)."""
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

    ``alpha`` is the one that runs (``autoplan.resolve`` decides it: 1 when norm clipping or fp16 defer
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
