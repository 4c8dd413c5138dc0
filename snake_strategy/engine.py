"""The engine: runs one optimizer step's task schedule over the tiered stores, with overlap.

It owns every offloaded state of the blocks (compute weights, fp32 master, Adam moments, gradient
accumulators, activation checkpoints) and the non-layer parameters' optimizer state. Lightning glue
lives in ``strategy.py``; the task order comes from ``schedule.py`` as plain data.

Threads (all started here, all joined by ``close``):
- the main thread computes, one task after the other;
- a prefetch thread fetches the weights of the next ``prefetch_depth`` units in task order while the
  current unit computes (it first waits for that unit's pending forward-part optimizer step);
- the optimizer worker (``overlap.py``) steps backward parts during the backward and forward parts
  during the next forward;
- the I/O engine's threads run the SSD reads and writes all of the above submit.

Weights do not change during a step, so leaving a unit writes nothing back: the weight traffic is
exactly ``schedule.weight_fetches``. Gradients: the resident unit accumulates into one buffer; when the
schedule moves to another unit it is flushed to the gradient store (added to the partial sum an
earlier micro-batch left, in the horizontal schedule); when the unit's last micro-batch is done its
backward part goes to the optimizer worker.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from snake_strategy import accounting
from snake_strategy.activations import ActivationStore
from snake_strategy.config import ScheduleConfig, StorageConfig
from snake_strategy.contract import check_contract, split_micro_batches
from snake_strategy.optim import adam_step, check_optimizer, snapshot_hyper_params
from snake_strategy.pretrained import PretrainedSource
from snake_strategy.overlap import OptimizerOverlap, UnitStore, forward_split
from snake_strategy.schedule import BACKWARD, build_tasks
from snake_strategy.storage import IOEngine, SsdDirectory, TieredTensor, TrafficCounters
from snake_strategy.storage.aligned import return_large_frees_to_os
from snake_strategy.units import UnitLayout, build_layouts, materialize_unit_blocks


@dataclass(frozen=True)
class DtypePolicy:
    """Which dtypes the engine stores and computes in (set by the precision plugin)."""

    compute: torch.dtype  # the weights the blocks run with
    master: torch.dtype  # master weights, moments and gradient accumulators
    autocast: torch.dtype | None = None  # bf16-mixed: run the stages under autocast
    loss_scaling: bool = False  # 16-mixed: dynamic loss scaling, overflowing steps skipped exactly


class SnakeEngine:
    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        storage: StorageConfig,
        schedule: ScheduleConfig,
        dtypes: DtypePolicy,
        device: torch.device,
        clip: tuple[str, float] | None = None,
        pretrained: str | None = None,
    ) -> None:
        if clip is not None and clip[0] not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm='{clip[0]}' is not supported; use 'norm' or 'value'")
        check_contract(module)
        # Exact global-norm clipping defers every unit's whole update to the next forward, when the
        # norm is known (see overlap.py); clipping by value is element-wise and needs no deferral.
        self.clip = clip
        self.pretrained_path = pretrained
        # Dynamic loss scale (16-mixed): GradScaler's defaults.
        self.loss_scale = 2.0**16 if dtypes.loss_scaling else 1.0
        self._good_steps = 0
        self.skipped_steps = 0
        check_optimizer(optimizer)
        self.module, self.optimizer, self.storage, self.schedule = module, optimizer, storage, schedule
        self.dtypes, self.device = dtypes, device
        self.counters = TrafficCounters()
        self.step_count = 0
        self.last_step_stats: dict[str, Any] = {}
        self.io: IOEngine | None = None
        self.ssd: SsdDirectory | None = None
        self.overlap: OptimizerOverlap | None = None
        self._prefetcher: ThreadPoolExecutor | None = None
        self.units: list[UnitStore] = []
        return_large_frees_to_os()  # else freed unit buffers stay in the heap and RSS grows with depth
        if storage.uses_ssd():
            self.ssd = SsdDirectory(storage.ssd_dir, storage.use_o_direct, storage.keep_ssd_files)
            self.io = IOEngine(storage.num_io_threads)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup
    def _build(self) -> None:
        group_of = {id(p): g for g, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        self.layouts = build_layouts(self.module.blocks, self.schedule.blocks_per_unit, group_of)
        block_param_ids = {id(p) for p in self.module.blocks.parameters()}
        self.nonlayer = [p for p in self.module.parameters() if id(p) not in block_param_ids]
        missing = [n for n, p in self.module.named_parameters() if id(p) not in block_param_ids and id(p) not in group_of]
        if missing:
            raise ValueError(f"parameters {missing} are not in the optimizer; configure_optimizers must cover them")
        if self.schedule.split_backward or self.schedule.batched_forward:
            dropouts = [m for m in self.module.blocks.modules() if isinstance(m, nn.Dropout) and m.p > 0]
            if dropouts:
                raise ValueError("schedule.split_backward / batched_forward run a unit over all micro-batches at "
                                 "once, which cannot replay per-micro-batch dropout masks; set the blocks' dropout to 0")
        self.nonlayer_group = [group_of[id(p)] for p in self.nonlayer]
        self.tasks = build_tasks(self.schedule.kind, len(self.layouts), self.schedule.num_micro_batches)
        accounting.check_ssd_space(self)
        self._check_host_budget()
        self._materialize()
        self.activations = ActivationStore(
            self.storage.checkpoints, self.storage.checkpoint_host_ends, self.schedule.num_micro_batches,
            self.device, self.counters, self.io, self.ssd,
        )
        self.overlap = OptimizerOverlap(self.units, self.dtypes.compute)
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snake-prefetch",
                                              initializer=torch.set_num_threads, initargs=(1,))
        self._prefetched: dict[int, Future] = {}
        self._resident: tuple[int, Tensor] | None = None
        self.checkpoint_bytes = 0  # one unit input of one micro-batch, known after the first forward

    def _tiered(self, name: str, state: str, numel: int, dtype: torch.dtype) -> TieredTensor:
        split = getattr(self.storage, "optimizer" if state in ("exp_avg", "exp_avg_sq") else state)
        return TieredTensor(name, state, numel, dtype, split, self.device, self.counters, self.io, self.ssd)

    def host_bytes_plan(self, checkpoint_bytes: int = 0) -> dict[str, int]:
        """Host memory the plan needs, by item (see accounting.host_bytes_plan)."""
        return accounting.host_bytes_plan(self, checkpoint_bytes)

    def _check_host_budget(self, checkpoint_bytes: int = 0) -> None:
        accounting.check_host_budget(self, checkpoint_bytes)

    def model_shape(self, micro_batch: Any, checkpoint_bytes: int):
        """The planner's view of this model (see accounting.model_shape)."""
        return accounting.model_shape(self, micro_batch, checkpoint_bytes)

    def largest_block_matrix(self) -> tuple[int, int]:
        return accounting.largest_block_matrix(self)

    def _materialize(self) -> None:
        """Give every parameter real storage in its tiers, initialising meta ones in ``apply`` order."""
        init_fn = getattr(self.module, "init_module_weights", None) or _reset_parameters
        source = PretrainedSource(self.pretrained_path) if self.pretrained_path else None
        self._blocks_prefix = next(name for name, mod in self.module.named_modules() if mod is self.module.blocks)
        nonlayer_meta = [p.is_meta for p in self.nonlayer]
        if any(nonlayer_meta) and not all(nonlayer_meta):
            raise ValueError("the embedding/head parameters are partly on the meta device; build them all in "
                             "configure_model() or all in __init__()")
        init_nonlayer = any(nonlayer_meta) and source is None
        for p in self.nonlayer:
            # swap_tensors keeps the Parameter object the optimizer and tied modules refer to.
            real = torch.empty_like(p, device=self.device) if p.is_meta else p.detach().to(self.device)
            torch.utils.swap_tensors(p, nn.Parameter(real, requires_grad=p.requires_grad))
        block_buffers = {id(b) for b in self.module.blocks.buffers()}
        for name, buf in self.module.named_buffers():
            if buf.is_meta and id(buf) not in block_buffers:
                raise ValueError(f"buffer '{name}' is on the meta device; non-layer modules must not need buffers "
                                 "initialised outside reset_parameters")

        def walk(mod: nn.Module) -> None:
            # The same post-order as nn.Module.apply, so a seeded init draws the same numbers.
            if mod is self.module.blocks:
                for layout in self.layouts:
                    self.units.append(self._materialize_unit(layout, init_fn, source))
                return
            for child in mod.children():
                walk(child)
            if init_nonlayer:
                init_fn(mod)

        with torch.no_grad():
            walk(self.module)
            if source is not None:
                block_ids = {id(p) for p in self.module.blocks.parameters()}
                for name, p in self.module.named_parameters():
                    if id(p) not in block_ids:
                        p.copy_(source.tensor(name, p.shape))
                source.close()
            master = self.dtypes.master
            self.nonlayer_master = [p if p.dtype == master and self.dtypes.compute == master
                                    else p.detach().to(master, copy=True) for p in self.nonlayer]
            for p in self.nonlayer:
                if p.dtype != self.dtypes.compute:
                    torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(self.dtypes.compute), p.requires_grad))
            self.nonlayer_exp_avg = [torch.zeros_like(m) for m in self.nonlayer_master]
            self.nonlayer_exp_avg_sq = [torch.zeros_like(m) for m in self.nonlayer_master]
            self.nonlayer_grads = [torch.zeros_like(m, device=self.device) for m in self.nonlayer_master]

    def _materialize_unit(self, layout: UnitLayout, init_fn: Callable[[nn.Module], None],
                          source: PretrainedSource | None = None) -> UnitStore:
        if source is None:
            flat = materialize_unit_blocks(layout, init_fn, self.dtypes.master)
        else:
            flat = source.unit_flat(layout, layout.index * self.schedule.blocks_per_unit, self._blocks_prefix,
                                    self.dtypes.master)
        layout.buffers = [{k: v.to(self.device) for k, v in d.items()} for d in layout.buffers]
        name, n = f"unit{layout.index:05d}", layout.numel
        weights = self._tiered(name, "weights", n, self.dtypes.compute)
        weights.evict(flat.to(self.dtypes.compute))
        if self.dtypes.compute == self.dtypes.master:
            master = weights  # fp32/fp64 training: the compute copy is the master copy, stored once
        else:
            master = self._tiered(name, "master", n, self.dtypes.master)
            master.evict(flat)
        zeros = torch.zeros(n, dtype=self.dtypes.master)
        exp_avg = self._tiered(name, "exp_avg", n, self.dtypes.master)
        exp_avg.evict(zeros)
        exp_avg_sq = self._tiered(name, "exp_avg_sq", n, self.dtypes.master)
        exp_avg_sq.evict(zeros)
        grads = self._tiered(name, "gradients", n, self.dtypes.master)
        return UnitStore(layout, weights, master, exp_avg, exp_avg_sq, grads, forward_split(n, self._effective_alpha()))

    def _effective_alpha(self) -> float:
        # Norm clipping needs the global norm and loss scaling needs to know whether any gradient
        # overflowed before anything is updated: both defer each unit's whole update to the next forward.
        defer_all = self.dtypes.loss_scaling or (self.clip is not None and self.clip[0] == "norm")
        return 1.0 if defer_all else self.schedule.alpha

    # ------------------------------------------------------------------ one optimizer step
    def train_step(self, batch: Any) -> Tensor:
        """Forward and backward of one global batch, with backward-part optimizer steps overlapped.

        Returns the mean micro-batch loss (detached). Call ``optimizer_step`` afterwards.
        """
        num_micro = self.schedule.num_micro_batches
        micro_batches = split_micro_batches(batch, num_micro)
        if self.storage.host_budget_bytes is not None and not self.checkpoint_bytes:
            # The checkpoints' size is known only now: check the budget before any block runs.
            with torch.no_grad(), self._autocast():
                hidden = self.module.pre_stage(micro_batches[0])
            self._check_host_budget(hidden.numel() * hidden.element_size())
        start_s = time.perf_counter()
        before = self.counters.snapshot()
        self._io_wait_s = 0.0
        self.activations.wait_s = 0.0
        self._resident = None  # a cache left by evaluation may hold inference tensors
        self._hps = snapshot_hyper_params(self.optimizer)
        self._acc: tuple[int, Tensor] | None = None
        self._grad_partial = [False] * len(self.units)
        self._bwd_done = [0] * len(self.units)
        self._act_grads: dict[int, Tensor] = {}
        self._fwd_done: set[int] = set()
        self._rng: dict[tuple[int, int], Any] = {}
        self._nonlayer_used = [False] * len(self.nonlayer)
        self._grad_sq = torch.zeros((), dtype=torch.float64)  # sum of squared block gradients (norm clipping)
        self._found_inf = False
        for g in self.nonlayer_grads:
            g.zero_()
        self.overlap.submit_forward_parts()
        losses = []
        for index, task in enumerate(self.tasks):
            self._prefetch_ahead(index)
            if task.kind == BACKWARD:
                losses += self._backward_task(index, micro_batches)
            else:
                self._forward_task(index, micro_batches)
        self._flush_grad_accumulator()
        self.overlap.end_forward_parts()
        self._resident = None
        self.activations.clear()
        mean_loss = torch.stack(losses).sum() / num_micro
        # The optimizer phase is measured from here: the worker keeps moving bytes while Lightning runs
        # its hooks, and those bytes belong to this step too.
        self._train_end_snapshot = self.counters.snapshot()
        self.last_step_stats = {
            "train_s": time.perf_counter() - start_s,
            "io_wait_s": self._io_wait_s + self.activations.wait_s,
            "traffic": _delta(before, self._train_end_snapshot),
        }
        return mean_loss

    def _forward_task(self, index: int, micro_batches: list[Any]) -> None:
        task = self.tasks[index]
        u = task.unit
        if self.schedule.batched_forward:
            if u in self._fwd_done:
                return  # the unit's first forward task already ran every micro-batch
            self._fwd_done.add(u)
            order = [t.micro for t in self.tasks[index:] if t.kind != BACKWARD and t.unit == u]
        else:
            order = [task.micro]
        with torch.no_grad(), self._autocast():
            if u == 0:
                for m in order:
                    self._rng[(-1, m)] = _rng_state(self.device)
                    self.activations.put(0, m, self.module.pre_stage(micro_batches[m]))
            xs = [self.activations.get(u, m) for m in order]
            w = self._weights(u)
            for m in order:
                self._rng[(u, m)] = _rng_state(self.device)
            # One product per Linear over all micro-batches when batched (larger matmuls run faster).
            y = self.units[u].layout.forward(w, torch.cat(xs) if len(xs) > 1 else xs[0])
        for m, y_m in zip(order, y.chunk(len(order))):
            self.activations.put(u + 1, m, y_m)
        self.checkpoint_bytes = y_m.numel() * y_m.element_size()

    def _backward_task(self, index: int, micro_batches: list[Any]) -> list[Tensor]:
        task = self.tasks[index]
        u = task.unit
        if self.schedule.split_backward:
            if self._bwd_done[u]:
                return []  # the unit's first backward task already did every micro-batch
            order = [t.micro for t in self.tasks[index:] if t.kind == BACKWARD and t.unit == u]
        else:
            order = [task.micro]
        num_micro = self.schedule.num_micro_batches
        last = u == len(self.units) - 1
        w = self._weights(u)
        batches = [micro_batches[m] for m in order]
        losses = []
        with torch.enable_grad():
            if last and u == 0:
                # A single-unit model: the embedding joins the fused task's graph directly.
                with self._autocast():
                    x = torch.cat([self.module.pre_stage(b) for b in batches])
                    losses = self._post_losses(self.units[u].layout.forward(w, x), batches)
                grads = torch.autograd.grad(sum(losses) * (self.loss_scale / num_micro), w + self.nonlayer,
                                            allow_unused=True)
                self._accumulate_nonlayer(grads[len(w):])
                self._accumulate_unit(u, grads[:len(w)], len(order))
                return [loss.detach() for loss in losses]
            if len(order) > 1:
                x = torch.cat([self.activations.get(u, m) for m in order]).detach().requires_grad_(True)
            else:
                x = self.activations.get(u, order[0]).detach().requires_grad_(True)
            if last:
                with self._autocast():
                    losses = self._post_losses(self.units[u].layout.forward(w, x), batches)
                grads = torch.autograd.grad(sum(losses) * (self.loss_scale / num_micro), [x] + w + self.nonlayer,
                                            allow_unused=True)
                self._accumulate_nonlayer(grads[1 + len(w):])
                losses = [loss.detach() for loss in losses]
            else:
                with _restored_rng(self._rng.pop((u, order[0])), self.device), self._autocast():
                    y = self.units[u].layout.forward(w, x)
                for m in order[1:]:
                    self._rng.pop((u, m))
                g = torch.cat([self._act_grads.pop(m) for m in order]) if len(order) > 1 else self._act_grads.pop(order[0])
                grads = torch.autograd.grad(y, [x] + w, g)
            self._accumulate_unit(u, grads[1:1 + len(w)], len(order))
            for m, dx in zip(order, grads[0].chunk(len(order))):
                self.activations.drop(u, m)
                if u > 0:
                    self._act_grads[m] = dx
            if u == 0:
                # The embedding's backward, once for all micro-batches of the task (one dense
                # embedding gradient instead of one per micro-batch), each replaying its RNG stream.
                hidden = []
                for m in order:
                    with _restored_rng(self._rng.pop((-1, m)), self.device), self._autocast():
                        hidden.append(self.module.pre_stage(micro_batches[m]))
                h = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
                self._accumulate_nonlayer(torch.autograd.grad(h, self.nonlayer, grads[0], allow_unused=True))
        return losses

    def _post_losses(self, hidden: Tensor, batches: list[Any]) -> list[Tensor]:
        outputs = self.module.post_stage(hidden)
        return [self.module.compute_loss(out, b) for out, b in zip(outputs.chunk(len(batches)), batches)]

    # ------------------------------------------------------------------ weights: fetch and prefetch
    def _prefetch_ahead(self, index: int) -> None:
        """Make sure the weights of the next ``prefetch_depth`` units after task ``index`` are on their way."""
        upcoming, resident = [], self.tasks[index].unit
        for task in self.tasks[index:]:
            if len(upcoming) >= self.schedule.prefetch_depth + 1:
                break
            if not upcoming or task.unit != upcoming[-1]:
                upcoming.append(task.unit)
        for u in upcoming[1:]:
            if u != resident and u not in self._prefetched and not self.units[u].weights.resident:
                self._prefetched[u] = self._prefetcher.submit(self._fetch_weights, u)
        if index + 1 < len(self.tasks):
            # The checkpoint the next task starts from: an SSD read issued now overlaps this task.
            following = self.tasks[index + 1]
            self.activations.prefetch(following.unit, following.micro)

    def _fetch_weights(self, u: int) -> Tensor:
        self.overlap.wait_forward_part(u)  # the deferred update of this unit must land first
        return self.units[u].weights.acquire()

    def _weights(self, u: int) -> list[Tensor]:
        """The resident unit's compute weights, one grad-requiring leaf per parameter (fetching them if needed)."""
        if self._resident is None or self._resident[0] != u:
            self._resident = None  # release first: at most one unit is held besides the prefetched ones
            start_s = time.perf_counter()
            job = self._prefetched.pop(u, None)
            flat = job.result() if job is not None else self._fetch_weights(u)  # sync point if late
            self._io_wait_s += time.perf_counter() - start_s
            self._resident = (u, self.units[u].layout.leaves(flat))
        return self._resident[1]

    # ------------------------------------------------------------------ gradients
    def _accumulate_unit(self, u: int, grads: tuple[Tensor, ...], num_tasks: int) -> None:
        """Add one task's per-parameter gradients into the unit's flat accumulator."""
        if self._acc is not None and self._acc[0] != u:
            self._flush_grad_accumulator()
        slots = self.units[u].layout.slots
        if self._acc is None:
            # The first task's gradients are copied in (no zero-fill, no extra pass).
            acc = torch.empty(self.units[u].layout.numel, dtype=self.dtypes.master, device=self.device)
            for s, g in zip(slots, grads):
                acc[s.offset:s.offset + s.numel].copy_(g.reshape(-1))
            self._acc = (u, acc)
        else:
            acc = self._acc[1]
            for s, g in zip(slots, grads):
                acc[s.offset:s.offset + s.numel].add_(g.reshape(-1))
        self._bwd_done[u] += num_tasks
        if self._bwd_done[u] == self.schedule.num_micro_batches:
            self._flush_grad_accumulator()  # complete: hand it to the optimizer worker right away

    def _flush_grad_accumulator(self) -> None:
        if self._acc is None:
            return
        u, acc = self._acc
        self._acc = None
        store = self.units[u].grads
        if self._grad_partial[u]:
            # Horizontal schedule: an earlier micro-batch left a partial gradient; read, add.
            acc.add_(store.acquire())
        if self._bwd_done[u] == self.schedule.num_micro_batches:
            # Complete: the worker steps the backward part and parks the forward part's gradient.
            if self.dtypes.loss_scaling:
                self._found_inf |= not bool(torch.isfinite(acc).all())  # a sync point on GPUs
            if self.clip is not None and self.clip[0] == "value":
                if self.dtypes.loss_scaling:
                    acc.mul_(1.0 / self.loss_scale)  # clip the true gradient, not the scaled one
                acc.clamp_(-self.clip[1], self.clip[1])
            elif self.clip is not None:
                self._grad_sq += torch.linalg.vector_norm(acc, dtype=torch.float64).square().cpu()
            self.overlap.submit_backward_part(u, acc, self._hps, self.step_count)
        else:
            store.evict(acc)
            self._grad_partial[u] = True

    def _accumulate_nonlayer(self, grads: tuple[Tensor | None, ...]) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                self.nonlayer_grads[i].add_(g)
                self._nonlayer_used[i] = True

    # ------------------------------------------------------------------ optimizer
    @torch.no_grad()
    def optimizer_step(self) -> None:
        """Finish the step: the non-layer parameters, the last backward parts; defer the forward parts."""
        start_s = time.perf_counter()
        before = getattr(self, "_train_end_snapshot", None) or self.counters.snapshot()
        hps = snapshot_hyper_params(self.optimizer)
        if self.dtypes.loss_scaling and self._skip_if_overflow():
            self.last_step_stats["optimizer_s"] = time.perf_counter() - start_s
            return
        grad_scale = self._clip_nonlayer_and_scale()
        for group, hp in enumerate(hps):
            idx = [i for i, g in enumerate(self.nonlayer_group) if g == group and self._nonlayer_used[i]]
            adam_step([self.nonlayer_master[i] for i in idx], [self.nonlayer_grads[i] for i in idx],
                      [self.nonlayer_exp_avg[i] for i in idx], [self.nonlayer_exp_avg_sq[i] for i in idx],
                      self.step_count, hp)
            for i in idx:
                if self.nonlayer[i] is not self.nonlayer_master[i]:
                    self.nonlayer[i].copy_(self.nonlayer_master[i])
        wait_s = self.overlap.wait_backward_parts()
        # Lightning steps the LR scheduler right after this returns: the forward parts keep this snapshot.
        self.overlap.defer_forward_parts(self._hps, self.step_count, grad_scale)
        self.step_count += 1
        self.last_step_stats["optimizer_s"] = time.perf_counter() - start_s
        self.last_step_stats["optimizer_wait_s"] = wait_s
        self.last_step_stats["optimizer_busy_s"] = self.overlap.take_busy_s()
        self.last_step_stats["optimizer_traffic"] = _delta(before, self.counters.snapshot())

    def _skip_if_overflow(self) -> bool:
        """16-mixed: on overflow skip the whole step exactly and halve the scale (GradScaler's policy).

        Every unit's update is still pending (deferred whole), so skipping means: drop the parked
        gradients, change no weight and no moment, do not advance the step counter."""
        self._found_inf |= any(not bool(torch.isfinite(g).all()) for g, used in
                               zip(self.nonlayer_grads, self._nonlayer_used) if used)
        self.overlap.wait_backward_parts()  # they only park gradients under loss scaling
        self.last_step_stats["loss_scale"] = self.loss_scale
        if self._found_inf:
            self.loss_scale /= 2.0
            self._good_steps = 0
            self.skipped_steps += 1
            self.last_step_stats["skipped"] = True
            return True
        self._good_steps += 1
        if self._good_steps % 2000 == 0:
            self.loss_scale *= 2.0
        return False

    def _clip_nonlayer_and_scale(self) -> float | None:
        """Clip the non-layer gradients; return the global-norm factor for the deferred unit updates.

        Follows torch.nn.utils.clip_grad_norm_: factor = min(1, max_norm / (total_norm + 1e-6)), applied
        to every gradient even when it is 1. The norm is exact: every block gradient is complete (the
        whole update of every unit is deferred under norm clipping).
        """
        used = [g for g, u in zip(self.nonlayer_grads, self._nonlayer_used) if u]
        unscale = None
        if self.dtypes.loss_scaling:
            # The loss scale used for this step's backward (it may change after this step).
            unscale = 1.0 / self.last_step_stats["loss_scale"]
            for g in used:
                g.mul_(unscale)
        if self.clip is None:
            return unscale
        algorithm, value = self.clip
        if algorithm == "value":
            for g in used:
                g.clamp_(-value, value)
            return None  # unit gradients were unscaled and clamped when they completed
        if unscale is not None:
            self._grad_sq *= unscale**2
        sq = self._grad_sq + sum((torch.linalg.vector_norm(g, dtype=torch.float64).square().cpu() for g in used),
                                 torch.zeros((), dtype=torch.float64))
        total_norm = float(sq.sqrt())
        factor = min(1.0, value / (total_norm + 1e-6))
        for g in used:
            g.mul_(factor)
        self.last_step_stats["grad_norm"] = total_norm
        self.last_step_stats["clip_factor"] = factor
        return factor * unscale if unscale is not None else factor

    def flush(self) -> None:
        """Apply every pending optimizer update (call before anything reads weights outside training)."""
        if self.overlap is not None:
            self.overlap.flush()
        for job in self._prefetched.values():
            job.result()
        self._prefetched = {}

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def streamed_forward(self, batch: Any) -> Tensor:
        """Model outputs for ``batch`` with the blocks streamed in one unit at a time (no checkpoints)."""
        self.flush()
        with self._autocast():
            hidden = self.module.pre_stage(batch)
            for u, unit in enumerate(self.units):
                hidden = unit.layout.forward(self._fetch_weights(u), hidden)
            return self.module.post_stage(hidden)

    # ------------------------------------------------------------------ introspection and teardown
    def unit_parameters(self, u: int) -> dict[str, Tensor]:
        """Unit ``u``'s master parameters by their module names (a CPU copy; tests and consolidation)."""
        self.flush()
        unit = self.units[u]
        flat = unit.master.read_full()
        start = u * self.schedule.blocks_per_unit
        return {f"{start + s.block}.{s.name}": flat[s.offset:s.offset + s.numel].view(s.shape).clone()
                for s in unit.layout.slots}

    def state_dict(self) -> dict[str, Tensor]:
        """Every trainable parameter's master value by its module name (CPU copies, one unit at a time)."""
        self.flush()
        blocks_prefix = next(name for name, mod in self.module.named_modules() if mod is self.module.blocks)
        block_ids = {id(p) for p in self.module.blocks.parameters()}
        named = [n for n, p in self.module.named_parameters() if id(p) not in block_ids]
        out = {name: master.detach().cpu().clone() for name, master in zip(named, self.nonlayer_master)}
        for u in range(len(self.units)):
            out.update({f"{blocks_prefix}.{k}": v for k, v in self.unit_parameters(u).items()})
        return out

    def nonlayer_state(self) -> dict[str, Any]:
        """The non-layer parameters' optimizer state (CPU copies) for checkpoints."""
        self.flush()
        block_ids = {id(p) for p in self.module.blocks.parameters()}
        names = [n for n, p in self.module.named_parameters() if id(p) not in block_ids]

        def cpu(tensors):
            return [t.detach().cpu().clone() for t in tensors]

        return {"names": names, "master": cpu(self.nonlayer_master), "exp_avg": cpu(self.nonlayer_exp_avg),
                "exp_avg_sq": cpu(self.nonlayer_exp_avg_sq)}

    @torch.no_grad()
    def load_nonlayer_state(self, state: dict[str, Any]) -> None:
        block_ids = {id(p) for p in self.module.blocks.parameters()}
        names = [n for n, p in self.module.named_parameters() if id(p) not in block_ids]
        if state["names"] != names:
            raise ValueError(f"checkpoint non-layer parameters {state['names']} do not match the model's {names}")
        for i, p in enumerate(self.nonlayer):
            self.nonlayer_master[i].copy_(state["master"][i])
            self.nonlayer_exp_avg[i].copy_(state["exp_avg"][i])
            self.nonlayer_exp_avg_sq[i].copy_(state["exp_avg_sq"][i])
            if p is not self.nonlayer_master[i]:
                p.copy_(self.nonlayer_master[i])

    def ssd_files(self) -> list[str]:
        return self.ssd.files() if self.ssd is not None else []

    def _autocast(self):
        if self.dtypes.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtypes.autocast)

    def close(self) -> None:
        """Release every buffer, thread and file (idempotent). A Hydra multirun relies on it."""
        self._resident = None
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
            self._prefetcher = None
            self._prefetched = {}
        if self.overlap is not None:
            self.overlap.close()
            self.overlap = None
        if getattr(self, "activations", None) is not None:
            self.activations.clear()
        self.units = []
        if self.io is not None:
            self.io.close()
            self.io = None
        if self.ssd is not None:
            self.ssd.close()
            self.ssd = None


def _reset_parameters(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _delta(before: dict, after: dict) -> dict[str, int]:
    return {"/".join(k): v - before.get(k, 0) for k, v in sorted(after.items()) if v - before.get(k, 0)}


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state: tuple[Tensor, Tensor | None], device: torch.device):
    """Replay the RNG stream a forward task saw (dropout masks), then put the outer stream back."""
    outer = _rng_state(device)
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
    try:
        yield
    finally:
        torch.set_rng_state(outer[0])
        if outer[1] is not None:
            torch.cuda.set_rng_state(outer[1], device)
