"""``EvalEngine``: the forward-only engine of ``trainer.validate``, ``trainer.test`` and ``trainer.predict``.

Evaluation needs the compute weights and nothing else: no master copy beyond them, no Adam moments, no
gradient store, no optimizer worker, and no optimizer at all (Lightning does not call
``configure_optimizers`` outside fit). So this engine lays the blocks out in units as training does,
materializes only the ``weights`` state into its tiers (``storage.weights``; the other shares are
ignored), and streams it read-only: a prefetch thread fetches the next ``prefetch_depth`` units while the
current one runs all the micro-batches of the eval batch (the vertical order). After materialization
nothing is written: a forward reads each unit's weights once per eval batch and writes no byte to any
tier (``counters`` shows it).

Where the weights come from, in order: a greedysnake checkpoint directory (``ckpt_path``: its master
weights only, see ``checkpoint_weights.CheckpointWeights``), a ``pretrained`` source, or the module
itself (real weights, e.g. the trained ones a fit gave back, or a seeded init of a module built on the
meta device).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from snake_strategy.config import ScheduleConfig, StorageConfig
from snake_strategy.contract import check_contract
from snake_strategy.engine.build import _materialize
from snake_strategy.engine.hooks import EngineHooks
from snake_strategy.engine.streaming import split_eval_batch, stream_blocks, streamed_forward
from snake_strategy.engine.trace import TaskTrace
from snake_strategy.engine.weights import WeightStreamer
from snake_strategy.memory import format_plan
from snake_strategy.precision import DtypePolicy
from snake_strategy.pretrained import PretrainedSource
from snake_strategy.progress import Progress, or_quiet
from snake_strategy.storage import IOEngine, SsdDirectory, TieredTensor, TrafficCounters
from snake_strategy.storage.aligned import return_large_frees_to_os, round_up
from snake_strategy.units import UnitLayout, build_layouts


@dataclass
class EvalUnit:
    """One unit's compute weights: all that evaluation keeps of it."""

    layout: UnitLayout
    weights: TieredTensor


class _NoPendingUpdates:
    """The weight streamer waits for a unit's deferred optimizer update before fetching it; here there
    is never one."""

    @staticmethod
    def wait_forward_part(u: int) -> None:
        return None


class EvalEngine:
    """Forward-only streaming of a layered module's blocks (see the module docstring).

    ``source``: a ``PretrainedSource``-like object (``unit_flat``, ``tensor``, ``close``), e.g. a
    ``checkpoint_weights.CheckpointWeights``; or a path for ``PretrainedSource``; None uses the module's
    weights.
    The engine closes the source once the weights are in their tiers.
    """

    def __init__(self, module: nn.Module, storage: StorageConfig, schedule: ScheduleConfig, dtypes: DtypePolicy,
                 device: torch.device, source: Any = None, hooks: EngineHooks | None = None,
                 progress: Progress | None = None) -> None:
        check_contract(module)
        self.module, self.storage, self.schedule, self.dtypes, self.device = module, storage, schedule, dtypes, device
        self.hooks = hooks or EngineHooks()
        self.progress = or_quiet(progress)
        self.counters = TrafficCounters()
        self.trace = TaskTrace()
        self.step_count = 0
        self.io: IOEngine | None = None
        self.ssd: SsdDirectory | None = None
        self.units: list[EvalUnit] = []
        self.weights: WeightStreamer | None = None
        return_large_frees_to_os()
        if isinstance(source, (str, os.PathLike)):
            source = PretrainedSource(source)
        try:
            if isinstance(source, PretrainedSource):
                source.check_unexpected(module)  # names only: refused before any unit is built
            if storage.weights.ssd > 0:  # only the weights are stored: the other states' shares do not matter
                self.ssd = SsdDirectory(storage.ssd_dir, storage.use_o_direct, storage.keep_ssd_files)
                self.io = IOEngine(storage.num_io_threads, before_transfer=self.hooks.before_ssd_transfer)
            self._build(source)
        except BaseException:
            self.close()
            raise
        finally:
            if source is not None:
                source.close()

    # ------------------------------------------------------------------ setup
    def _build(self, source: Any) -> None:
        s, module = self.schedule, self.module
        # No optimizer, so no parameter groups: one group, slots in registration order. A checkpoint
        # written by training may order a unit's slots by group; CheckpointWeights maps them by name.
        layouts = build_layouts(module.blocks, s.blocks_per_unit, {id(p): 0 for p in module.parameters()})
        self._unit_params = tuple(layout.numel for layout in layouts)
        self.blocks_prefix = next(name for name, mod in module.named_modules() if mod is module.blocks)
        block_ids = {id(p) for p in module.blocks.parameters()}
        named = [(n, p) for n, p in module.named_parameters() if id(p) not in block_ids]
        self._nonlayer = named
        e_c = self.dtypes.bytes_per("compute")
        if self.ssd is not None:
            self.ssd.check_free_space(sum(round_up(int(n * self.storage.weights.ssd) * e_c) for n in self._unit_params),
                                      "weights")
        self.check_host_budget()
        tracker = self.progress.phase("materialize" if source is None else "load_weights", len(layouts),
                                      total_bytes=sum(self._unit_params) * e_c)

        def store_unit(layout: UnitLayout, flat: Tensor) -> EvalUnit:
            layout.buffers = [{k: v.to(self.device) for k, v in d.items()} for d in layout.buffers]
            weights = TieredTensor(f"unit{layout.index:05d}", "weights", layout.numel, self.dtypes.compute,
                                   self.storage.weights, self.device, self.counters, self.io, self.ssd)
            weights.evict(flat.to(self.dtypes.compute))
            tracker.advance(1, layout.numel * e_c)
            return EvalUnit(layout, weights)

        self.units = _materialize(module, layouts, named, self.device, source, self.dtypes, self.blocks_prefix,
                                  s.blocks_per_unit, store_unit)
        tracker.finish()
        for _, p in named:
            if p.dtype != self.dtypes.compute and p.is_floating_point():
                # swap_tensors keeps the Parameter object that tied modules refer to.
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(self.dtypes.compute), p.requires_grad))
        self.weights = WeightStreamer(self.units, _NoPendingUpdates(), self.trace, s.prefetch_depth,
                                      self.dtypes.compute, self.device)

    def host_bytes_plan(self) -> dict[str, int]:
        """Host memory evaluation needs, by item: the weights' in-memory share, the streaming buffers
        (resident unit + prefetched ones) and the non-layer parameters. Activations are not counted."""
        w, cpu = self.storage.weights, self.device.type == "cpu"
        e_c = self.dtypes.bytes_per("compute")
        in_memory = w.host + (w.device if cpu else 0.0)
        unit = max(self._unit_params)
        return {"weights": int(sum(self._unit_params) * e_c * in_memory),
                "weight_buffers": 0 if w.device == 1.0 else (1 + self.schedule.prefetch_depth) * unit * e_c,
                "nonlayer_params": sum(p.numel() for _, p in self._nonlayer) * e_c}

    def check_host_budget(self) -> None:
        budget = self.storage.host_budget_bytes
        if budget is None:
            return
        plan = self.host_bytes_plan()
        if sum(plan.values()) > budget:
            raise ValueError(
                f"evaluation needs {sum(plan.values()) / 2**30:.2f} GiB of host memory but storage.host_budget_bytes "
                f"allows {budget / 2**30:.2f} GiB: {format_plan(plan)}. To fit: move the weights share to 'ssd' "
                "(storage.weights), lower schedule.prefetch_depth or schedule.blocks_per_unit, or raise "
                "storage.host_budget_bytes")

    # ------------------------------------------------------------------ the forward pass
    def split(self, batch: Any) -> list[Any]:
        """The eval batch as up to ``schedule.num_micro_batches`` micro-batches of equal size (the last
        may be smaller): each unit runs them back to back, so only one micro-batch's temporaries exist."""
        return split_eval_batch(batch, self.schedule.num_micro_batches)

    def stream_blocks(self, hiddens: list[Tensor], sides: list[dict[str, Any]]) -> list[Tensor]:
        """Every unit over each micro-batch's hidden state, weights streamed read-only (engine/streaming.py);
        one pass is one step of the trace."""
        self.trace.begin_step()
        return stream_blocks(self.units, self.weights, hiddens, sides, self.trace)

    @torch.no_grad()
    def forward(self, batch: Any) -> Tensor:
        """``post_stage`` outputs for the whole batch (one call on the concatenated hidden states, as a
        plain forward computes it); blocks streamed read-only, vertically over the micro-batches."""
        return streamed_forward(self.module, batch, self.schedule.num_micro_batches, self.device,
                                self.dtypes.autocast, self.stream_blocks)

    def flush(self) -> None:
        """Nothing is ever pending: evaluation makes no updates."""

    # ------------------------------------------------------------------ weights out
    @property
    def num_units(self) -> int:
        return len(self.units)

    def unit_numel(self, u: int) -> int:
        return self.units[u].layout.numel

    def unit_slots(self, u: int) -> list[tuple[str, list[int], int, int]]:
        """(module name, shape, offset, numel) of every parameter of unit ``u``, in flat-vector order."""
        layout = self.units[u].layout
        return [(f"{self.blocks_prefix}.{layout.first_block + s.block}.{s.name}", list(s.shape), s.offset, s.numel)
                for s in layout.slots]

    def unit_state(self, u: int) -> dict[str, Tensor]:
        """Unit ``u``'s weights as a fresh CPU copy, under the key "master" as the training engine names
        them (here the compute weights: the master values in fp32/fp64)."""
        return {"master": self.units[u].weights.read_full()}

    def nonlayer_state(self) -> dict[str, Any]:
        return {"names": [n for n, _ in self._nonlayer], "master": [p.detach().cpu().clone() for _, p in self._nonlayer]}

    def state_dict(self) -> dict[str, Tensor]:
        """Every parameter by its module name (CPU copies, one unit at a time)."""
        out = dict(zip(*self.nonlayer_state().values()))
        for u in range(self.num_units):
            flat = self.unit_state(u)["master"]
            out.update({name: flat[offset:offset + numel].view(shape).clone()
                        for name, shape, offset, numel in self.unit_slots(u)})
        return out

    def master_bytes(self) -> int:
        """What giving the weights back to the module costs in host memory."""
        return (sum(self._unit_params) + sum(p.numel() for _, p in self._nonlayer)) * self.dtypes.bytes_per("compute")

    @torch.no_grad()
    def export_to_module(self) -> None:
        """Give the module its block weights back, one unit at a time, so that after ``trainer.validate``
        the module holds what was evaluated, as it does under a plain strategy."""
        if self.weights is not None and self.weights.pool is not None:
            self.weights.pool.clear()
        for unit in self.units:
            flat = unit.weights.read_full()
            for j, block in enumerate(unit.layout.blocks):
                params = dict(block.named_parameters())
                for s in unit.layout.slots:
                    if s.block == j:
                        value = flat[s.offset:s.offset + s.numel].view(s.shape).clone()
                        torch.utils.swap_tensors(params[s.name], nn.Parameter(value, params[s.name].requires_grad))

    # ------------------------------------------------------------------ teardown
    def ssd_files(self) -> list[str]:
        return self.ssd.files() if self.ssd is not None else []

    def close(self) -> None:
        """Release the prefetch thread, the buffers, the files and the lock (idempotent); re-raise the first
        error after trying every step."""
        first_error: BaseException | None = None
        weights, self.weights = self.weights, None
        io, ssd, self.io, self.ssd = self.io, self.ssd, None, None
        for step in (weights.close if weights is not None else None, io.close if io is not None else None,
                     ssd.close if ssd is not None else None):
            if step is None:
                continue
            try:
                step()
            except BaseException as err:  # keep releasing: files and the lock must not leak
                first_error = first_error or err
        self.units = []
        if first_error is not None:
            raise first_error
