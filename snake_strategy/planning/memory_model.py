"""The one memory model: how many bytes each state and buffer takes on the host and on the SSD.

Pure functions of plain data. Three users read the same numbers from here:

- the engines' host-budget and SSD free-space checks (``RunPlan.check_host_budget``, ``engine/training.py``,
  ``engine/evaluation.py``: evaluation's items are ``host_plan`` of ``MemoryInputs.evaluating``),
- the planner's choice of placement (``placement.plan``),
- the activation store's placement of checkpoints (``checkpoint_tiers``).

On a CPU "device", device shares live in host memory too, so they count against the host budget.
Every in-flight buffer the engine allocates comes from a bounded pool whose size is set here
(``PoolSizes``): the budget covers them, and when a pool is empty the producer waits (backpressure)
instead of allocating more. docs/design.md, "Memory model", explains each item.

On a CUDA device the host shares of every tiered state, the in-memory activation checkpoints and the
staging buffers are *pinned* (page-locked, the only memory that crosses PCIe asynchronously), and a
pinned allocation takes more than it asks for (``storage.aligned.pinned_allocation_bytes``: the next
power of two). Those items are counted here at their real, rounded size, allocation by allocation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from snake_strategy.config import StorageConfig, TierShares
from snake_strategy.storage.aligned import aligned_allocation_bytes, pinned_allocation_bytes, round_up
from snake_strategy.storage.tiered import tier_bounds

# Elements per alignment unit of the SSD tier (4 KiB pages of fp32/bf16/fp64 all divide it).
ALIGN_ELEMS = 4096
# Autograd's saved tensors and transient gradients inside one block's backward, in multiples of the
# block's input (one checkpoint). A GPT-2 block saves ~14 hidden-sized tensors (LayerNorm outputs,
# q/k/v, attention output, the 4x-wide MLP pair) and builds about as many transient gradients.
WORKSPACE_CHECKPOINTS_PER_BLOCK = 24
# What the budget cannot see and the engine does not allocate: allocator fragmentation, glibc arenas
# of the worker threads, Lightning's per-step objects. Peak RSS <= baseline at setup + plan + this
# (tests/planning/test_memory_model.py measures it).
RSS_SLACK_BYTES = 96 * 2**20
# Of the host budget, the share kept graphs leave unfilled: with the budget full, that slack grows with the
# run. Measured at gpt_4b in a 16 GiB container: peak RSS 0.15 GiB (1.1% of the plan) above baseline + plan
# (docs/dev/LOG.md, issue 35). Under a budget derived from the machine, kept graphs also leave the process's
# baseline out (``unplanned_room_bytes``), so filling it never takes the process's peak above it.
UNPLANNED_SHARE = 0.02
# The loss head's in-step tensors, in multiples of its output (the logits of the micro-batches one task
# runs): the logits, the log-probabilities and their gradient. Measured: fp32 cross-entropy over 512 x
# 50257 logits, split in micro-batches as the engine computes it, holds 1.1-1.35 logits above the head's weight
# gradient at its peak (glibc made to return every freed block), 1.55 in situ at r1 (docs/dev/LOG.md, issue
# 35). The head runs before the blocks' backward in the last unit's task, so this and the blocks' workspace
# are one item: the larger of the two.
LOSS_HEAD_LOGITS_COPIES = 2
# Pinned staging buffers of the weight streamer on CUDA, each the largest unit's SSD share: one is
# filled from the SSD while the other's bytes cross PCIe.
WEIGHT_STAGING_BUFFERS = 2


def unplanned_room_bytes(budget_bytes: int, budget_given: bool, baseline_bytes: int, planned_bytes: int) -> int | None:
    """What a host budget leaves for optional holdings (kept graphs) once ``planned_bytes`` are placed, less
    ``UNPLANNED_SHARE`` of it; None when there is no budget. A budget derived from the machine (MemAvailable,
    the cgroup) also leaves out ``baseline_bytes``, what the process held at setup: it is the machine's share
    the run reports, and an optional speed-up must not take the process above it. A given budget is what the
    run may fill above that baseline. The engine's first step and the prediction before it both ask here."""
    if not budget_bytes:
        return None
    room = int(budget_bytes * (1 - UNPLANNED_SHARE))
    if not budget_given:
        room -= baseline_bytes
    return room - planned_bytes


# Partitioned optimizer state (engine/parallel/partition.py): shards are whole pages of every dtype up to 1 byte.
SHARD_ALIGN_ELEMS = 4096


def shard_size(train_end: int, world_size: int) -> int:
    """Elements per shard of a unit with ``train_end`` trainable elements (the padded length every rank
    contributes to a collective)."""
    if train_end == 0:
        return 0
    per = -(-train_end // world_size)
    return -(-per // SHARD_ALIGN_ELEMS) * SHARD_ALIGN_ELEMS


def shard_bounds(train_end: int, world_size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of ``rank``'s shard of a unit with ``train_end`` trainable elements (may be empty: the last
    ranks' shards of a small unit)."""
    per = shard_size(train_end, world_size)
    lo = min(rank * per, train_end)
    return lo, min(lo + per, train_end)


@dataclass(frozen=True)
class PoolSizes:
    """How many buffers each bounded pool holds (the in-flight limit of its producer)."""

    weight_buffers: int  # resident unit + prefetched units
    grad_buffers: int  # one filling, the rest waiting for / inside the optimizer worker
    checkpoint_staging: int  # SSD checkpoint writes in flight


@dataclass(frozen=True)
class MemoryInputs:
    """What the model and the run look like, as far as memory is concerned."""

    unit_params: tuple[int, ...]  # parameters per unit
    nonlayer_params: int  # trainable ones (with master, moments, gradient)
    compute_bytes: int  # per compute weight
    master_bytes: int  # per master weight / moment / gradient element
    device_is_cpu: bool
    storage: StorageConfig
    kind: str = "vertical"
    num_micro: int = 1
    alpha: float = 0.0  # the effective forward share (1.0 when whole units are deferred)
    prefetch_depth: int = 1
    blocks_per_unit: int = 1
    micro_per_backward_task: int = 1  # all of them when the backward is batched
    checkpoint_bytes: int = 0  # one unit input of one micro-batch; 0 while unknown
    # The loss head's output (fp32 logits) over the micro-batches one backward task runs; 0 while unknown
    # (the first step measures it).
    loss_logits_bytes: int = 0
    # The largest trainable non-layer parameter (the transient gradient of one non-layer backward); 0: take
    # all of nonlayer_params.
    nonlayer_largest: int = 0
    # Frozen parameters exist as compute weights only. Per unit, the elements that have a master copy,
    # moments and gradients (the trainable part, page-padded); empty: every element is trainable.
    unit_trainable: tuple[int, ...] = ()
    nonlayer_frozen: int = 0  # frozen embedding/head parameters: the compute copy only
    # Half-precision weight storage (mixed precision, engine/state/half_weights.py): per unit, the elements of
    # the stored weight vector, of ``weight_bytes`` each (frozen parts count two), and the bytes of the
    # full-precision tail kept in memory. Empty / 0: unit_params elements of compute_bytes, no tail.
    unit_weight_elems: tuple[int, ...] = ()
    weight_bytes: int = 0
    unit_weight_tail_bytes: tuple[int, ...] = ()
    # Partitioned optimizer state: this process is rank ``shard_rank`` of ``shard_world_size`` and keeps the
    # moments of its shard of every unit only (the plan is per rank). 1: the moments are whole.
    shard_world_size: int = 1
    shard_rank: int = 0
    # The speculative optimizer step (engine/optimizer/rollback.py): each unit's backward part keeps its raw
    # gradient and the in-memory part of its pre-step master weights and moments, on the tier
    # ``storage.rollback`` says; their SSD part stays in the previous versions of the files.
    speculative: bool = False
    # Evaluation (engine/evaluation.py): only the compute weights are stored and streamed read-only; no
    # master copy, moments, gradients, optimizer worker or activation checkpoints.
    evaluating: bool = False
    # The optimizer's state per trainable element, in master-dtype elements (optimizers/spec.py): 2 for
    # Adam's moments, 1 for SGD's momentum, about 0.5 for 8-bit AdamW (the rollback's estimate).
    state_vectors: float = 2.0
    # The state's slots as the engine allocates them (``ModelShape.state_slots``): per slot (bytes per element,
    # per-unit lengths or empty for the unit's (shard of) trainable elements, worker scratch elements or 0 for
    # a chunk). Empty: ``state_vectors`` slots of the master dtype (a model on paper).
    state_slots: tuple[tuple[int, tuple[int, ...], int], ...] = ()
    optimizer_chunk: int = 0  # the worker's master/gradient chunk when it is whole tensors; 0: the formula
    nonlayer_state_bytes: int = -1  # the non-layer parameters' optimizer state; -1: 2 moments of the master dtype

    @property
    def trainable(self) -> tuple[int, ...]:
        return self.unit_trainable or self.unit_params

    def slots(self) -> list[tuple[int, tuple[int, ...], int]]:
        """Per slot of the optimizer's state: (bytes per element, per-unit lengths on this rank, scratch elements
        of the worker)."""
        chunk = self.chunk_elems
        if not self.state_slots:
            vectors = self.state_vectors
            if vectors == int(vectors):
                return [(self.master_bytes, self.moment_elems, chunk)] * int(vectors)
            return [(math.ceil(vectors * self.master_bytes), self.moment_elems, chunk)]
        return [(size, numels or self.moment_elems, scratch or chunk) for size, numels, scratch in self.state_slots]

    @property
    def chunk_elems(self) -> int:
        """The optimizer worker's chunk of master weights and gradient (it steps this rank's range)."""
        return self.optimizer_chunk or min(max(self.moment_elems), self.storage.optimizer_chunk_elems)

    @property
    def nonlayer_state(self) -> int:
        """Bytes of the non-layer parameters' optimizer state."""
        return self.nonlayer_state_bytes if self.nonlayer_state_bytes >= 0 else 2 * self.nonlayer_params * self.master_bytes

    @property
    def total_trainable(self) -> int:
        return sum(self.trainable)

    @property
    def max_trainable(self) -> int:
        return max(self.trainable)

    @property
    def moment_elems(self) -> tuple[int, ...]:
        """Per unit, the elements of this rank's Adam moments (its shard, or every trainable element)."""
        if self.shard_world_size == 1:
            return self.trainable
        return tuple(hi - lo for lo, hi in (shard_bounds(t, self.shard_world_size, self.shard_rank)
                                            for t in self.trainable))

    @property
    def e_w(self) -> int:
        """Bytes per element of the stored block weights."""
        return self.weight_bytes or self.compute_bytes

    @property
    def weight_elems(self) -> tuple[int, ...]:
        return self.unit_weight_elems or self.unit_params

    @property
    def weight_tail_bytes(self) -> tuple[int, ...]:
        return self.unit_weight_tail_bytes or (0,) * len(self.unit_params)

    @property
    def weight_buffer_bytes(self) -> int:
        """One working buffer of unit weights: the largest stored vector (+ its tail, 64-byte aligned)."""
        return max(round_up(n * self.e_w, 64) + tail if tail else n * self.e_w
                   for n, tail in zip(self.weight_elems, self.weight_tail_bytes))

    @property
    def separate_master(self) -> bool:
        return self.e_w != self.master_bytes


def pool_sizes(inputs: MemoryInputs) -> PoolSizes:
    # Two gradient buffers: the backward fills one while the worker steps the other. A third would only
    # help when the optimizer is briefly slower than one unit's backward; it costs a unit of memory.
    staging = 2 if checkpoint_tiers(inputs.storage, inputs.num_micro).count("ssd") else 0
    return PoolSizes(weight_buffers=1 + inputs.prefetch_depth, grad_buffers=2, checkpoint_staging=staging)


def forward_part_end(numel: int, alpha: float) -> int:
    """The page-aligned end of a unit's forward part (all of it for alpha >= 1: whole-unit deferral)."""
    if alpha >= 1.0:
        return numel
    end = round(alpha * numel / ALIGN_ELEMS) * ALIGN_ELEMS
    return max(0, min(end, numel))


def checkpoint_tiers(storage: StorageConfig, num_micro: int) -> list[str]:
    """The tier of each micro-batch's activation checkpoints (the same for every unit).

    The first and last ``checkpoint_host_ends`` micro-batches are the snake's turning points: the next
    task needs them at once, so they stay in memory. The SSD share is taken from the end of the middle
    ones, the device share from its start.
    """
    split: TierShares = storage.checkpoints
    ends = storage.checkpoint_host_ends
    middle = [m for m in range(num_micro) if ends <= m < num_micro - ends]
    num_ssd = min(len(middle), round(split.ssd * num_micro))
    num_device = min(len(middle) - num_ssd, round(split.device * num_micro))
    tiers = ["host"] * num_micro
    for m in middle[:num_device]:
        tiers[m] = "device"
    for m in middle[len(middle) - num_ssd:] if num_ssd else []:
        tiers[m] = "ssd"
    return tiers


def stored_gradient_elems(inputs: MemoryInputs) -> int:
    """Elements the gradient store holds: horizontal parks whole partial sums; vertical only each unit's
    forward part (nothing at alpha 0)."""
    if inputs.kind == "horizontal":
        return inputs.total_trainable
    return sum(forward_part_end(n, inputs.alpha) for n in inputs.trainable)




def unit_rollback_elems(trainable: int, numel: int, alpha: float, storage: StorageConfig, separate_master: bool,
                        world_size: int = 1, rank: int = 0, state_vectors: float = 2.0) -> tuple[int, int, int]:
    """One unit's rollback state, in elements: (the backward part [max(split, lo), hi) it covers, the
    elements copied every speculative step onto ``storage.rollback``, the SSD elements held). Copied: the
    raw gradient and the in-memory (device and host) part of the pre-step master weights and moments,
    updated in place by the step. Held: their SSD part stays in the previous version of each file, no copy
    and no write; each such file has a second one of its size to alternate with (storage/versions.py,
    "Spares"), the disk cost counted here. ``numel``: the unit's elements, frozen ones included."""
    lo, hi = shard_bounds(trainable, world_size, rank)
    start = min(max(forward_part_end(trainable, alpha), lo), hi)
    copied, held = hi - start, 0
    # The master copy spans the unit (unit indices; the compute weights themselves, frozen elements too,
    # unless it is separate); the moments span this rank's shard [lo, hi).
    master = (storage.master, trainable) if separate_master else (storage.weights, numel)
    for split, size, base, weight in (master + (0, 1.0), (storage.optimizer, hi - lo, lo, state_vectors)):
        host_end = tier_bounds(size, split)[1]
        memory_end = max(start, min(hi, base + host_end))
        copied += weight * (memory_end - start)
        if hi > memory_end:  # held: the whole SSD file gets a second one to alternate with
            held += weight * (size - host_end)
    return hi - start, int(copied), int(held)


def _unit_rollbacks(inputs: MemoryInputs) -> list[tuple[int, int, int]]:
    return [unit_rollback_elems(t, n, inputs.alpha, inputs.storage, inputs.separate_master, inputs.shard_world_size,
                                inputs.shard_rank, inputs.state_vectors) for t, n in zip(inputs.trainable, inputs.unit_params)
            ] if inputs.speculative else []


def rollback_copied_elems(inputs: MemoryInputs) -> tuple[int, ...]:
    """Per unit, the elements the rollback store copies every speculative step (``unit_rollback_elems``)."""
    return tuple(copied for _, copied, _ in _unit_rollbacks(inputs))


def rollback_held_bytes(inputs: MemoryInputs) -> int:
    """SSD bytes of the state files' second versions under rollback holds (page-rounded per unit, as files
    are): disk space only, nothing is written for them besides what the steps write."""
    return sum(round_up(held * inputs.master_bytes) for _, _, held in _unit_rollbacks(inputs))


def _in_memory(split: TierShares, device_is_cpu: bool) -> float:
    return split.host + (split.device if device_is_cpu else 0.0)


def pinned_host_shares(unit_params: tuple[int, ...], split: TierShares, elem_bytes: int) -> int:
    """Pinned bytes of one tiered state's host shares on CUDA: each unit's host segment is one pinned
    allocation (``TieredTensor``), rounded as the pinned allocator rounds it."""
    total = 0
    for n in unit_params:
        device_end, host_end = tier_bounds(n, split)
        total += aligned_allocation_bytes(host_end - device_end, elem_bytes, pin_memory=True)
    return total


def weight_staging_elems(unit_params: tuple[int, ...], split: TierShares) -> int:
    """Elements of one pinned weight-staging buffer: the largest SSD share of a unit's weights."""
    return max((n - tier_bounds(n, split)[1] for n in unit_params), default=0)


def host_plan(inputs: MemoryInputs) -> dict[str, int]:
    """Host bytes of the run, item by item (``checkpoint*`` items only once checkpoint_bytes is known)."""
    if inputs.evaluating:
        return _eval_host_plan(inputs)
    plan = _host_plan(inputs)
    if not inputs.device_is_cpu:
        plan.update(_pinned_items(inputs))
    return plan


def _pinned_items(inputs: MemoryInputs) -> dict[str, int]:
    """The CUDA device's host items: pinned allocations at their real size (they replace the nominal
    sizes of ``_host_plan``, which on CUDA are what the items would take if pageable)."""
    s, units, e_m = inputs.storage, inputs.unit_params, inputs.master_bytes
    tails = [t for t in inputs.weight_tail_bytes if t] if s.weights.device < 1.0 else []
    items = {
        "weights": (pinned_host_shares(inputs.weight_elems, s.weights, inputs.e_w)
                    + sum(pinned_allocation_bytes(round_up(t)) for t in tails)),
        "optimizer_moments": sum(pinned_host_shares(numels, s.optimizer, size) for size, numels, _ in inputs.slots()),
        # the gradient store's host segment is allocated for the whole unit share, pinned
        "gradients": pinned_host_shares(units, s.gradients, e_m),
    }
    if inputs.separate_master:
        items["master"] = pinned_host_shares(units, s.master, e_m)
    if inputs.speculative and s.rollback != "ssd":
        items["rollback_state"] = pinned_host_shares(rollback_copied_elems(inputs), TierShares(), e_m)
    staging = weight_staging_elems(inputs.weight_elems, s.weights)
    if staging:
        items["weight_staging"] = WEIGHT_STAGING_BUFFERS * aligned_allocation_bytes(staging, inputs.e_w,
                                                                                      pin_memory=True)
    if inputs.checkpoint_bytes:
        ckpt = pinned_allocation_bytes(round_up(inputs.checkpoint_bytes))  # one pinned buffer each
        tiers = checkpoint_tiers(s, inputs.num_micro)
        items["checkpoints"] = tiers.count("host") * len(units) * ckpt
        ckpt_staging = pool_sizes(inputs).checkpoint_staging
        if ckpt_staging:
            items["checkpoint_io_buffers"] = (ckpt_staging + inputs.micro_per_backward_task) * ckpt
    return items


def _eval_host_plan(inputs: MemoryInputs) -> dict[str, int]:
    """Evaluation's host items: the weights' in-memory share, the streaming buffers (resident unit +
    prefetched ones) and the non-layer parameters, all in the compute dtype. Activations are not counted
    (one micro-batch's, freed unit by unit). Pageable on every device: evaluation pins nothing."""
    w, e_w = inputs.storage.weights, inputs.e_w
    return {"weights": int(sum(inputs.weight_elems) * e_w * _in_memory(w, inputs.device_is_cpu)),
            "weight_buffers": 0 if w.device == 1.0 else pool_sizes(inputs).weight_buffers * inputs.weight_buffer_bytes,
            "nonlayer_params": (inputs.nonlayer_params + inputs.nonlayer_frozen) * inputs.compute_bytes}


def _host_plan(inputs: MemoryInputs) -> dict[str, int]:
    s, cpu = inputs.storage, inputs.device_is_cpu
    e_c, e_m = inputs.compute_bytes, inputs.master_bytes
    trained, unit_trained = inputs.total_trainable, inputs.max_trainable
    pools = pool_sizes(inputs)
    chunk = inputs.chunk_elems
    slots = inputs.slots()
    weights_in_place = s.weights.device == 1.0  # fully device-resident weights are used in place
    e_w = inputs.e_w
    # the fp32 tail of half-precision storage is always in memory (host, or the device when weights are)
    tail_in_memory = sum(inputs.weight_tail_bytes) if cpu or s.weights.device < 1.0 else 0
    # one non-layer backward at a time (the head's in the last unit's task, the embedding's in the first's)
    nonlayer_transient = inputs.nonlayer_largest or inputs.nonlayer_params
    plan = {
        "weights": int(sum(inputs.weight_elems) * e_w * _in_memory(s.weights, cpu)) + tail_in_memory,
        "optimizer_moments": sum(int(sum(numels) * size * _in_memory(s.optimizer, cpu)) for size, numels, _ in slots),
        "gradients": int(stored_gradient_elems(inputs) * e_m * _in_memory(s.gradients, cpu)),
        # compute copy, master (when separate), optimizer state, gradient, and the transient gradient of the
        # one non-layer backward running (the non-layer master is separate only when the compute dtype
        # differs: bf16-true)
        "nonlayer_params_and_state": (inputs.nonlayer_params * (e_c + e_m + (e_m if e_c != e_m else 0))
                                      + inputs.nonlayer_state + nonlayer_transient * e_m
                                      + inputs.nonlayer_frozen * e_c),
        "weight_buffers": 0 if weights_in_place else pools.weight_buffers * inputs.weight_buffer_bytes,
        # + the horizontal schedule's partial sum, read back to be added (one unit, transient)
        "gradient_buffers": (pools.grad_buffers + (inputs.kind == "horizontal")) * unit_trained * e_m,
        # a unit's weight gradients as autograd returns them (one tensor per leaf, the weights' dtype), alive
        # until they are added into a gradient buffer: 0.8 GB a Llama-2-7B layer (on the device when it computes)
        "weight_gradients": unit_trained * e_w if cpu else 0,
        # the worker's chunk of master weights, each slot's piece of it, the parked gradient (+ the refreshed
        # compute copy)
        "optimizer_scratch": (2 * chunk * e_m + sum(scratch * size for size, _, scratch in slots)
                              + (chunk * e_w if inputs.separate_master else 0)),
    }
    if inputs.separate_master:
        plan["master"] = int(trained * e_m * _in_memory(s.master, cpu))
    if inputs.speculative and s.rollback != "ssd":
        plan["rollback_state"] = sum(rollback_copied_elems(inputs)) * e_m
    if inputs.shard_world_size > 1 and cpu:
        world = inputs.shard_world_size
        plan["partition_buffers"] = partition_host_bytes(max(shard_size(t, world) for t in inputs.trainable) * world,
                                                         world, e_c, e_m, cpu)
        # the gradient buffers hold the unit padded to N equal shards for the reduce-scatter
        plan["gradient_buffers"] += (pools.grad_buffers * e_m
                                     * (max(shard_size(t, world) for t in inputs.trainable) * world - unit_trained))
    if inputs.checkpoint_bytes:
        ckpt = inputs.checkpoint_bytes
        tiers = checkpoint_tiers(s, inputs.num_micro)
        in_memory = sum(1 for t in tiers if t == "host" or (t == "device" and cpu))
        num_units = len(inputs.unit_params)
        plan["checkpoints"] = in_memory * num_units * ckpt
        plan["activation_grads"] = inputs.num_micro * ckpt
        if pools.checkpoint_staging:
            # staging of writes in flight + the reads of the next task
            plan["checkpoint_io_buffers"] = (pools.checkpoint_staging + inputs.micro_per_backward_task) * round_up(ckpt)
        # the blocks' backward, or the loss head's tensors before it in the last unit's task
        plan["compute_workspace"] = max(WORKSPACE_CHECKPOINTS_PER_BLOCK * inputs.blocks_per_unit
                                        * inputs.micro_per_backward_task * ckpt,
                                        LOSS_HEAD_LOGITS_COPIES * inputs.loss_logits_bytes)
    return plan


def ssd_plan(inputs: MemoryInputs) -> dict[str, int]:
    """SSD bytes of the run, item by item (files are page-rounded per unit)."""
    s, e_m = inputs.storage, inputs.master_bytes

    def per_unit(fraction: float, elem_bytes: int, numels) -> int:
        return sum(round_up(int(n * fraction) * elem_bytes) for n in numels) if fraction else 0

    if inputs.evaluating:  # the weights are all that evaluation stores
        return {"weights": per_unit(s.weights.ssd, inputs.e_w, inputs.weight_elems)}

    units, trained = inputs.unit_params, inputs.trainable  # frozen elements: weights only
    plan = {
        "weights": per_unit(s.weights.ssd, inputs.e_w, inputs.weight_elems),
        "optimizer_moments": sum(per_unit(s.optimizer.ssd, size, numels) for size, numels, _ in inputs.slots()),
        "gradients": int(stored_gradient_elems(inputs) * e_m * s.gradients.ssd),
    }
    if inputs.separate_master:
        plan["master"] = per_unit(s.master.ssd, e_m, trained)
    if inputs.speculative and s.rollback == "ssd":
        plan["rollback_state"] = per_unit(1.0, e_m, rollback_copied_elems(inputs))
    if rollback_held_bytes(inputs):
        plan["rollback_versions"] = rollback_held_bytes(inputs)
    if inputs.checkpoint_bytes:
        num_ssd = checkpoint_tiers(s, inputs.num_micro).count("ssd")
        plan["checkpoints"] = num_ssd * len(units) * round_up(inputs.checkpoint_bytes)
    return plan


def partition_host_bytes(max_padded_unit: int, world_size: int, compute_bytes: int, master_bytes: int,
                         device_is_cpu: bool) -> int:
    """Host buffers of partitioned optimizer state (engine/parallel/partition.py) besides the pools: the worker's
    weight gather (its shard and the whole padded unit, compute dtype, transient) and the reduce-scatter
    outputs (one shard each, master dtype; at most 2 in flight, one per gradient buffer). The moments
    themselves are planned per rank (``MemoryInputs.moment_elems``)."""
    if not device_is_cpu:
        return 0  # device buffers
    shard = max_padded_unit // world_size
    return (shard + max_padded_unit) * compute_bytes + 2 * shard * master_bytes


def format_plan(plan: dict[str, int]) -> str:
    """``"weights 1.20 GiB, ..."``, largest first."""
    return ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sorted(plan.items(), key=lambda kv: -kv[1]))
