"""The step runner: executes one step's task list, one task after the other, on the main thread.

Everything a step needs between tasks lives in one ``StepState`` object, created per step: the
micro-batches, their side inputs, the RNG states to replay, the activation gradients flowing down and
the losses. Weights come from the ``WeightStreamer``, checkpoints from the ``ActivationStore``,
gradients go to the ``GradientPath``; the runner itself owns no long-lived state.

Randomness (dropout) is replayed exactly: each forward task records the RNG state it started from and
the recompute of the same (unit, micro-batches) restarts from it. When the forward and the backward
group micro-batches differently (only one of the batched flags on) the masks cannot be replayed; a run
whose blocks draw random numbers is then refused at its first step, before any update.
"""
from __future__ import annotations

import contextlib
import logging
import functools
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from snake_strategy.activations import ActivationStore
from snake_strategy.contract import (check_block_output, nonlayer_tensors, reads_block_outputs, stack_side_inputs,
                                     unpack_pre_stage)
from snake_strategy.engine.step.batch_check import check_batching, eval_mode
from snake_strategy.engine.step.gradients import GradientPath
from snake_strategy.engine.step.kept_graphs import KeptGraph, KeptGraphs
from snake_strategy.engine.step.split_backward import DeferLinearWeights, WeightGradStash
from snake_strategy.engine.step.unit_timing import time_forward_backward, time_nonlayer
from snake_strategy.engine.state.stores import NonLayerState, UnitStore
from snake_strategy.engine.trace import TASK, TaskTrace
from snake_strategy.engine.stream.streamer import WeightStreamer
from snake_strategy.progress import StepProgress
from snake_strategy.schedule import BACKWARD, FORWARD, WEIGHT_GRAD, Task

log = logging.getLogger(__name__)


@dataclass
class StepState:
    micro_batches: list[Any]
    sizes: list[int]  # samples per micro-batch (the last one of a short batch may be smaller)
    loss_factor: float  # loss scale / micro-batches per full step: the backward's seed
    side: dict[int, dict[str, Any]] = field(default_factory=dict)  # per micro-batch side inputs
    rng: dict[tuple[int, tuple[int, ...]], tuple[Tensor, Tensor | None]] = field(default_factory=dict)
    random_units: set[int] = field(default_factory=set)  # units whose forward drew random numbers
    act_grads: dict[int, Tensor] = field(default_factory=dict)  # dL/d(input of the unit below), per micro
    losses: list[Tensor] = field(default_factory=list)
    stashes: dict[int, WeightGradStash] = field(default_factory=dict)  # split backward: deferred (X, dY) per unit
    weight_grad_products: int = 0  # split backward: deferred Linear weight gradients computed (one product each)
    checkpoint_bytes: int = 0  # one unit input of one full micro-batch
    recomputed_tasks: int = 0  # backward tasks that ran their unit's forward again (the last unit's fused one excluded)
    kept_tasks: int = 0  # backward tasks that started from the forward's kept graph
    # A loss that reads block outputs (contract.reads_block_outputs): per micro-batch, each block's output from
    # the forward (detached), and dLoss/d(output) per (block, micro-batch) from the loss to the block's backward.
    block_outputs: dict[int, dict[int, Tensor]] = field(default_factory=dict)
    output_grads: dict[tuple[int, int], Tensor] = field(default_factory=dict)


@dataclass
class StepParts:
    """The engine's parts a step runs on: the unit states and the non-layer ones, and the producers and
    consumers around them (weights in, activations kept, gradients out, kept graphs, the trace)."""

    units: list[UnitStore]
    nonlayer: NonLayerState
    weights: WeightStreamer
    activations: ActivationStore
    gradients: GradientPath
    kept: KeptGraphs
    trace: TaskTrace


class StepRunner:
    """Runs one step's task list (schedule.py) over ``parts``, one task at a time, in order."""

    def __init__(self, module: nn.Module, parts: StepParts, device: torch.device, autocast: torch.dtype | None,
                 free_host_bytes: Callable[[int], int | None],
                 unverified_batching: tuple[str, float] | None = None) -> None:
        self.module = module
        self.units, self.nonlayer, self.weights = parts.units, parts.nonlayer, parts.weights
        self.activations, self.gradients, self.trace = parts.activations, parts.gradients, parts.trace
        self.device, self._autocast_dtype = device, autocast
        # Kept forward graphs (engine/step/kept_graphs.py); ``free_host_bytes(checkpoint_bytes)``: what the host budget
        # leaves once the plan with checkpoints of that size is placed (the "auto" choice).
        self.kept, self._free_host_bytes = parts.kept, free_host_bytes
        # Frozen parameters (docs/design.md, "Frozen parameters"): units below ``first_backward`` get no
        # backward at all; ``pre_trains`` says whether pre_stage's output depends on a trainable parameter.
        self.first_backward, self.pre_trains = 0, True
        # Batched passes: (what turned them on, tolerance) until the run's first batched task has checked
        # that batching leaves each sample's output alone (engine/step/batch_check.py); None once checked.
        self.unverified_batching = unverified_batching
        self.block_outputs = reads_block_outputs(module)
        self._check = functools.partial(check_block_output, with_output=self.block_outputs)
        self._said_random = False  # the dropout-order warning, once per run

    def find_backward_floor(self, micro_batch: Any) -> None:
        """Find the lowest unit whose backward is needed: 0 when pre_stage trains (its gradient flows down
        through every unit), else the first unit with a trainable parameter (all blocks when none has one)."""
        self.pre_trains = bool(self.nonlayer.params)
        if self.nonlayer.params and self.nonlayer.frozen:
            # Some non-layer parameters are frozen: one pre_stage under grad tells whether a trainable one
            # reaches its output (a tied embedding, say); the RNG stream is restored so the step's dropout
            # masks are unchanged. (With none frozen, the embedding trains: no probe, no extra call.)
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"), \
                    torch.enable_grad(), self.autocast():
                hidden, _ = unpack_pre_stage(self.module.pre_stage(micro_batch))
            self.pre_trains = hidden.requires_grad
        first = next((u for u, unit in enumerate(self.units) if unit.train_end), len(self.units))
        self.first_backward = 0 if self.pre_trains else first
        self.kept.begin(self.first_backward, len(self.units))

    def time_unit(self, u: int, micro_batches: list[Any], sizes: list[int]) -> tuple[float, float, int]:
        """Seconds of unit ``u``'s forward, and of its backward (input and weight gradients), over
        ``micro_batches`` in one pass (``unit_timing.time_forward_backward``): this model's own compute rates,
        measured at setup. It runs in eval mode (no dropout), as the batch check does, on a fresh copy of the
        unit's weights (not the streamer's buffers), with the RNG streams restored: nothing the run sees
        changes, nothing is accumulated or stepped. Returns (forward s, backward s, the bytes its forward graph saves: what
        keeping it would hold, as ``KeptGraphs`` records it; the first run records it)."""
        devices = [self.device] if self.device.type == "cuda" else []
        unit = self.units[u]
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"), \
                eval_mode([self.module]):
            with torch.no_grad(), self.autocast():
                staged = [unpack_pre_stage(self.module.pre_stage(b)) for b in micro_batches]
            hidden = torch.cat([h for h, _ in staged]) if len(staged) > 1 else staged[0][0]
            side = stack_side_inputs([s for _, s in staged], sizes)
            main = unit.weights.read_full().to(self.device)
            tail = unit.tail.read_full().to(self.device) if unit.tail is not None else None
            w = unit.leaves(main, tail)
            return time_forward_backward(lambda x, outs: self.unit_forward(u, w, x, side, outs), hidden, w,
                                         unit.layout.num_trainable, self.kept, self.autocast, self.device)

    def time_nonlayer(self, micro_batches: list[Any]) -> float:
        """Seconds of the non-layer work over ``micro_batches`` (``unit_timing.time_nonlayer``), with the
        module's own non-layer parameters (read, never accumulated into), in eval mode, the RNG restored."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"), \
                eval_mode([self.module]):
            return time_nonlayer(self.module, micro_batches, nonlayer_tensors(self.module), self.autocast,
                                 self.device)

    def autocast(self):
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def run(self, tasks: list[Task], state: StepState, watch: StepProgress | None = None) -> None:
        try:
            self._run(tasks, state, watch)
        finally:
            self.kept.clear()  # normally empty by now; after a failed task the graphs must not outlive the step

    def _run(self, tasks: list[Task], state: StepState, watch: StepProgress | None) -> None:
        trace = self.trace
        for index, task in enumerate(tasks):
            start_s = time.perf_counter() if trace.enabled else 0.0  # the task's span covers its prefetch issue
            if watch is not None:
                watch.task(index, task)  # a clock read; a line only once the step has run long
            self.weights.prefetch_after(tasks, index)
            if index + 1 < len(tasks):
                following = tasks[index + 1]
                # The checkpoints the next task starts from: SSD reads issued now overlap this task.
                for m in following.micro_batches:
                    self.activations.prefetch(following.unit, m)
            self.trace.task(task)
            if task.kind == FORWARD:
                self._forward(task, state)
            elif task.kind == WEIGHT_GRAD:
                self._weight_grads(task, state)
            else:
                self._backward(task, state)
            if trace.enabled:
                trace.span(TASK, repr(task), start_s, kind=task.kind, unit=task.unit,
                           micro_batches=list(task.micro_batches), index=index)

    # ------------------------------------------------------------------ stages
    def pre_stage(self, state: StepState, m: int) -> Tensor:
        hidden, side = unpack_pre_stage(self.module.pre_stage(state.micro_batches[m]))
        state.side[m] = side
        return hidden

    def unit_forward(self, u: int, params, hidden: Tensor, side: dict[str, Any],
                     outputs: list[Tensor] | None = None) -> Tensor:
        return self.units[u].forward(params, hidden, side, self._check, outputs)

    def _side(self, state: StepState, order: tuple[int, ...]) -> dict[str, Any]:
        return stack_side_inputs([state.side[m] for m in order], [state.sizes[m] for m in order])

    def _verify_batching(self, u: int, w: list[Tensor], xs: list[Tensor], state: StepState,
                         order: tuple[int, ...]) -> None:
        """The run's first batched task: unit ``u`` over ``xs`` concatenated must equal it per micro-batch
        (two extra forwards of the unit, once per run, before any update), else a ValueError."""
        if self.unverified_batching is None or len(order) < 2:
            return
        settings, tolerance = self.unverified_batching
        with self.autocast():
            check_batching(lambda h, side: self.unit_forward(u, w, h, side), self.units[u].layout.blocks,
                           [x.detach() for x in xs], [state.side[m] for m in order], self._side(state, order), u,
                           tolerance, settings, self.device)
        self.unverified_batching = None

    # ------------------------------------------------------------------ tasks
    def _needs_dx(self, u: int) -> bool:
        """Whether unit ``u``'s backward must give its input gradient: the unit below (or the embedding)
        needs it, except for the lowest unit with a backward when nothing under it trains."""
        return self.pre_trains or u > self.first_backward

    def _forward(self, task: Task, state: StepState) -> None:
        u, order = task.unit, task.micro_batches
        recording = None
        with torch.no_grad(), self.autocast():
            if u == 0:
                for m in order:
                    state.rng[(-1, (m,))] = _rng_state(self.device)
                    self.activations.put(0, m, self.pre_stage(state, m))
            xs = [self.activations.get(u, m) for m in order]
            w = self.weights.leaves(u)
            before = _rng_state(self.device)
            state.rng[(u, order)] = before
            self._verify_batching(u, w, xs, state, order)
            # One product per Linear over all micro-batches when batched (larger matmuls run faster).
            x = torch.cat(xs) if len(xs) > 1 else xs[0]
            outs: list[Tensor] | None = [] if self.block_outputs else None
            if self.kept.wants(u):
                with self.kept.recording(w) as recording:  # under grad: the graph may be kept for the backward
                    x = x.detach().requires_grad_(self._needs_dx(u))
                    y = self.unit_forward(u, w, x, self._side(state, order), outs)
            else:
                y = self.unit_forward(u, w, x, self._side(state, order), outs)
            if not _same_rng(before, _rng_state(self.device)):
                state.random_units.add(u)
                self._say_random(u)
            for j, out in enumerate(outs or ()):
                block = self.units[u].layout.first_block + j
                for m, piece in zip(order, out.detach().split([state.sizes[m] for m in order])):
                    state.block_outputs.setdefault(m, {})[block] = piece
        for m, y_m in zip(order, y.detach().split([state.sizes[m] for m in order])):
            self.activations.put(u + 1, m, y_m)
            state.checkpoint_bytes = max(state.checkpoint_bytes, y_m.numel() * y_m.element_size())
            if u < self.first_backward:
                self.activations.drop(u, m)  # no backward below the first trainable unit: no recompute
        if recording is not None:
            graph = KeptGraph(x, w, y, recording.num_bytes, outs or [])
            if self.kept.keep((u, order), graph, lambda: self._free_host_bytes(state.checkpoint_bytes)):
                for m in order:
                    self.activations.drop(u, m)  # the graph holds the input: the checkpoint is not read again

    def _defer(self, task: Task, state: StepState, wt: list[Tensor]):
        """Split backward: the Linear weight gradients of this task's recompute wait for W(u); others run now."""
        if task.kind == BACKWARD or not wt:
            return contextlib.nullcontext()
        stash = state.stashes.setdefault(task.unit, WeightGradStash([leaf.dtype for leaf in wt]))
        return DeferLinearWeights(wt, stash, self.device.type)

    def _accumulate(self, task: Task, grads: tuple[Tensor | None, ...]) -> None:
        """A unit's gradients of one task. An input-gradient task of the split adds what it has (the
        deferred ones come in W(u), which completes the unit); a whole backward task completes its part."""
        if task.kind == BACKWARD:
            self.gradients.accumulate(task.unit, grads, len(task.micro_batches))
        elif any(g is not None for g in grads):
            self.gradients.accumulate(task.unit, grads, 0)

    def _weight_grads(self, task: Task, state: StepState) -> None:
        """W(u): every deferred Linear weight gradient of unit ``u``, one product per call site over all the
        micro-batches; completes the unit's gradient (it goes to the optimizer worker from here)."""
        self.weights.release()  # no weights are read here: the buffer serves the fetches ahead (run-ahead + 1)
        layout = self.units[task.unit].layout
        if not layout.num_trainable:
            return  # a frozen unit: nothing was deferred, nothing to complete
        stash = state.stashes.pop(task.unit, None)
        slots = layout.trainable_slots
        grads = stash.weight_grads() if stash is not None else (None,) * len(slots)
        state.weight_grad_products += stash.num_products if stash is not None else 0
        self.gradients.accumulate(task.unit, grads, len(task.micro_batches))

    def _backward(self, task: Task, state: StepState) -> None:
        u, order = task.unit, task.micro_batches
        last = u == len(self.units) - 1
        w = self.weights.leaves(u)
        wt = w[:self.units[u].layout.num_trainable]  # frozen leaves need no weight gradient
        batches = [state.micro_batches[m] for m in order]
        sizes = [state.sizes[m] for m in order]
        with torch.enable_grad():
            if last and u == 0:
                # A single-unit model: the embedding joins the fused task's graph directly.
                with self.autocast():
                    x = torch.cat([self.pre_stage(state, m) for m in order])
                    self._verify_batching(u, w, list(x.split(sizes)), state, order)
                    outs: list[Tensor] = []
                    with self._defer(task, state, wt):
                        y = self.unit_forward(u, w, x, self._side(state, order), outs)
                    losses, leaves = self._post_losses(y, batches, state, task, outs)
                grads = self._loss_grads(losses, leaves, wt + self.nonlayer.params, state)
                self.nonlayer.accumulate(grads[len(wt):])
                if wt:
                    self._accumulate(task, grads[:len(wt)])
                state.losses += [loss.detach() for loss in losses]
                return
            needs_dx = self._needs_dx(u)
            graph = None if last else self.kept.take((u, order))
            g = None if last else (torch.cat([state.act_grads.pop(m) for m in order]) if len(order) > 1
                                   else state.act_grads.pop(order[0]))
            if graph is not None:  # no recompute: the forward's graph, its weight references read from ``w``
                state.rng.pop((u, order), None)
                state.kept_tasks += 1
                xs = [graph.x] if needs_dx else []
                roots, seeds = self._roots(state, task, graph.y, graph.outputs, g)
                with self.kept.unpacking(w):
                    grads = _grad(roots, xs + graph.leaves[:len(wt)], seeds)
            else:
                x = torch.cat([self.activations.get(u, m) for m in order]) if len(order) > 1 \
                    else self.activations.get(u, order[0])
                x = x.detach().requires_grad_(needs_dx)
                xs = [x] if needs_dx else []
                grads = self._recompute_grads(task, state, w, wt, x, xs, g)
            if wt:
                self._accumulate(task, grads[len(xs):len(xs) + len(wt)])
            for m, dx in zip(order, grads[0].split(sizes) if needs_dx else [None] * len(order)):
                self.activations.drop(u, m)
                if u > 0 and dx is not None:
                    state.act_grads[m] = dx
            if u == 0 and self.pre_trains:
                # The embedding's backward, once for all micro-batches of the task (one dense embedding
                # gradient instead of one per micro-batch), each replaying its RNG stream.
                hidden = []
                for m in order:
                    with _replayed(state.rng.pop((-1, (m,))), self.device), self.autocast():
                        hidden.append(self.pre_stage(state, m))
                h = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
                self.nonlayer.accumulate(torch.autograd.grad(h, self.nonlayer.params, grads[0], allow_unused=True))

    def _recompute_grads(self, task: Task, state: StepState, w: list[Tensor], wt: list[Tensor], x: Tensor,
                         xs: list[Tensor], g: Tensor | None) -> tuple[Tensor | None, ...]:
        """The unit's forward again from its checkpoint ``x`` (the fused loss on the last unit, seed ``g``
        elsewhere), then its gradients with respect to ``xs + wt`` (and the non-layer parameters, last unit)."""
        u, order = task.unit, task.micro_batches
        self._verify_batching(u, w, list(x.split([state.sizes[m] for m in order])), state, order)
        if u == len(self.units) - 1:
            batches = [state.micro_batches[m] for m in order]
            with self.autocast():
                outs: list[Tensor] = []
                with self._defer(task, state, wt):
                    y = self.unit_forward(u, w, x, self._side(state, order), outs)
                losses, leaves = self._post_losses(y, batches, state, task, outs)
            grads = self._loss_grads(losses, leaves, xs + wt + self.nonlayer.params, state)
            self.nonlayer.accumulate(grads[len(xs) + len(wt):])
            state.losses += [loss.detach() for loss in losses]
            return grads
        state.recomputed_tasks += 1
        outs: list[Tensor] = []
        with self._replay(state, u, order), self.autocast(), self._defer(task, state, wt):
            y = self.unit_forward(u, w, x, self._side(state, order), outs)
        roots, seeds = self._roots(state, task, y, outs, g)
        return _grad(roots, xs + wt, seeds)

    def _say_random(self, u: int) -> None:
        """The first unit seen drawing random numbers: the masks are the run's own, not plain Lightning's."""
        if not self._said_random:
            self._said_random = True
            log.warning(
                "the blocks of unit %d draw random numbers (dropout): the recompute replays each forward's masks "
                "exactly, but the schedule draws them unit by unit over the micro-batches, where plain Lightning "
                "draws them micro-batch by micro-batch through every block, so this run's masks are other samples "
                "of the same distribution and its parameters equal plain Lightning's only with dropout off (p=0). "
                "Everything else is exact", u)

    def _replay(self, state: StepState, u: int, order: tuple[int, ...]):
        """The RNG stream the forward of (u, order) saw, or nothing to replay when it drew no numbers."""
        saved = state.rng.pop((u, order), None)
        if saved is None:
            for key in [k for k in state.rng if k[0] == u]:
                state.rng.pop(key)
            if u in state.random_units:
                raise ValueError(
                    f"the blocks of unit {u} draw random numbers (dropout), and schedule.batched_forward / "
                    "batched_backward group micro-batches differently in the forward and the recompute, so the "
                    "recompute cannot replay the forward's masks. Set both flags to the same value, or use "
                    "dropout 0 in the blocks")
            return contextlib.nullcontext()
        return _replayed(saved, self.device)

    def _post_losses(self, hidden: Tensor, batches: list[Any], state: StepState, task: Task,
                     live: list[Tensor]) -> tuple[list[Tensor], dict[tuple[int, int], Tensor]]:
        """Each micro-batch's loss of the last unit's task, and the leaves its loss read the outputs of the
        blocks below through (a loss reading block outputs: the forward's values, by (block, micro-batch);
        ``live``: the outputs of this task's own blocks, still attached to its graph)."""
        sizes = [state.sizes[m] for m in task.micro_batches]
        outputs = self.module.post_stage(hidden).split(sizes)
        if not self.block_outputs:
            return [self.module.compute_loss(out, b) for out, b in zip(outputs, batches)], {}
        first = self.units[task.unit].layout.first_block
        trained_from = self.units[self.first_backward].layout.first_block if self.first_backward < len(self.units) \
            else first  # blocks below get no backward: their outputs need no gradient
        live_pieces = [out.split(sizes) for out in live]
        losses, leaves = [], {}
        for k, (m, out, batch) in enumerate(zip(task.micro_batches, outputs, batches)):
            read = []
            for block in range(first):
                value = state.block_outputs[m][block]
                if block >= trained_from:
                    value = leaves[(block, m)] = value.detach().requires_grad_(True)
                read.append(value)
            read += [pieces[k] for pieces in live_pieces]
            losses.append(self.module.compute_loss(out, batch, read))
        return losses, leaves

    def _loss_grads(self, losses: list[Tensor], leaves: dict[tuple[int, int], Tensor], inputs: list[Tensor],
                    state: StepState) -> tuple[Tensor | None, ...]:
        """Gradients of the task's losses (times the step's seed) with respect to ``inputs``; those with respect
        to the block outputs the losses read (``leaves``) wait in the state for their blocks' backward."""
        keys = list(leaves)
        grads = _grad(sum(losses) * state.loss_factor, inputs + [leaves[key] for key in keys])
        for key, grad in zip(keys, grads[len(inputs):]):
            if grad is not None:
                state.output_grads[key] = grad
        return grads[:len(inputs)]

    def _roots(self, state: StepState, task: Task, y: Tensor, outs: list[Tensor], g: Tensor | None
               ) -> tuple[list[Tensor], list[Tensor | None]]:
        """What a unit's backward differentiates, and the seeds: its output with the gradient from above, and
        each of its blocks' outputs for the loss with the loss's gradient (none when the loss reads none)."""
        roots, seeds = [y], [g]
        first = self.units[task.unit].layout.first_block
        for j, out in enumerate(outs):
            block = first + j
            grads = [state.output_grads.pop((block, m), None) for m in task.micro_batches]
            values = [state.block_outputs.get(m, {}).pop(block, None) for m in task.micro_batches]
            if all(grad is None for grad in grads):
                continue
            grads = [torch.zeros_like(v) if grad is None else grad for grad, v in zip(grads, values)]
            roots.append(out)
            seeds.append(torch.cat(grads) if len(grads) > 1 else grads[0])
        return roots, seeds


def _grad(output: Tensor | list[Tensor], inputs: list[Tensor], seed: Tensor | list[Tensor | None] | None = None
          ) -> tuple[Tensor | None, ...]:
    """autograd.grad that tolerates nothing to differentiate (every parameter the task sees is frozen);
    ``output`` and ``seed`` may be lists (a unit's output and its blocks' outputs for the loss)."""
    outputs = output if isinstance(output, list) else [output]
    if not inputs or not any(o.requires_grad for o in outputs):
        return (None,) * len(inputs)
    if isinstance(output, list):
        kept = [(o, s) for o, s in zip(outputs, seed) if o.requires_grad]
        return torch.autograd.grad([o for o, _ in kept], inputs, [s for _, s in kept], allow_unused=True)
    return torch.autograd.grad(output, inputs, seed, allow_unused=True)


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _same_rng(a: tuple[Tensor, Tensor | None], b: tuple[Tensor, Tensor | None]) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


@contextlib.contextmanager
def _replayed(state: tuple[Tensor, Tensor | None], device: torch.device):
    """Run with the RNG stream a forward task saw (dropout masks); the outer stream is restored after."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
