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
weights only, see ``checkpoint.consolidate.CheckpointWeights``), a ``pretrained`` source, or the module
itself (real weights, e.g. the trained ones a fit gave back, or a seeded init of a module built on the
meta device).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from snake_strategy.contract import check_contract
from snake_strategy.engine.base import EngineBase
from snake_strategy.engine.state.build import materialize
from snake_strategy.engine.runtime import EngineRuntime
from snake_strategy.engine.stream.forward_only import split_eval_batch, stream_blocks, streamed_forward
from snake_strategy.engine.stream.streamer import WeightStreamer
from snake_strategy.planning.run_plan import RunPlan
from snake_strategy.sources.pretrained import PretrainedSource
from snake_strategy.progress import Progress, or_quiet
from snake_strategy.storage import TieredTensor
from snake_strategy.storage.tiered import Tiers
from snake_strategy.units import UnitLayout, named_tensors


@dataclass
class EvalUnit:
    """One unit's compute weights: all that evaluation keeps of it."""

    layout: UnitLayout
    weights: TieredTensor

    def named_values(self, blocks_prefix: str) -> dict[str, Tensor]:
        """Every parameter of the unit by module name, fresh CPU copies of the compute weights."""
        views = named_tensors(self.weights.read_full(), self.layout.slot_rows(blocks_prefix))
        return {name: value.clone() for name, value in views.items()}  # see UnitStore.named_values

    def value_specs(self, blocks_prefix: str) -> list[tuple[str, torch.dtype, torch.Size]]:
        """(module name, dtype, shape) of what ``named_values`` returns, in its order, without reading it."""
        return [(name, self.weights.dtype, torch.Size(s.shape)) for name, s in self.layout.named_slots(blocks_prefix)]


class _NoPendingUpdates:
    """The weight streamer waits for a unit's deferred optimizer update before fetching it; here there
    is never one."""

    @staticmethod
    def wait_forward_part(u: int) -> None:
        return None


class EvalEngine(EngineBase):
    """Forward-only streaming of a layered module's blocks (see the module docstring).

    ``source``: a ``PretrainedSource``-like object (``unit_flat``, ``tensor``, ``close``), e.g. a
    ``checkpoint.consolidate.CheckpointWeights``; or a path for ``PretrainedSource``; None uses the module's
    weights.
    The engine closes the source once the weights are in their tiers.
    """

    def __init__(self, module: nn.Module, plan: RunPlan, runtime: EngineRuntime, source: Any = None) -> None:
        check_contract(module)
        super().__init__(module, plan, runtime)
        self.weights: WeightStreamer | None = None
        self._nonlayer: list[tuple[str, nn.Parameter]] = []
        if isinstance(source, (str, os.PathLike)):
            source = PretrainedSource(source, module)
        try:
            if isinstance(source, PretrainedSource):
                source.check_unexpected(module)  # names only: refused before any unit is built
            # Only the weights are stored: the other states' shares do not matter.
            self.open_storage(self.storage.weights.ssd > 0)
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
        # Laid out by the planner without an optimizer: one group, slots in registration order. A checkpoint
        # written by training may order a unit's slots by group; CheckpointWeights maps them by name.
        layouts = self.plan.layouts
        assert layouts, "a plan from planning.run_plan.resolve carries the model's layouts"
        assert self.plan.evaluating, "an evaluation plan: resolve(optimizer=None)"
        self._unit_params = tuple(layout.numel for layout in layouts)
        self.blocks_prefix = next(name for name, mod in module.named_modules() if mod is module.blocks)
        block_ids = {id(p) for p in module.blocks.parameters()}
        named = [(n, p) for n, p in module.named_parameters() if id(p) not in block_ids]
        self._nonlayer = named
        e_c = self.dtypes.bytes_per("compute")
        self.check_ssd_space("weights")
        self.check_host_budget()
        tracker = self.progress.phase("materialize" if source is None else "load_weights", len(layouts),
                                      total_bytes=sum(self._unit_params) * e_c)

        tiers = Tiers(self.storage, self.device, self.counters, self.io, self.ssd)

        def store_unit(layout: UnitLayout, flat: Tensor) -> EvalUnit:
            layout.buffers = [{k: v.to(self.device) for k, v in d.items()} for d in layout.buffers]
            weights = tiers.tensor(f"unit{layout.index:05d}", "weights", layout.numel, self.dtypes.compute)
            weights.evict(flat.to(self.dtypes.compute))
            tracker.advance(1, layout.numel * e_c)
            return EvalUnit(layout, weights)

        self.units = materialize(module, layouts, named, self.device, source, self.dtypes, self.blocks_prefix,
                                  s.blocks_per_unit, store_unit)
        tracker.finish()
        for _, p in named:
            if p.dtype != self.dtypes.compute and p.is_floating_point():
                # swap_tensors keeps the Parameter object that tied modules refer to.
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(self.dtypes.compute), p.requires_grad))
        self.nonlayer_trained = list(named)  # the module's own parameters, in the compute dtype from here on
        self.weights = self.own(WeightStreamer(self.units, _NoPendingUpdates(), self.trace, s.prefetch_depth,
                                               self.dtypes.compute, self.device), self._close_weights)
        self.working_pools = [self.weights.pool] if self.weights.pool is not None else []

    def _close_weights(self) -> None:
        weights, self.weights = self.weights, None
        weights.close()

    # ------------------------------------------------------------------ the forward pass
    def micro_batches(self, batch: Any) -> list[Any]:
        """The eval batch as up to ``schedule.num_micro_batches`` micro-batches of equal size (the last
        may be smaller): each unit runs them back to back, so only one micro-batch's temporaries exist."""
        return split_eval_batch(batch, self.schedule.num_micro_batches)

    def stream_blocks(self, hiddens: list[Tensor], sides: list[dict[str, Any]],
                      outputs: list[list[Tensor]] | None = None) -> list[Tensor]:
        """Every unit over each micro-batch's hidden state, weights streamed read-only (engine/stream/forward_only.py);
        one pass is one step of the trace."""
        self.trace.begin_step()
        return stream_blocks(self.units, self.weights, hiddens, sides, self.trace, self.block_check, outputs)

    @torch.no_grad()
    def forward(self, batch: Any) -> tuple[Tensor, list[Tensor]]:
        """``post_stage`` outputs and block outputs (``streamed_forward``) for the whole batch (one call on the concatenated hidden states, as a
        plain forward computes it); blocks streamed read-only, vertically over the micro-batches."""
        return streamed_forward(self.module, batch, self.schedule.num_micro_batches, self.device,
                                self.dtypes.autocast, self.stream_blocks)

    # ------------------------------------------------------------------ weights out (EngineBase, TrainedWeights)
    def unit_numel(self, u: int) -> int:
        return self.units[u].layout.numel

    def unit_state(self, u: int) -> dict[str, Tensor]:
        """Unit ``u``'s weights as a fresh CPU copy, under the key "master" as the training engine names
        them (here the compute weights: the master values in fp32/fp64)."""
        return {"master": self.units[u].weights.read_full()}

    def nonlayer_state(self) -> dict[str, Any]:
        return {"names": [n for n, _ in self._nonlayer], "master": [p.detach().cpu().clone() for _, p in self._nonlayer]}

    def export_phase(self) -> Progress:
        """Evaluation gives back what it loaded, without a progress report of its own."""
        return or_quiet(None)

    def trainable_named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The parameters that require grad in the module (EngineView): what a fit would train."""
        trainable = {name for name, p in self.module.named_parameters() if p.requires_grad}
        yield from ((name, value) for name, value in self.named_weights() if name in trainable)

    def master_bytes(self) -> int:
        """What giving the weights back to the module costs in host memory."""
        return (sum(self._unit_params) + sum(p.numel() for _, p in self._nonlayer)) * self.dtypes.bytes_per("compute")
