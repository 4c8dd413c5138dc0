"""``EngineBase``: what the training and the evaluation engine share.

- I/O: the SSD directory and the I/O engine when the plan puts any state on the SSD (``open_storage``);
- resources: everything with a ``close`` (files, threads, pools, the directory and its lock) is owned
  through one ``contextlib.ExitStack`` as soon as it exists; ``close`` releases each exactly once, the last
  owned first, whatever fails on the way, also when construction stopped half-way;
- the budget: the plan's memory inputs for this rank, the host items, the one host-budget check and the
  SSD space check;
- the weights out: ``named_weights``, ``export_to_module`` and the ``TrainedWeights`` protocol
  (engine/state/api.py) that the weights file reads, over the units' ``named_values``.

A subclass builds its parts in dependency order, passing each what it needs, and owns each one that
holds a resource right after building it (``own``). As it builds its state it sets what the weights out
read: ``units``, ``blocks_prefix``, ``nonlayer_trained``, ``nonlayer_copies`` and ``working_pools``; the
hand-back then calls back into it only to ``flush`` pending updates.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from snake_strategy.contract import check_block_output, reads_block_outputs
from snake_strategy.engine.runtime import EngineHooks, EngineRuntime
from snake_strategy.engine.state.api import WeightSpec
from snake_strategy.engine.trace import TaskTrace
from snake_strategy.engine.view import StepStats
from snake_strategy.planning.run_plan import RunPlan
from snake_strategy.planning.memory_model import MemoryInputs, ssd_plan
from snake_strategy.progress import Progress, or_quiet
from snake_strategy.storage import IOEngine, SsdDirectory, TrafficCounters
from snake_strategy.storage.aligned import return_large_frees_to_os
from snake_strategy.storage.pool import BufferPool

Part = TypeVar("Part")


class EngineBase:
    """The shared half of ``SnakeEngine`` and ``EvalEngine`` (see the module docstring). ``units``: the
    engine's unit stores, each with ``layout``, ``named_values(prefix)`` and ``value_specs(prefix)``."""

    def __init__(self, module: nn.Module, plan: RunPlan, runtime: EngineRuntime) -> None:
        self.module, self.plan, self.runtime = module, plan, runtime
        # A block's return value checked: the hidden state, or (hidden, output) when the loss reads block outputs.
        self.block_check = functools.partial(check_block_output, with_output=reads_block_outputs(module))
        self.storage, self.schedule = plan.storage, plan.schedule
        self.dtypes, self.device = runtime.dtypes, runtime.device
        self.hooks = runtime.hooks or EngineHooks()
        self.progress = or_quiet(runtime.progress)  # setup, long steps and export report here
        self.counters = TrafficCounters()
        self.trace = TaskTrace(enabled=runtime.trace)
        self.step_count = 0
        self.last_step = StepStats()
        # What the weights handed back are read from, set by the subclass as it builds its state:
        self.units: list[Any] = []
        self.blocks_prefix = ""
        self.nonlayer_trained: list[tuple[str, Tensor]] = []  # the non-layer trained values (live tensors)
        # Non-layer parameters whose trained value is another tensor (a master copy in another dtype).
        self.nonlayer_copies: list[tuple[nn.Parameter, Tensor]] = []
        self.working_pools: list[BufferPool] = []  # the step's and the streaming's buffers
        self.io: IOEngine | None = None
        self.ssd: SsdDirectory | None = None
        self._resources = contextlib.ExitStack()
        self._close_errors: list[BaseException] = []
        return_large_frees_to_os()  # else freed buffers stay in the heap and RSS grows with depth

    # ------------------------------------------------------------------ resources
    def own(self, part: Part, close: Callable[[], None] | None = None) -> Part:
        """Release ``part`` (``close``, by default ``part.close``) when the engine closes; returns ``part``."""
        self._resources.callback(self._release, close or part.close)
        return part

    def _release(self, close: Callable[[], None]) -> None:
        try:
            close()
        except BaseException as err:  # keep releasing: files and the lock must not leak
            self._close_errors.append(err)

    def open_storage(self, uses_ssd: bool) -> None:
        """The SSD directory (its lock, its files) and the I/O engine's threads, when any state lives on the SSD."""
        if not uses_ssd:
            return
        s = self.storage
        self.ssd = self.own(SsdDirectory(s.ssd_dir, s.use_o_direct, s.keep_ssd_files), self._close_ssd)
        self.io = self.own(IOEngine(s.num_io_threads, before_transfer=self.hooks.before_ssd_transfer, trace=self.trace),
                           self._close_io)

    def _close_ssd(self) -> None:
        ssd, self.ssd = self.ssd, None
        ssd.close()

    def _close_io(self) -> None:
        io, self.io = self.io, None
        io.close()

    def close(self) -> None:
        """Release every buffer, thread, file and the lock, the last owned first, whatever fails on the way
        (idempotent: each is released once); then re-raise the first error. A Hydra multirun or a notebook
        retry relies on it."""
        self._resources.close()
        self.units = []
        errors, self._close_errors = self._close_errors, []
        if errors:
            raise errors[0]

    def ssd_files(self) -> list[str]:
        return self.ssd.files() if self.ssd is not None else []

    # ------------------------------------------------------------------ the budget
    @property
    def shard_rank(self) -> int:
        """This rank's share of partitioned optimizer moments (0: not partitioned)."""
        return 0

    @property
    def loss_logits_bytes(self) -> int:
        """The loss head's output over one backward task's micro-batches, once measured (0: none or unknown)."""
        return 0

    def memory_inputs(self, checkpoint_bytes: int = 0) -> MemoryInputs:
        """The plan's memory inputs for this rank (``RunPlan.memory_inputs``)."""
        return self.plan.memory_inputs(checkpoint_bytes, shard_rank=self.shard_rank,
                                       loss_logits_bytes=self.loss_logits_bytes)

    def measured_host_items(self) -> dict[str, int]:
        """Host memory the plan cannot know beforehand, measured by the run (none by default)."""
        return {}

    def host_bytes_plan(self, checkpoint_bytes: int = 0) -> dict[str, int]:
        """Host memory the run needs, by item: the plan's (``RunPlan.host_items``, per rank with partitioned
        moments) and what the run measured (``measured_host_items``)."""
        return {**self.plan.host_items(checkpoint_bytes, shard_rank=self.shard_rank,
                                       loss_logits_bytes=self.loss_logits_bytes), **self.measured_host_items()}

    def check_host_budget(self, checkpoint_bytes: int = 0) -> None:
        self.plan.check_host_budget(self.host_bytes_plan(checkpoint_bytes))

    def check_ssd_space(self, what: str) -> None:
        """The SSD directory has room for the plan's SSD states (``what``, in words), before anything is written."""
        if self.ssd is not None:
            self.ssd.check_free_space(sum(ssd_plan(self.memory_inputs()).values()), what)

    # ------------------------------------------------------------------ what a subclass provides
    def flush(self) -> None:
        """Apply every pending optimizer update (none by default)."""

    def export_phase(self) -> Progress:
        """Where ``export_to_module`` reports its units."""
        return self.progress

    # ------------------------------------------------------------------ weights out (TrainedWeights)
    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def master_dtype(self) -> torch.dtype:
        return self.dtypes.master  # the dtype of named_weights()' trained values

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.dtypes.autocast

    def unit_slots(self, u: int, trainable: bool | None = True) -> list[tuple[str, list[int], int, int]]:
        """(module name, shape, offset, numel) of every trainable (or frozen, or with None every) parameter
        of unit ``u``, in flat-vector order."""
        return self.units[u].layout.slot_rows(self.blocks_prefix, trainable)

    def weight_specs(self) -> list[WeightSpec]:
        specs = [(name, value.dtype, value.shape) for name, value in self.nonlayer_trained]
        for unit in self.units:
            specs += unit.value_specs(self.blocks_prefix)
        return specs

    def release_working_memory(self) -> None:
        self.flush()
        for pool in self.working_pools:
            pool.clear()

    def weight_groups(self) -> Iterator[list[tuple[str, Tensor]]]:
        yield [(name, value.detach().cpu()) for name, value in self.nonlayer_trained]
        for unit in self.units:
            yield list(unit.named_values(self.blocks_prefix).items())

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter by its module name (EngineView): trainable ones' master values, frozen ones'
        stored values; CPU tensors, one unit in memory at a time."""
        self.flush()
        for group in self.weight_groups():
            yield from group

    def state_dict(self) -> dict[str, Tensor]:
        """Every parameter by its module name, fresh CPU copies (the whole model in memory: tests, small models)."""
        return {name: value.clone() for name, value in self.named_weights()}

    @torch.no_grad()
    def export_to_module(self) -> None:
        """Give the module its trained weights back, streamed one unit at a time, so ``model.state_dict()``,
        a second ``fit`` or a plain Trainer see them after the engine is gone."""
        self.release_working_memory()  # their memory goes back before the weights arrive
        groups = self.weight_groups()
        next(groups)  # the non-layer values: given back below, only where they are not the parameters
        unit_bytes = [sum(s.numel() * dtype.itemsize for _, dtype, s in unit.value_specs(self.blocks_prefix))
                      for unit in self.units]
        tracker = self.export_phase().phase("export", len(self.units), total_bytes=sum(unit_bytes))
        for unit, group, num_bytes in zip(self.units, groups, unit_bytes):
            values = dict(group)
            for name, s in unit.layout.named_slots(self.blocks_prefix):
                p = unit.layout.blocks[s.block].get_parameter(s.name)
                torch.utils.swap_tensors(p, nn.Parameter(values[name], p.requires_grad))
            tracker.advance(1, num_bytes)
        for p, value in self.nonlayer_copies:
            torch.utils.swap_tensors(p, nn.Parameter(value.detach().clone(), p.requires_grad))
        tracker.finish()
