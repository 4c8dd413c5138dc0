"""The training engine: the step over the offloaded state, and the state API checkpoints read.

``SnakeEngine``: the facade the strategy talks to. It owns every offloaded state of the blocks and the
non-layer parameters' optimizer state, and exposes a small API: ``train_step``, ``optimizer_step``,
``flush``, ``forward`` (evaluation), the state API (per unit and non-layer, for checkpoints), the memory
plan, and ``close``. I/O, the resources, the budget and the weights handed back are ``EngineBase``'s
(engine/base.py), shared with the evaluation engine.

Threads (all started here, all joined by ``close``): the main thread computes (``StepRunner``); a
prefetch thread fetches weights ahead (``WeightStreamer``); the optimizer worker steps units
(``OptimizerOverlap``); the I/O engine's threads run the SSD transfers. Data flows one way:
runner -> gradients -> overlap -> tiers.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from snake_strategy.activations import ActivationStore
from snake_strategy.contract import (batch_size, check_contract, checkpoint_bytes_from_shapes, head_params,
                                     loss_head_bytes, micro_batch_tokens, slice_batch, split_micro_batches,
                                     unpack_pre_stage)
from snake_strategy.engine.base import EngineBase
from snake_strategy.engine.step.batch_check import batching_tolerance
from snake_strategy.engine.state.build import build_model
from snake_strategy.engine.step.gradients import GradientPath
from snake_strategy.engine.step.kept_graphs import KeptGraphs
from snake_strategy.engine.step.unit_timing import timed_task
from snake_strategy.engine.optimizer.update import ChunkUpdate
from snake_strategy.engine.optimizer.worker import OptimizerOverlap
from snake_strategy.engine.parallel.partition import Partition, shard_range
from snake_strategy.engine.parallel.reduce import GradientReducer
from snake_strategy.engine.optimizer.rollback import RollbackStore, SpeculationPolicy
from snake_strategy.engine.step.runner import StepParts, StepRunner, StepState
from snake_strategy.engine.runtime import EngineRuntime
from snake_strategy.engine.stream.forward_only import stream_blocks, streamed_forward
from snake_strategy.engine.view import StepStats
from snake_strategy.engine.stream.streamer import WeightStreamer
from snake_strategy.planning.machine import SOURCE_GIVEN
from snake_strategy.planning.memory_model import pool_sizes, unplanned_room_bytes
from snake_strategy.optimizers import hyper_params, step_kind
from snake_strategy.planning.run_plan import RunPlan
from snake_strategy.planning.calibration import UnitTiming
from snake_strategy.planning.time_model import ModelShape
from snake_strategy.precision import LossScaler
from snake_strategy.schedule import build_tasks
from snake_strategy.storage.counters import traffic_delta
from snake_strategy.storage.pool import BufferPool
from snake_strategy.storage.tiered import Tiers
from snake_strategy.units import named_tensors


class SnakeEngine(EngineBase):
    """Trains ``module`` with the plan's storage and schedule (``planning.run_plan.resolve``); the engine
    decides none of the plan's settings again. ``EngineView`` (engine/view.py) is what other code may use."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, plan: RunPlan,
                 runtime: EngineRuntime) -> None:
        storage, schedule, clip = plan.storage, plan.schedule, runtime.clip
        if clip is not None and clip[0] not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm='{clip[0]}' is not supported; use 'norm' or 'value'")
        check_contract(module)
        step_kind(optimizer)  # the refusals again for a hand-built plan; the plan's spec says how to step
        if schedule.unset() or storage.unset():
            raise ValueError(f"SnakeEngine runs concrete settings, but schedule {schedule.unset()} and storage "
                             f"{storage.unset()} are left to the planner: resolve them first (snake_strategy.planning."
                             "run_plan.resolve, as GreedySnakeStrategy does) or set them")
        super().__init__(module, plan, runtime)
        self.optimizer, self.clip = optimizer, clip
        self.scaler = runtime.scaler if runtime.scaler is not None else LossScaler(runtime.dtypes.loss_scaling)
        self.alpha = schedule.alpha  # the plan's, as its step mode (run_plan.resolve): not decided again here
        # The plan's step mode, which resolve decided from the same clip and loss scaling this engine runs.
        assert plan.step_mode != "speculative" or self.alpha < 1.0, "a speculative step has backward parts"
        assert plan.step_mode != "deferred" or self.alpha == 1.0, "a deferred step defers whole updates"
        self.speculation = SpeculationPolicy(plan.step_mode, clip, self.scaler)  # engine/optimizer/rollback.py
        world_size, rank = runtime.world_size, runtime.rank
        # Data parallel (world_size > 1, a process group set up): unit gradients summed across ranks.
        self.world_size = world_size
        self.reducer = GradientReducer(world_size, self.counters, self.trace, self.device) if world_size > 1 else None
        # ZeRO-1: this rank keeps 1/N of the moments (engine/parallel/partition.py).
        sharded = runtime.shard_optimizer and world_size > 1
        refusal = plan.optimizer.kind.shard_refusal(plan.optimizer.class_name) if sharded and plan.optimizer else None
        if refusal is not None:
            raise ValueError(refusal)
        self.partition = Partition(world_size, rank, self.counters, self.dtypes, self.device) if sharded else None
        self.checkpoint_bytes = 0  # one unit input of one micro-batch, known after the first forward
        self.logits_bytes = 0  # the loss head's output of one micro-batch, known at the first step
        self.global_batch_size: int | None = None  # samples per full step (set from the loader or batch 1)
        self.runner: StepRunner | None = None  # built last (_build); the kept graphs it measures count in the budget
        self._train_end_snapshot: dict | None = None
        self._nonlayer_sum = None  # the in-flight cross-rank sum of the non-layer gradients
        self._tasks: dict[int, list] = {}
        self._frozen_crc: dict[str, Any] | None = None
        self._backward_planned = False
        try:
            self.open_storage(storage.uses_ssd())
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup
    def _build(self) -> None:
        """The parts in dependency order, each given what it needs; each one holding a resource is owned
        (closed by ``close``) as soon as it exists."""
        s, storage, dtypes, device = self.schedule, self.storage, self.dtypes, self.device
        # The planner laid the model out and checked it (run_plan.setup_layouts); the SSD and host checks
        # need only those sizes, so they run before anything is allocated.
        assert self.plan.layouts and self.plan.shape is not None and not self.plan.evaluating, \
            "a training plan from planning.run_plan.resolve carries the model's layouts and shape"
        self.shape = self.plan.shape  # the one the planner placed the states for
        assert self.shape.optimizer_shards == (self.world_size if self.partition else 1), \
            "the plan was resolved for another partition of the optimizer state"
        self.check_ssd_space("weights, master weights, optimizer moments and gradients")
        self.check_host_budget()
        tiers = Tiers(storage, device, self.counters, self.io, self.ssd)
        partition = self.partition
        built = build_model(self.module, self.optimizer, self.plan, self.runtime, tiers, self.alpha,
                            shard=partition.bounds if partition is not None else None)
        self.blocks_prefix, self.nonlayer = built.blocks_prefix, built.nonlayer
        units = self.units = built.units
        nonlayer = self.nonlayer  # trainable ones by their master values, then the frozen ones as stored
        self.nonlayer_trained = [*zip(nonlayer.names, nonlayer.master), *zip(nonlayer.frozen_names, nonlayer.frozen)]
        self.nonlayer_copies = [(p, master) for p, master in zip(nonlayer.params, nonlayer.master) if p is not master]
        pools = pool_sizes(self.memory_inputs())
        self.activations = ActivationStore(storage, s.num_micro_batches, len(units), pools.checkpoint_staging, device,
                                           self.counters, self.io, self.ssd, trace=self.trace)
        self.own(self.activations, self.activations.clear)
        rollback = RollbackStore(units, storage.rollback, dtypes.master, device, self.counters, self.io, self.ssd) \
            if self.speculation.enabled else None
        # Partitioned: every rank's updated shard of a unit is gathered after its forward part.
        gather = (lambda u: partition.gather_weights(units[u])) if partition is not None else None
        self.update = ChunkUpdate(self.plan.optimizer, self.optimizer)  # the arithmetic of a chunk's step
        self.overlap = self.own(OptimizerOverlap(units, self.update, dtypes.weights, dtypes.master, device,
                                                 storage.optimizer_chunk_elems, self.hooks.before_optimizer_chunk,
                                                 trace=self.trace, rollback=rollback, gather=gather))
        self.weights = self.own(WeightStreamer(units, self.overlap, self.trace, s.prefetch_depth, dtypes.weights,
                                               device))
        # Partitioned: the buffer is padded to N equal shards for the reduce-scatter (< N pages more).
        grad_elems = [partition.padded(t) if partition else t for t in self.shape.trainable]
        self.grad_pool = BufferPool("gradients", pools.grad_buffers, max(grad_elems + [1]), dtypes.master, device,
                                    trace=self.trace)
        self.working_pools = [pool for pool in (self.grad_pool, self.weights.pool) if pool is not None]
        self.gradients = GradientPath(units, self.overlap, self.grad_pool, self.clip, self.scaler, self.reducer,
                                      partition, self.speculation)
        unverified_batching = None
        if s.batched_forward or s.batched_backward:
            declared = getattr(self.module, "independent_samples", False)
            settings = (f"schedule.batched_forward={s.batched_forward}, batched_backward={s.batched_backward}"
                        + (" (the planner's choice: the module declares independent_samples=True)" if declared else ""))
            unverified_batching = (settings, batching_tolerance(dtypes.compute, dtypes.autocast, device))
        parts = StepParts(units, self.nonlayer, self.weights, self.activations, self.gradients,
                          KeptGraphs.for_schedule(s, device), self.trace)
        self.runner = StepRunner(self.module, parts, device, dtypes.autocast, self._free_host_bytes,
                                 unverified_batching)

    def tasks(self, num_micro: int | None = None) -> list:
        """The task list of a step with ``num_micro`` micro-batches (the configured number by default)."""
        num_micro = num_micro or self.schedule.num_micro_batches
        if num_micro not in self._tasks:
            s = self.schedule
            self._tasks[num_micro] = build_tasks(s.kind, len(self.units), num_micro, s.batched_forward,
                                                 s.batched_backward, self.runner.first_backward, s.split_backward)
        return self._tasks[num_micro]

    # ------------------------------------------------------------------ memory plan
    @property
    def shard_rank(self) -> int:
        return self.partition.rank if self.partition is not None else 0

    @property
    def loss_logits_bytes(self) -> int:
        return self.plan.loss_logits_bytes(self.logits_bytes)

    def measured_host_items(self) -> dict[str, int]:
        """The kept graphs, known at the first step."""
        if self.runner is not None and self.runner.kept.planned_bytes:
            return {"kept_graphs": self.runner.kept.planned_bytes}
        return {}

    def _free_host_bytes(self, checkpoint_bytes: int) -> int | None:
        """What the plan's budget leaves once the plan with checkpoints of this size is placed
        (``memory_model.unplanned_room_bytes``): kept graphs fill it."""
        p = self.plan
        return unplanned_room_bytes(p.host_budget_bytes, p.host_budget_source == SOURCE_GIVEN, p.process_baseline_bytes,
                                    sum(self.host_bytes_plan(checkpoint_bytes).values()))

    def model_shape(self, micro_batch: Any, checkpoint_bytes: int = 0) -> ModelShape:
        """The planner's view of this model for the given micro-batch (shapes only, no compute), with the
        checkpoints measured by the first forward, else of ``checkpoint_bytes`` (sized from shapes)."""
        return dataclasses.replace(self.shape, head_params=head_params(self.module),
                                   tokens_per_micro=micro_batch_tokens(micro_batch),
                                   checkpoint_bytes=self.checkpoint_bytes or checkpoint_bytes,
                                   first_backward_unit=self.runner.first_backward,
                                   kept_units=len(self.runner.kept.units or ()))

    def time_unit(self, batch: Any, checkpoint_bytes: int) -> UnitTiming:
        """Unit 0's forward and backward, and the non-layer work, timed over the micro-batches one task of
        ``batch`` runs (all of them under batched passes, up to ``unit_timing.TIMED_TOKENS``), before step 1:
        this model's compute rates at its own shapes and precision (``StepRunner.time_unit``,
        ``StepRunner.time_nonlayer``), and the kept graphs "auto" will choose in the budget the plan leaves with
        checkpoints of that size."""
        micro_batches, sizes = self.micro_batches(batch)
        timed, task = timed_task(micro_batches, self.schedule.batched_forward)
        micro_batches, sizes = micro_batches[:timed], sizes[:timed]
        forward_s, backward_s, graph_bytes = self.runner.time_unit(0, micro_batches, sizes)
        nonlayer_s = self.runner.time_nonlayer(micro_batches)
        kept, per_unit = self.runner.kept.expected_units(graph_bytes * task // timed,
                                                         self._free_host_bytes(checkpoint_bytes), len(self.units))
        return UnitTiming(forward_s, backward_s, self.units[0].layout.numel, self.unit_numel(0),
                          sum(micro_batch_tokens(b) for b in micro_batches), kept, per_unit, nonlayer_s)

    def activation_sizes(self, micro_batch: Any) -> int:
        """Before the first forward, from shapes (``pre_stage`` on meta copies): the bytes of one activation
        checkpoint of ``micro_batch`` (0 when the model cannot run on meta); the loss head's output is sized
        too, and counted in the host plan from now on."""
        self.logits_bytes = self.logits_bytes or loss_head_bytes(self.module, micro_batch)
        return checkpoint_bytes_from_shapes(self.module, micro_batch)

    @property
    def kept_units(self) -> list[int]:
        """The units whose forward graphs the step keeps for the backward, ascending (with
        ``keep_activations="auto"``: empty until the first step decides them)."""
        return sorted(self.runner.kept.units or ())

    def largest_block_matrix(self) -> tuple[int, int]:
        """(out, in) of the largest 2-D block parameter: the matmul shape the compute roof is probed at."""
        return self.plan.largest_block_matrix()

    # ------------------------------------------------------------------ one optimizer step
    def micro_batches(self, batch: Any) -> tuple[list[Any], list[int]]:
        """The step's micro-batches and their sizes. A short batch (the last one of an epoch when the
        loader keeps it) is cut into micro-batches of the full size, the last one smaller: the same
        micro-batches plain Lightning with ``accumulate_grad_batches`` would see."""
        num_micro = self.schedule.num_micro_batches
        size = batch_size(batch)
        if size == 0:
            raise ValueError("a batch of 0 samples has no micro-batches to train on; remove empty batches from "
                             "the DataLoader")
        if self.global_batch_size is None:
            self.global_batch_size = size  # the first batch defines it, unless the strategy set it
        full = self.global_batch_size
        if size == full:
            return split_micro_batches(batch, num_micro), [size // num_micro] * num_micro
        if size > full:
            raise ValueError(f"a batch of {size} samples is larger than the global batch of {full}; the DataLoader's "
                             "batch size must stay fixed (micro-batch size x schedule.num_micro_batches)")
        micro_size = full // num_micro
        bounds = list(range(0, size, micro_size)) + [size]
        return [slice_batch(batch, lo, hi) for lo, hi in zip(bounds, bounds[1:])], \
            [hi - lo for lo, hi in zip(bounds, bounds[1:])]

    def train_step(self, batch: Any) -> Tensor:
        """Forward and backward of one global batch, with backward-part optimizer steps overlapped.

        Returns the mean micro-batch loss (detached). Call ``optimizer_step`` afterwards.
        """
        micro_batches, sizes = self.micro_batches(batch)
        if not self._backward_planned:
            self.runner.find_backward_floor(micro_batches[0])  # which units need a backward (frozen parameters)
            self._tasks, self._backward_planned = {}, True
            self.logits_bytes = loss_head_bytes(self.module, micro_batches[0])  # in the budget from now on
        if self.storage.host_budget_bytes is not None and not self.checkpoint_bytes:
            # The checkpoints' size is known only now: check the budget before any block runs. The RNG
            # stream is restored, so an embedding's dropout masks are the same with or without a budget.
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"), \
                    torch.no_grad(), self.runner.autocast():
                hidden, _ = unpack_pre_stage(self.module.pre_stage(micro_batches[0]))
            self.check_host_budget(hidden.numel() * hidden.element_size())
        start_s = time.perf_counter()
        before = self.counters.snapshot()
        self.trace.begin_step()
        if self.reducer is not None:
            self.reducer.begin_step()
        self.weights.take_wait_s()
        self.activations.wait_s = self.activations.backpressure_s = 0.0
        self.grad_pool.take_wait_s()
        self._hps = hyper_params(self.optimizer)
        num_micro = self.schedule.num_micro_batches
        self.gradients.begin_step(len(micro_batches), self._hps, self.step_count)
        self.nonlayer.zero_grads()
        self.overlap.submit_forward_parts()
        self.activations.set_num_micro(self.storage, len(micro_batches))
        # Every micro-batch's loss is divided by the configured count, a short batch's too (as Lightning's
        # accumulation does in an epoch's last, partial window), and by the ranks whose gradients are summed.
        state = StepState(micro_batches, sizes, self.scaler.scale / (num_micro * self.world_size))
        tasks = self.tasks(len(micro_batches))
        watch = self.progress.step(self.step_count + 1, len(tasks))  # None unless someone listens
        try:
            self.runner.run(tasks, state, watch)
            self.gradients.flush()
            if self.reducer is not None:  # the non-layer sum overlaps the worker's last backward parts
                self._nonlayer_sum = self.reducer.start_nonlayer(self.nonlayer.grads, self.nonlayer.used)
        except BaseException:
            self.gradients.abandon()
            raise
        finally:
            self.overlap.end_forward_parts()
            self.weights.drain()
            self.activations.clear()
        if watch is not None:
            watch.finish()
        self.checkpoint_bytes = self.checkpoint_bytes or state.checkpoint_bytes
        # The optimizer phase is measured from here: the worker keeps moving bytes while Lightning runs
        # its hooks, and those bytes belong to this step too.
        self._train_end_snapshot = self.counters.snapshot()
        io_wait_s, weight_backpressure_s = self.weights.take_wait_s()
        self.last_step = StepStats(
            train_s=time.perf_counter() - start_s, io_wait_s=io_wait_s + self.activations.wait_s,
            backpressure_wait_s=weight_backpressure_s + self.activations.backpressure_s,
            weight_grad_products=state.weight_grad_products, kept_tasks=state.kept_tasks,
            recomputed_tasks=state.recomputed_tasks, traffic=traffic_delta(before, self._train_end_snapshot))
        return torch.stack(state.losses).mean()

    @torch.no_grad()
    def optimizer_step(self) -> None:
        """Finish the step: the last backward parts, the non-layer parameters; defer the forward parts."""
        start_s = time.perf_counter()
        stats = self.last_step
        before = self._train_end_snapshot or self.counters.snapshot()
        wait_s = self.overlap.wait_backward_parts()
        pending, self._nonlayer_sum = self._nonlayer_sum, None
        if pending is not None:  # the non-layer sum; a parameter is used when used on any rank
            pending.wait()
            self.nonlayer.used = [bool(n) for n in pending.used.tolist()]
        skip, factor = self.gradients.finish(self.nonlayer, stats)
        if skip:
            # fp16 overflow: drop every pending update; put back the backward parts stepped speculatively.
            self.overlap.drop_forward_parts()
        else:
            self.nonlayer.step(self._hps)
            # Lightning steps the LR scheduler right after this returns: the forward parts keep this snapshot.
            self.overlap.defer_forward_parts(self._hps, self.step_count, factor, self.gradients.redo)
            self.step_count += 1
        stats.optimizer_s = time.perf_counter() - start_s
        stats.optimizer_wait_s = wait_s
        stats.optimizer_busy_s = self.overlap.take_busy_s()
        stats.optimizer_skipped_bytes = self.overlap.take_skipped_state_bytes()
        stats.ssd_busy_s = self.io.take_busy_s() if self.io is not None else 0.0
        stats.backpressure_wait_s += self.grad_pool.take_wait_s()
        stats.optimizer_traffic = traffic_delta(before, self.counters.snapshot())
        self._train_end_snapshot = None
        self.trace.end_step()

    def use_plan(self, plan: RunPlan) -> RunPlan:
        """Run ``plan`` from the next step on: the same plan re-planned with measured rates
        (``planning.run_prediction.recalibrated``), whose only setting that may differ is the prefetch depth,
        which changes no math. Called between steps. Returns the plan it runs: a deeper prefetch that the kept graphs
        leave no room for keeps the current depth."""
        assert plan.storage == self.plan.storage, "a re-plan keeps the placement"
        assert dataclasses.replace(plan.schedule, prefetch_depth=self.schedule.prefetch_depth) == self.schedule, \
            "a re-plan changes only the prefetch depth"
        if plan.schedule.prefetch_depth > self.schedule.prefetch_depth and self.runner is not None \
                and self.runner.kept.planned_bytes:
            # The kept graphs filled the budget the shallower depth left: a deeper prefetch's extra weight
            # buffers would take the run above its host budget, so the depth stays.
            current = self.plan
            self.plan, self.schedule = plan, plan.schedule
            left = self._free_host_bytes(self.checkpoint_bytes)
            self.plan, self.schedule = current, current.schedule
            if left is not None and left < 0:
                plan = dataclasses.replace(plan, schedule=dataclasses.replace(
                    plan.schedule, prefetch_depth=self.schedule.prefetch_depth))
        self.weights.set_prefetch_depth(plan.schedule.prefetch_depth)
        self.plan, self.schedule = plan, plan.schedule
        return plan

    def flush(self) -> None:
        """Apply every pending optimizer update (call before anything reads weights outside training)."""
        self.overlap.flush()
        self.weights.drain()

    # ------------------------------------------------------------------ evaluation
    def stream_blocks(self, hiddens: list[Tensor], sides: list[dict[str, Any]],
                      outputs: list[list[Tensor]] | None = None) -> list[Tensor]:
        """Every unit over each micro-batch's hidden state, weights streamed read-only (engine/stream/forward_only.py);
        pending optimizer updates land first."""
        self.flush()
        return stream_blocks(self.units, self.weights, hiddens, sides, None, self.block_check, outputs)

    def forward(self, batch: Any) -> tuple[Tensor, list[Tensor]]:
        """Model outputs and block outputs (``streamed_forward``) for ``batch`` (validation inside fit): split into micro-batches as training splits
        its batches, blocks streamed in one unit at a time, read-only (no optimizer state is read or
        written, nothing is written to the SSD)."""
        return streamed_forward(self.module, batch, self.schedule.num_micro_batches, self.device,
                                self.dtypes.autocast, self.stream_blocks)

    # ------------------------------------------------------------------ state API (checkpoints, export)
    # What checkpoint/ reads of the engine (engine/state/api.py, ``CheckpointedEngine``), and nothing else.
    @property
    def partitioned(self) -> bool:
        """Whether each rank keeps only its shard of the optimizer state (checkpoints then write shards)."""
        return self.partition is not None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtypes.compute

    @property
    def blocks_per_unit(self) -> int:
        return self.schedule.blocks_per_unit

    @property
    def nonlayer_nbytes(self) -> int:
        """Bytes of the non-layer master weights and optimizer state a checkpoint holds."""
        return self.nonlayer.nbytes

    @property
    def ssd_path(self) -> str | None:
        """The SSD tier's directory (None: no state on the SSD)."""
        return self.ssd.path if self.ssd is not None else None

    @property
    def disk_idle(self) -> Callable[[], bool] | None:
        """Whether training's own I/O is idle now (a background reader waits for it); None without an SSD tier."""
        return self.io.idle if self.io is not None else None

    def unit_range(self, u: int) -> tuple[int, int]:
        """[lo, hi) of unit ``u``'s trainable elements this rank keeps the state of (its shard, or all)."""
        return shard_range(self.units[u])

    def unit_own_lengths(self, u: int) -> dict[str, int]:
        """The lengths of unit ``u``'s slots indexed by their own elements (kept per tensor), by slot name."""
        unit = self.units[u]
        return {name: unit.state[name].numel for name in unit.slot_offsets}

    def local_unit_state(self, u: int) -> dict[str, Tensor]:
        """This rank's shard of unit ``u``'s master weights and optimizer state (partitioned), CPU copies."""
        assert self.partition is not None, "only partitioned state has shards"
        self.flush()
        return self.partition.local_state(self.units[u])

    def unit_numel(self, u: int) -> int:
        """Elements of unit ``u``'s master vector and element-wise state (its trainable part, page-padded)."""
        return self.units[u].train_end

    def unit_state_numel(self, u: int, name: str) -> int:
        """Elements of unit ``u``'s state ``name`` that a checkpoint holds: the trainable part of the master
        copy; all of an optimizer slot (a per-tensor slot has its own length, a partitioned one this rank's)."""
        unit = self.units[u]
        return unit.train_end if name == "master" else unit.state[name].numel

    def state_names(self) -> tuple[str, ...]:
        """The unit states a checkpoint holds: the master weights, then the optimizer's slots."""
        return ("master", *(slot.name for slot in self.plan.optimizer.slots))

    def optimizer_record(self) -> dict[str, Any]:
        """What a checkpoint records of the optimizer: its class and the layout of its state."""
        return self.plan.optimizer.record()

    def accepts_optimizer_record(self, saved: dict[str, Any]) -> bool:
        """Whether a checkpoint's optimizer record holds this run's kind of state (``OptimizerSpec.accepts``)."""
        return self.plan.optimizer.accepts(saved)

    def unit_state(self, u: int) -> dict[str, Tensor]:
        """Unit ``u``'s master weights and optimizer state, fresh CPU copies (one unit at a time)."""
        self.flush()
        unit = self.units[u]
        # Partitioned: the state is gathered, a collective every rank runs for the same units in order.
        state = self.partition.gather_moments(unit) if self.partition is not None else \
            {name: t.read_full() for name, t in unit.state.items()}
        return {"master": unit.master.read_copy(0, unit.train_end), **state}

    def unit_tiers(self, u: int) -> dict[str, Any]:
        """Unit ``u``'s master weights and optimizer state where they live (TieredTensors; zero-copy
        checkpoints pin their SSD files). Elements [0, unit_numel(u)) of the master are the trainable state."""
        unit = self.units[u]
        return {"master": unit.master, **unit.state}

    @torch.no_grad()
    def load_unit_state(self, u: int, state: dict[str, Tensor]) -> None:
        """Put a checkpoint's state of unit ``u`` into its tiers: partitioned, this rank's shard of it (and the
        all-gather of the weights, a collective every rank runs for the same units in order)."""
        self.flush()
        if self.partition is not None:
            self.partition.load_local(self.units[u], state)
            return
        unit = self.units[u]
        t = unit.train_end  # the frozen part [t, n) is never loaded: it is the base model's
        unit.master.evict(state["master"].to(self.dtypes.master), 0, t)
        for name, tensor in unit.state.items():
            if unit.slot_offsets:  # per tensor: the whole slot
                tensor.evict(state[name].to(tensor.dtype))
            else:
                lo, hi = shard_range(unit)  # partitioned: this rank keeps the state of its shard
                tensor.evict(state[name][lo:hi].to(tensor.dtype), lo, hi)
        if unit.weights is not unit.master:
            unit.load_trainable_weights(state["master"].to(self.dtypes.master))

    def nonlayer_state(self) -> dict[str, Any]:
        """The non-layer parameters' master weights and optimizer state, the units' scalar optimizer state,
        the step counter and the loss scaler."""
        self.flush()
        return {**self.nonlayer.state_dict(), "loss_scaler": self.scaler.state_dict(), "step_count": self.step_count,
                "optimizer_scalars": self.update.scalars_state(self.step_count)}

    def optimizer_scalars(self) -> dict[str, Any]:
        """The units' per-parameter scalar optimizer state (step counts ...) before the next step; partitioned,
        only those of the parameters this rank steps."""
        self.flush()
        return self.update.scalars_state(self.step_count)

    def merge_optimizer_scalars(self, states: list[dict[str, Any]]) -> None:
        """Add other ranks' ``optimizer_scalars`` (partitioned state: what a checkpoint records of them all)."""
        for state in states:
            self.update.scalars.merge(state, self.step_count)

    def load_nonlayer_state(self, state: dict[str, Any]) -> None:
        self.nonlayer.load_state_dict(state)
        if "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
        if "step_count" in state:
            self.step_count = int(state["step_count"])
        self.update.load_scalars(state.get("optimizer_scalars", {}), self.step_count, [u.layout for u in self.units])

    def trainable_named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The trainable parameters by module name (EngineView), master values, one unit at a time."""
        state = self.nonlayer_state()  # flushes pending updates first
        yield from ((name, value.clone()) for name, value in zip(state["names"], state["master"]))  # not live
        for u, unit in enumerate(self.units):
            views = named_tensors(unit.master.read_copy(0, unit.train_end), self.unit_slots(u))
            yield from ((name, value.clone()) for name, value in views.items())  # a view holds the vector

    def frozen_checksums(self) -> dict[str, Any]:
        """CRC-32 of every frozen parameter's stored bytes, per unit and for the non-layer ones: what a
        checkpoint records instead of a copy of the base weights. Computed once (they never change)."""
        def _crc(value: Tensor) -> int:
            return zlib.crc32(memoryview(value.contiguous().view(torch.uint8).numpy()))

        if self._frozen_crc is None:
            units = [_crc(unit.read_frozen()) for unit in self.units]
            nonlayer = {name: _crc(p.detach().cpu().reshape(-1)) for name, p in
                        zip(self.nonlayer.frozen_names, self.nonlayer.frozen)}
            self._frozen_crc = {"units": units, "nonlayer": nonlayer}
        return self._frozen_crc

    def storage_layout(self) -> list[dict[str, int]]:
        """Per unit: UnitStore.storage_bytes (what the traffic model is computed from; tests, telemetry)."""
        return [unit.storage_bytes() for unit in self.units]

    def master_bytes(self) -> int:
        """Bytes of the weights given back to the module after fit (frozen ones in the compute dtype)."""
        shape = self.shape
        frozen = sum(shape.unit_params) - sum(shape.trainable) + shape.nonlayer_frozen_params
        return ((sum(shape.trainable) + shape.nonlayer_params) * self.dtypes.bytes_per("master")
                + frozen * self.dtypes.bytes_per("compute"))
