"""Units: groups of consecutive blocks whose parameters travel as one flat, contiguous vector.

A ``UnitLayout`` records where every block parameter sits inside its unit's flat vector. Parameters
are ordered by optimizer parameter group first (so each group is one contiguous range the fused Adam
kernel steps in one call), then by registration order. The blocks themselves stay on the meta device
for the whole run: the engine calls them through ``torch.func.functional_call`` with views into the
flat vector that currently holds the unit's weights, so no module state is ever swapped in or out.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call


@dataclass(frozen=True)
class ParamSlot:
    block: int  # index of the block inside the unit
    name: str  # name inside that block (``named_parameters`` of the block)
    shape: torch.Size
    offset: int
    numel: int


@dataclass
class UnitLayout:
    index: int
    blocks: list[nn.Module]
    slots: list[ParamSlot]
    group_ranges: list[tuple[int, int, int]]  # (param group index, start, end), contiguous, ordered
    numel: int
    first_block: int  # index of the unit's first block in the model's ``blocks``
    buffers: list[dict[str, Tensor]] = field(default_factory=list)  # per block, on the device

    def leaves(self, flat: Tensor) -> list[Tensor]:
        """One grad-requiring leaf per parameter, each a view into ``flat`` (no copies), in slot order.

        Separate leaves rather than views of one flat leaf: autograd would turn every view's gradient
        into a zero-filled flat-sized tensor and sum them (measured: 2x slower steps on r1).
        """
        return [flat[s.offset:s.offset + s.numel].view(s.shape).detach().requires_grad_(True) for s in self.slots]

    def forward(self, params: Tensor | list[Tensor], hidden: Tensor, side: dict | None = None,
                check: Callable[[object, int], Tensor] | None = None) -> Tensor:
        """Run the unit's blocks on ``hidden`` with ``params`` (a flat vector or ``leaves``); every block
        also receives the side inputs as keyword arguments; ``check(output, block_index)`` validates
        each block's output."""
        if isinstance(params, Tensor):
            params = [params[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]
        per_block: list[dict[str, Tensor]] = [dict(b) for b in self.buffers]
        for s, value in zip(self.slots, params):
            per_block[s.block][s.name] = value
        for j, (block, tensors) in enumerate(zip(self.blocks, per_block)):
            hidden = functional_call(block, tensors, (hidden,), side or {})
            if check is not None:
                hidden = check(hidden, self.first_block + j)
        return hidden

    def flatten(self, blocks: list[nn.Module], dtype: torch.dtype) -> Tensor:
        """Copy the parameters of real (materialized) ``blocks`` into one new flat vector."""
        flat = torch.empty(self.numel, dtype=dtype)
        named = [dict(b.named_parameters()) for b in blocks]
        for s in self.slots:
            flat[s.offset:s.offset + s.numel].copy_(named[s.block][s.name].detach().reshape(-1))
        return flat


def build_layouts(
    blocks: nn.ModuleList, blocks_per_unit: int, param_group_of: dict[int, int]
) -> list[UnitLayout]:
    """Partition ``blocks`` into units and lay out each unit's flat vector.

    ``param_group_of`` maps ``id(parameter)`` to its optimizer param-group index. Raises ValueError for
    block parameters that the optimizer does not train or that are shared outside their unit.
    """
    layouts, seen = [], {}
    for u, start in enumerate(range(0, len(blocks), blocks_per_unit)):
        unit_blocks = list(blocks[start:start + blocks_per_unit])
        entries = []  # (group, order, block, name, param)
        for j, block in enumerate(unit_blocks):
            for name, p in block.named_parameters():
                if id(p) in seen and seen[id(p)] != u:
                    raise ValueError(
                        f"block parameter '{name}' is shared between units {seen[id(p)]} and {u}; greedysnake "
                        "needs every block parameter to belong to one unit (set schedule.blocks_per_unit so "
                        "tied blocks share a unit, or untie them)"
                    )
                if id(p) in seen:
                    continue
                seen[id(p)] = u
                if not p.requires_grad:
                    raise ValueError(f"block parameter '{name}' has requires_grad=False; frozen block "
                                     "parameters are not supported yet")
                if id(p) not in param_group_of:
                    raise ValueError(f"block parameter '{name}' of block {start + j} is not in the optimizer; "
                                     "configure_optimizers must cover every block parameter")
                entries.append((param_group_of[id(p)], len(entries), j, name, p))
        entries.sort(key=lambda e: (e[0], e[1]))
        slots, ranges, offset = [], [], 0
        for group, _, j, name, p in entries:
            if not ranges or ranges[-1][0] != group:
                ranges.append([group, offset, offset])
            slots.append(ParamSlot(j, name, p.shape, offset, p.numel()))
            offset += p.numel()
            ranges[-1][2] = offset
        for j, block in enumerate(unit_blocks):
            for name, buf in block.named_buffers():
                if buf.is_meta:
                    raise ValueError(f"block {start + j} has buffer '{name}' on the meta device; blocks must "
                                     "compute from parameters and input only (e.g. use is_causal=True, not a mask buffer)")
        layouts.append(UnitLayout(u, unit_blocks, slots, [tuple(r) for r in ranges], offset, start,
                                  [dict(b.named_buffers()) for b in unit_blocks]))
    return layouts


def materialize_unit_blocks(
    layout: UnitLayout, init_fn: Callable[[nn.Module], None], dtype: torch.dtype
) -> Tensor:
    """The unit's initial flat vector in ``dtype``, built without touching the rest of the model.

    Meta blocks are copied, given real storage on the CPU, and initialised with ``init_fn`` in
    ``nn.Module.apply`` order (the RNG is consumed exactly as a normal in-memory init would); blocks
    that were built with real weights keep their values. Real block parameters are then swapped for
    meta tensors, so the model never holds a second copy of what now lives in the tiers.
    """
    real_blocks = []
    for block in layout.blocks:
        params = list(block.parameters())
        if any(p.is_meta for p in params):
            if not all(p.is_meta for p in params):
                raise ValueError("a block mixes meta and materialized parameters; build each block entirely "
                                 "in configure_model() or entirely in __init__()")
            real = copy.deepcopy(block).to_empty(device="cpu")
            real.apply(init_fn)
            real_blocks.append(real)
        else:
            real_blocks.append(block)
    flat = layout.flatten(real_blocks, dtype)
    for block in layout.blocks:
        for p in block.parameters():
            if not p.is_meta:
                # Keeps the Parameter object (the optimizer holds it); frees its storage.
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad))
    return flat
