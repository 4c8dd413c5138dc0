"""Build the engine's state from a module: check what it can train, lay out the units, and materialize
every parameter straight into its tiers, one unit at a time (the model is never whole in memory).

Initialisation follows ``nn.Module.apply``'s post-order, so a seeded run draws the same numbers as a
normal in-memory init; pretrained weights stream in entry by entry instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from snake_strategy.engine.parallel.partition import ShardView
from snake_strategy.engine.runtime import EngineRuntime
from snake_strategy.engine.state.half_weights import tail_shares
from snake_strategy.engine.state.stores import NonLayerState, UnitStore
from snake_strategy.planning.run_plan import RunPlan
from snake_strategy.planning.memory_model import forward_part_end
from snake_strategy.precision import DtypePolicy
from snake_strategy.progress import or_quiet
from snake_strategy.sources.lora_init import adapter_initializer, nonlayer_adapter_values
from snake_strategy.sources.pretrained import PretrainedSource
from snake_strategy.storage.tiered import Tiers
from snake_strategy.units import (UnitLayout, WeightFormat, check_initialised, materialize_unit_blocks,
                                  reset_own_parameters)


@dataclass
class BuiltModel:
    blocks_prefix: str  # the module name of ``module.blocks`` ("blocks", "model.layers", ...)
    layouts: list[UnitLayout]
    units: list[UnitStore]
    nonlayer: NonLayerState



def build_model(module: nn.Module, optimizer: torch.optim.Optimizer, plan: RunPlan, runtime: EngineRuntime,
                tiers: Tiers, alpha: float, shard: Callable[[int], tuple[int, int]] | None = None) -> BuiltModel:
    """Materialize the plan's layouts into ``tiers``, reporting units done to ``runtime.progress`` (phase
    "materialize", or "load_pretrained" when streaming ``runtime.pretrained`` in). ``alpha``: the forward
    share each unit's update is cut at. ``shard(train_end) -> (lo, hi)``: partitioned optimizer state, this
    rank keeps the optimizer state of [lo, hi) (element-wise optimizers only)."""
    layouts, dtypes, device, storage = plan.layouts, runtime.dtypes, runtime.device, tiers.storage
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    blocks_prefix = next(name for name, mod in module.named_modules() if mod is module.blocks)
    block_ids = {id(p) for p in module.blocks.parameters()}
    named = [(n, p) for n, p in module.named_parameters() if id(p) not in block_ids]

    def store_unit(layout: UnitLayout, flat: torch.Tensor) -> UnitStore:
        layout.buffers = [{k: v.to(device) for k, v in d.items()} for d in layout.buffers]
        # Frozen elements [t, n) exist only as compute weights: no master, moments or gradient store.
        name, n, t = f"unit{layout.index:05d}", layout.numel, layout.train_end
        fmt, tail = None, None
        if dtypes.half_weights is not None:
            # Mixed precision: matmul weights stored in half, the rest in a full-precision tail kept in
            # memory (engine/state/half_weights.py); the master copy is separate.
            fmt = WeightFormat.for_layout(layout, dtypes.half_weights, dtypes.master)
            tail = tiers.tensor(f"{name}.tail", "weights", fmt.tail_numel, dtypes.master, tail_shares(storage.weights))
        weights = tiers.tensor(name, "weights", n if fmt is None else fmt.main_numel, dtypes.weights)
        if dtypes.weights == dtypes.master:
            master = weights  # fp32/fp64 training: the compute copy is the master copy, stored once
        else:
            master = tiers.tensor(name, "master", t, dtypes.master)
            master.evict(flat[:t])
        lo, hi = shard(t) if shard is not None else (0, t)
        state, offsets = {}, {}
        for slot in spec.slots:
            own = spec.kind.slot_offsets(spec, slot, layout)  # a slot indexed by its own elements (per tensor)
            if own is not None:
                offsets[slot.name], numel = own
            else:
                numel = hi - lo
            state[slot.name] = tiers.tensor(name, slot.name, numel, slot.dtype, storage.optimizer)
            state[slot.name].evict(torch.zeros(numel, dtype=slot.dtype))
            if shard is not None:
                state[slot.name] = ShardView(state[slot.name], lo)
        grads = tiers.tensor(name, "gradients", t, dtypes.master)
        unit = UnitStore(layout, weights, master, state, grads, spec.kind.forward_cut(layout, forward_part_end(t, alpha)),
                         fmt, tail, slot_offsets=offsets, shard=(lo, hi) if shard is not None else None)
        unit.store_weights(flat)
        tracker.advance(1, weight_bytes(layout) + int(t * state_bytes_per_elem))
        return unit

    def weight_bytes(layout: UnitLayout) -> int:
        if dtypes.half_weights is None:
            return layout.numel * dtypes.bytes_per("weights")
        fmt = WeightFormat.for_layout(layout, dtypes.half_weights, dtypes.master)
        return fmt.main_numel * dtypes.bytes_per("weights") + fmt.tail_bytes

    # Bytes put into the tiers per element: the compute weights for every element; the master copy when
    # separate and the optimizer's state for the trainable ones only.
    spec = plan.optimizer
    state_bytes_per_elem = plan.shape.state_bytes
    if dtypes.weights != dtypes.master:
        state_bytes_per_elem += dtypes.bytes_per("master")
    progress = or_quiet(runtime.progress)
    source = PretrainedSource(runtime.pretrained, module) if runtime.pretrained else None
    if source is not None:
        try:
            source.check_unexpected(module)  # names only: refused before any unit is built
        except BaseException:
            source.close()
            raise
    tracker = progress.phase("load_pretrained" if source else "materialize", len(layouts),
                             total_bytes=sum(weight_bytes(layout) + layout.train_end * state_bytes_per_elem
                                             for layout in layouts))
    try:
        units = materialize(module, layouts, named, device, source, dtypes, blocks_prefix,
                            plan.schedule.blocks_per_unit, store_unit)
    finally:
        if source is not None:
            source.close()
    tracker.finish()
    trained = [(n, p) for n, p in named if p.requires_grad]
    nonlayer = NonLayerState([n for n, _ in trained], [p for _, p in trained], [group_of[id(p)] for _, p in trained],
                             dtypes, spec, optimizer, frozen=[(n, p) for n, p in named if not p.requires_grad])
    return BuiltModel(blocks_prefix, layouts, units, nonlayer)


def materialize(module: nn.Module, layouts: list[UnitLayout], named: list[tuple[str, nn.Parameter]],
                 device: torch.device, source: PretrainedSource | None, dtypes: DtypePolicy, blocks_prefix: str,
                 blocks_per_unit: int, store_unit: Callable[[UnitLayout, torch.Tensor], UnitStore]) -> list[UnitStore]:
    init_fn = getattr(module, "init_module_weights", None) or reset_own_parameters
    adapter_init = adapter_initializer(module)  # peft adapters of a meta-built model: initialised as peft does
    if adapter_init is not None:
        init_fn = _then(init_fn, adapter_init)
    params = [p for _, p in named]
    meta = [p.is_meta for p in params]
    if any(meta) and not all(meta):
        raise ValueError("the embedding/head parameters are partly on the meta device; build them all in "
                         "configure_model() or all in __init__()")
    init_nonlayer = any(meta) and source is None
    # Adapters outside the blocks (a LoRA lm_head) are not in a base model's source: peft's init, computed
    # while they are still on the meta device (materialized ones keep their values).
    fresh = nonlayer_adapter_values(module, adapter_init, lambda name: name not in source) \
        if source is not None else {}
    for p in params:
        # swap_tensors keeps the Parameter object the optimizer and tied modules refer to. A meta one is
        # NaN until an initialiser writes it (refused after the walk below if none does).
        real = torch.full_like(p, float("nan"), device=device) if p.is_meta and p.is_floating_point() \
            else torch.empty_like(p, device=device) if p.is_meta else p.detach().to(device)
        torch.utils.swap_tensors(p, nn.Parameter(real, requires_grad=p.requires_grad))
    block_buffers = {id(b) for b in module.blocks.buffers()}
    for name, buf in module.named_buffers():
        if buf.is_meta and id(buf) not in block_buffers:
            raise ValueError(f"buffer '{name}' is on the meta device; non-layer modules must not need buffers "
                             "initialised outside reset_parameters")
    units: list[UnitStore] = []

    def walk(mod: nn.Module) -> None:
        # The same post-order as nn.Module.apply, so a seeded init draws the same numbers.
        if mod is module.blocks:
            for layout in layouts:
                if source is None:
                    flat = materialize_unit_blocks(layout, init_fn, dtypes.master)
                else:
                    flat = source.unit_flat(layout, layout.index * blocks_per_unit, blocks_prefix, dtypes.master,
                                            adapter_init)
                units.append(store_unit(layout, flat))
            return
        for child in mod.children():
            walk(child)
        if init_nonlayer:
            init_fn(mod)

    with torch.no_grad():
        walk(module)
        if source is not None:
            for name, p in named:
                p.copy_(fresh[name] if name in fresh else source.tensor(name, p.shape))
        elif init_nonlayer:
            for name, p in named:
                check_initialised(name, p)
    return units


def _then(first: Callable[[nn.Module], None], second: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    def both(module: nn.Module) -> None:
        first(module)
        second(module)

    return both
