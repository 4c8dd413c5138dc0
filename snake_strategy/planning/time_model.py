"""The time model: one step's time from the model's shape, the placement and the machine's rates, and the
tokens per step at which it turns compute-bound (``knee``). Pure functions of plain data, so every number can
be checked by hand; the rates come from the machine's probe (planning/machine.py) or from the steps
themselves (planning/calibration.py).

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

By phase (docs/design.md, "Traffic model"): the forward pass and the rest each take at least their own
busiest resource, so the floor is also at least the two phases' sum (``predict``).

The knee: the tokens per step from which compute outlasts every other resource. Below it the step waits on
the SSD (or the optimizer) and more micro-batches cost little; above it every micro-batch adds its compute.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from torch import nn

from snake_strategy.config import StorageConfig, TierShares
from snake_strategy.planning.memory_model import checkpoint_tiers, forward_part_end, shard_bounds, unit_rollback_elems
from snake_strategy.storage.tiered import tier_bytes
from snake_strategy.units import UnitLayout, nonlayer_numel


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


def unit_forward_flops(shape: ModelShape) -> float:
    """FLOPs of one unit's forward over one micro-batch: 2 per parameter per token, and its attention."""
    return (2 * shape.params_per_unit + shape.attention_flops_per_token_per_unit) * shape.tokens_per_micro


def step_flops_split(shape: ModelShape) -> tuple[float, float]:
    """(forward FLOPs, backward FLOPs) of one optimizer step: 2 per parameter per token forward (recompute
    included), 4 backward.

    A unit's backward is its input gradient (one forward's worth) plus its weight gradient (one forward's
    worth times its trainable share); units below ``backward_from`` only run forward, and the lowest
    unit with a backward needs no input gradient when it is above unit 0."""
    fwd_unit = unit_forward_flops(shape)
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


COMPUTE_BOUNDS = ("compute", "cpu")


@dataclass
class _Phase:
    """What one phase of a step (the forward pass, or the turn and the backward) asks of each resource."""

    compute_s: float = 0.0
    read: float = 0.0  # SSD bytes
    write: float = 0.0
    host_bytes: float = 0.0  # copied between the tiers in memory
    optimizer_params: float = 0.0

    def add_moved(self, read: float, write: float, host: float) -> None:
        self.read, self.write, self.host_bytes = self.read + read, self.write + write, self.host_bytes + host

    def seconds(self, hw: HardwareProfile) -> dict[str, float]:
        """Each resource's busy time in this phase; on a CPU machine also ``cpu``: the compute, the optimizer,
        the copies and the SSD's processor time, which share the cores (not added again to rates measured in a
        step, where they already shared them)."""
        busy = {"compute": self.compute_s,
                "ssd": self.read / (hw.ssd_read_gb_per_s * 1e9) + self.write / (hw.ssd_write_gb_per_s * 1e9),
                "host_copy": self.host_bytes / (hw.host_copy_gb_per_s * 1e9),
                "optimizer": self.optimizer_params / hw.optimizer_params_per_s}
        if hw.device_is_cpu and not hw.measured_in_step:
            busy["cpu"] = (busy["compute"] + busy["optimizer"] + busy["host_copy"]
                           + (self.read + self.write) / 1e9 * hw.ssd_cpu_s_per_gb)
        return busy


def predict(shape: ModelShape, hw: HardwareProfile, storage: StorageConfig, kind: str, alpha: float,
            speculative: bool = False, deferring: bool = False) -> StepPrediction:
    """Predicted floor of one step's time for this placement and schedule (``speculative``: a committed
    speculative step, which also writes its rollback state; a rollback's redo is not in the floor;
    ``deferring``: with ``speculative``, a step that follows a clipped one, which saves its backward part's
    raw gradient in the rollback store and applies every whole update at the next forward).

    The bytes are exact: the same tier boundaries and page rounding as the engine's transfers
    (``storage.tiered.tier_bytes``), so they equal the engine's counters for a steady-state step.

    Phases: the forward pass (units below the last) and the rest (the turn, the recomputes and backwards) each
    take at least their busiest resource's work, and no work crosses from one to the other: a unit's
    forward needs its update (the forward part's, or the whole update of a deferring step), which needs
    the previous backward's gradient. The floor is the larger of the whole step's busiest resource and the
    two phases' sum; the second is larger only when one phase waits on a resource the other leaves idle
    (a deferring step's whole optimizer traffic against the forward's compute alone).
    """
    u, L, M = shape.params_per_unit, shape.num_units, shape.num_micro
    e_w, e_m = shape.weight_bytes, shape.master_bytes
    separate_master = e_w != e_m
    states = shape.state_bytes / e_m  # the optimizer's state in master-dtype elements (2 for Adam's moments)
    fetches = weight_fetches_per_step(kind, L, M, shape.backward_from)
    # the forward pass fetches the units below the last (vertical; the horizontal order in that proportion)
    forward_fetches = round(fetches * (L - 1) / max(1, 2 * L - 1 - shape.backward_from))
    fwd, bwd = _Phase(), _Phase()
    weights = tier_bytes(shape.weight_elems_per_unit or u, storage.weights, e_w)
    # the tail: read by every fetch, rewritten by every step, kept in host memory (or on the device)
    tail = shape.weight_tail_bytes_per_unit if storage.weights.device < 1.0 else 0
    for phase, count in ((fwd, forward_fetches), (bwd, fetches - forward_fetches)):
        phase.add_moved(count * weights["ssd"], 0, count * (weights["host"] + tail))
    partials = M - 1 if kind == "horizontal" else 0
    rollback_split = TierShares(host=0.0, ssd=1.0) if storage.rollback == "ssd" else TierShares()
    # Only a unit's trainable part [0, t) has a master copy, moments and gradients; frozen weights are read
    # by the fetches above and never written.
    for t in shape.trainable:
        master = tier_bytes(t, storage.master, e_m) if separate_master else tier_bytes(u, storage.weights, e_m, 0, t)
        moments = tier_bytes(t, storage.optimizer, e_m)
        forward_end = forward_part_end(t, alpha)
        grad_part = tier_bytes(t, storage.gradients, e_m, 0, forward_end)  # parked forward part
        grad_full = tier_bytes(t, storage.gradients, e_m)  # a horizontal partial sum
        # The optimizer reads and writes the master and its state once; bf16-true refreshes the compute copy.
        state_ssd = master["ssd"] + states * moments["ssd"]
        state_host = 2 * master["host"] + 2 * states * moments["host"]
        refresh_ssd = refresh_host = 0
        if separate_master:
            refresh = tier_bytes(shape.weight_elems_per_unit or u, storage.weights, e_w, 0, t)
            refresh_ssd, refresh_host = refresh["ssd"], refresh["host"] + tail
        # The update's share that runs in the next forward: the forward part, or all of a deferring step.
        in_forward = 1.0 if deferring or t == 0 else forward_end / t
        for phase, share in ((fwd, in_forward), (bwd, 1 - in_forward)):
            phase.add_moved(share * state_ssd, share * (state_ssd + refresh_ssd), share * (state_host + refresh_host))
            phase.optimizer_params += share * t
        # the parked forward part: written by the backward, read back by the next forward's update
        fwd.add_moved(grad_part["ssd"], 0, 0)
        bwd.add_moved(partials * grad_full["ssd"], grad_part["ssd"] + partials * grad_full["ssd"], 0)
        if speculative and deferring:  # the backward part's raw gradient, saved by the backward, read by the forward
            saved = tier_bytes(t - forward_end, rollback_split, e_m)
            bwd.add_moved(0, saved["ssd"], saved["host"])
            fwd.add_moved(saved["ssd"], 0, saved["host"])
        elif speculative:  # the rollback copies (gradient + in-memory states); the states' SSD part is held
            _, copied, _ = unit_rollback_elems(t, u, alpha, storage, separate_master, shape.optimizer_shards, 0,
                                               states)
            rollback = tier_bytes(copied, rollback_split, e_m)
            bwd.add_moved(0, rollback["ssd"], rollback["host"])
    if L > 1:
        # Each SSD checkpoint (a unit's input) is written once, by the forward, and read by the unit's forward
        # and by its recompute; the last unit's input only once (its backward is fused with its forward), and
        # units without a backward (below backward_from) or with a kept graph are not recomputed.
        ckpt_ssd = checkpoint_tiers(storage, M).count("ssd") * shape.checkpoint_bytes
        reads = 2 * L - 1 - shape.backward_from - shape.kept_units
        fwd.add_moved(min(L - 1, reads) * ckpt_ssd, L * ckpt_ssd, 0)
        bwd.add_moved(max(0, reads - (L - 1)) * ckpt_ssd, 0, 0)
    compute_s = compute_seconds(shape, hw)
    # The forward pass of the units below the last, at the forward's rate (the turn, the head and the
    # non-layer work are counted with the backward).
    fwd.compute_s = min(compute_s, M * unit_forward_flops(shape) * max(0, L - 1) / hw.flops_per_s)
    bwd.compute_s = compute_s - fwd.compute_s
    bwd.optimizer_params += shape.nonlayer_params
    phases = [phase.seconds(hw) for phase in (fwd, bwd)]
    bounds = {resource: phases[0][resource] + phases[1][resource] for resource in phases[0]}  # the whole step's
    bound = max(bounds, key=bounds.get)
    roofline_s = bounds[bound]
    phased_s = sum(max(busy.values()) for busy in phases)
    if phased_s > roofline_s * (1 + 1e-9):
        # the resource a phase waits on beyond its compute: the phase that waits longest names it
        def waiting(busy: dict[str, float]) -> tuple[float, str]:
            own = max(busy[b] for b in COMPUTE_BOUNDS if b in busy)
            worst = max(busy, key=busy.get)
            return max(busy.values()) - own, worst

        _, bound = max(waiting(busy) for busy in phases)
        roofline_s = phased_s
    read, write = fwd.read + bwd.read, fwd.write + bwd.write
    return StepPrediction(bounds["compute"], bounds["ssd"], bounds["host_copy"], bounds["optimizer"], roofline_s, bound,
                          round(read), round(write))


# The knee is searched up to this many micro-batches per step.
KNEE_MAX_MICRO = 4096


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
         speculative: bool = False, deferring: bool = False) -> Knee:
    """The smallest tokens per step (more micro-batches of this run's size) at which the predicted bound is
    compute, for this placement and schedule (``predict`` at each count)."""
    tokens_per_micro = shape.tokens_per_micro
    here = predict(shape, hw, storage, kind, alpha, speculative, deferring)
    below = predict(dataclasses.replace(shape, num_micro=1), hw, storage, kind, alpha, speculative, deferring)
    run_tokens = shape.num_micro * tokens_per_micro
    waiting = 0.0 if here.bound in COMPUTE_BOUNDS else 1.0 - here.compute_s / here.roofline_s
    if below.bound in COMPUTE_BOUNDS:
        return Knee(tokens_per_micro, below.bound, run_tokens, waiting)
    lo, hi = 1, KNEE_MAX_MICRO  # bisect: compute grows with micro-batches faster than any other term
    if predict(dataclasses.replace(shape, num_micro=hi), hw, storage, kind, alpha, speculative, deferring).bound \
            not in COMPUTE_BOUNDS:
        return Knee(None, below.bound, run_tokens, waiting)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        bound = predict(dataclasses.replace(shape, num_micro=mid), hw, storage, kind, alpha, speculative,
                        deferring).bound
        lo, hi = (lo, mid) if bound in COMPUTE_BOUNDS else (mid, hi)
    return Knee(hi * tokens_per_micro, below.bound, run_tokens, waiting)
