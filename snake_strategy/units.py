"""Units: groups of consecutive blocks whose parameters travel as one flat, contiguous vector.

A ``UnitLayout`` records where every block parameter sits inside its unit's flat vector. Trainable
parameters come first, ordered by optimizer parameter group (so each group is one contiguous range the
fused Adam kernel steps in one call), then by registration order; frozen parameters
(``requires_grad=False``) follow, from ``train_end`` on. Only ``[0, train_end)`` has a master copy,
moments and gradients; ``train_end`` is rounded up to a page (``ALIGN_ELEMS``) when frozen parameters
follow, so every optimizer transfer stays page-aligned (the padding is zeros and is never stepped). The blocks themselves stay on the meta device
for the whole run: the engine calls them through ``torch.func.functional_call`` with views into the
flat vector that currently holds the unit's weights, so no module state is ever swapped in or out.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from collections.abc import Iterable, Iterator, Sequence
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from snake_strategy.storage.tiered import ALIGN_ELEMS


def named_tensors(flat: Tensor, slots: Iterable[tuple[str, Sequence[int], int, int]], base: int = 0) -> dict[str, Tensor]:
    """The parameters a flat unit vector holds, by name: views into ``flat`` (no copy). ``slots`` are
    ``(name, shape, offset, numel)`` as the engines and checkpoint manifests list them; their offsets count
    from the unit's start and ``flat`` starts at element ``base`` of it (a unit's frozen part starts at
    ``train_end``). The one place a flat vector is cut into named parameters."""
    return {name: flat[offset - base:offset - base + numel].view(tuple(shape)) for name, shape, offset, numel in slots}


def nonlayer_numel(module: nn.Module) -> tuple[int, int, int]:
    """(trainable, frozen, largest trainable) elements of the parameters outside ``module.blocks``
    (embedding, head, norms)."""
    block_ids = {id(p) for p in module.blocks.parameters()}
    nonlayer = [p for p in module.parameters() if id(p) not in block_ids]
    trainable = [p.numel() for p in nonlayer if p.requires_grad]
    return sum(trainable), sum(p.numel() for p in nonlayer if not p.requires_grad), max(trainable, default=0)


@dataclass(frozen=True)
class ParamSlot:
    block: int  # index of the block inside the unit
    name: str  # name inside that block (``named_parameters`` of the block)
    shape: torch.Size
    offset: int
    numel: int
    trainable: bool = True


@dataclass
class UnitLayout:
    index: int
    blocks: list[nn.Module]
    slots: list[ParamSlot]
    group_ranges: list[tuple[int, int, int]]  # (param group index, start, end), contiguous, ordered
    numel: int
    first_block: int  # index of the unit's first block in the model's ``blocks``
    buffers: list[dict[str, Tensor]] = field(default_factory=list)  # per block, on the device
    train_end: int = -1  # [0, train_end): the optimizer's elements (trainable slots + page padding)
    num_trainable: int = -1  # the first ``num_trainable`` slots are trainable

    def __post_init__(self) -> None:
        if self.num_trainable < 0:
            self.num_trainable = sum(s.trainable for s in self.slots)
        if self.train_end < 0:
            self.train_end = self.numel if self.num_trainable == len(self.slots) else 0

    @property
    def trainable_slots(self) -> list[ParamSlot]:
        return self.slots[:self.num_trainable]

    def group_of(self, slot: ParamSlot) -> int:
        """The optimizer param group of a trainable parameter."""
        return next(g for g, start, end in self.group_ranges if start <= slot.offset < end)

    def named_slots(self, blocks_prefix: str, trainable: bool | None = None) -> Iterator[tuple[str, ParamSlot]]:
        """(module name, slot) of each parameter of the unit (only the trainable or only the frozen ones
        when ``trainable`` says so), in flat-vector order."""
        for s in self.slots:
            if trainable is None or s.trainable == trainable:
                yield f"{blocks_prefix}.{self.first_block + s.block}.{s.name}", s

    def slot_rows(self, blocks_prefix: str, trainable: bool | None = None) -> list[tuple[str, list[int], int, int]]:
        """(module name, shape, offset, numel) of each parameter, as ``named_tensors`` and the checkpoint
        manifests take them (``trainable`` as in ``named_slots``)."""
        return [(name, list(s.shape), s.offset, s.numel) for name, s in self.named_slots(blocks_prefix, trainable)]

    def leaves(self, flat: Tensor) -> list[Tensor]:
        """One leaf per parameter, each a view into ``flat`` (no copies), in slot order; the trainable
        ones (the first ``num_trainable``) require grad, so autograd skips the frozen ones' weight gradients.

        Separate leaves rather than views of one flat leaf: autograd would turn every view's gradient
        into a zero-filled flat-sized tensor and sum them (measured: 2x slower steps on r1).
        """
        return [flat[s.offset:s.offset + s.numel].view(s.shape).detach().requires_grad_(s.trainable)
                for s in self.slots]

    def forward(self, params: Tensor | list[Tensor], hidden: Tensor, side: dict | None = None,
                check: Callable[[object, int], object] | None = None, outputs: list[Tensor] | None = None) -> Tensor:
        """Run the unit's blocks on ``hidden`` with ``params`` (a flat vector or ``leaves``); every block
        also receives the side inputs as keyword arguments; ``check(output, block_index)`` validates
        each block's return value. Blocks that return ``(hidden, output)`` (a loss reading block outputs)
        append their outputs to ``outputs`` when given (dropped otherwise)."""
        if isinstance(params, Tensor):
            params = [params[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]
        per_block: list[dict[str, Tensor]] = [dict(b) for b in self.buffers]
        for s, value in zip(self.slots, params):
            per_block[s.block][s.name] = value
        for j, (block, tensors) in enumerate(zip(self.blocks, per_block)):
            out = functional_call(block, tensors, (hidden,), side or {})
            if check is not None:
                out = check(out, self.first_block + j)
            if isinstance(out, tuple):
                hidden = out[0]
                if outputs is not None:
                    outputs.append(out[1])
            else:
                hidden = out
        return hidden

    def flatten(self, blocks: list[nn.Module], dtype: torch.dtype) -> Tensor:
        """Copy the parameters of real (materialized) ``blocks`` into one new flat vector."""
        flat = torch.zeros(self.numel, dtype=dtype)  # zeros: the page padding after the trainable part
        named = [dict(b.named_parameters()) for b in blocks]
        for s in self.slots:
            flat[s.offset:s.offset + s.numel].copy_(named[s.block][s.name].detach().reshape(-1))
        return flat


def build_layouts(
    blocks: nn.ModuleList, blocks_per_unit: int, param_group_of: dict[int, int], align_params: bool = False
) -> list[UnitLayout]:
    """Partition ``blocks`` into units and lay out each unit's flat vector.

    ``align_params``: every trainable parameter starts on a page (``ALIGN_ELEMS``), for optimizers stepped
    one whole tensor at a time (optimizers/per_tensor.py): a chunk, the alpha split and an SSD
    transfer can then begin at any parameter. The padding between parameters holds zeros.

    ``param_group_of`` maps ``id(parameter)`` to its optimizer param-group index. Raises ValueError for
    trainable block parameters that the optimizer does not hold and for parameters shared outside their
    unit. Frozen parameters (``requires_grad=False``) need no group: they go after the trainable part.
    """
    layouts, seen = [], {}
    for u, start in enumerate(range(0, len(blocks), blocks_per_unit)):
        unit_blocks = list(blocks[start:start + blocks_per_unit])
        entries = []  # (group, order, block, name, param)
        frozen = []  # (block, name, param), in registration order
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
                    frozen.append((j, name, p))
                    continue
                if id(p) not in param_group_of:
                    raise ValueError(f"block parameter '{name}' of block {start + j} is not in the optimizer; "
                                     "configure_optimizers must cover every block parameter")
                entries.append((param_group_of[id(p)], len(entries), j, name, p))
        entries.sort(key=lambda e: (e[0], e[1]))
        slots, ranges, offset = [], [], 0
        for group, _, j, name, p in entries:
            if align_params:
                offset = -(-offset // ALIGN_ELEMS) * ALIGN_ELEMS
            if not ranges or ranges[-1][0] != group:
                ranges.append([group, offset, offset])
            slots.append(ParamSlot(j, name, p.shape, offset, p.numel()))
            offset += p.numel()
            ranges[-1][2] = offset
        num_trainable = len(slots)
        train_end = offset
        if frozen:
            # The frozen part starts on a page: optimizer transfers of [0, train_end) stay page-aligned.
            train_end = offset = -(-offset // ALIGN_ELEMS) * ALIGN_ELEMS
        for j, name, p in frozen:
            slots.append(ParamSlot(j, name, p.shape, offset, p.numel(), trainable=False))
            offset += p.numel()
        for j, block in enumerate(unit_blocks):
            for name, buf in block.named_buffers():
                if buf.is_meta:
                    raise ValueError(f"block {start + j} has buffer '{name}' on the meta device; blocks must "
                                     "compute from parameters and input only (e.g. use is_causal=True, not a mask buffer)")
        layouts.append(UnitLayout(u, unit_blocks, slots, [tuple(r) for r in ranges], offset, start,
                                  [dict(b.named_buffers()) for b in unit_blocks], train_end, num_trainable))
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
            with torch.no_grad():
                for p in real.parameters():
                    p.fill_(float("nan"))  # what no initialiser writes stays NaN, and is refused below
            real.apply(init_fn)
            for name, p in real.named_parameters():
                check_initialised(f"blocks.{layout.first_block + len(real_blocks)}.{name}", p)
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


def reset_own_parameters(module: nn.Module) -> None:
    """``module``'s own initialisation as its constructor runs it: ``reset_parameters()``, or where only that
    exists torch's ``_reset_parameters()`` (``nn.MultiheadAttention`` and ``nn.Transformer`` initialise through
    it), so torch's transformer layers built on the meta device get the values they get in memory. Called in
    ``nn.Module.apply`` order, children first, as their constructors run: the same random numbers."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        reset = getattr(module, "_reset_parameters", None)
    if callable(reset):
        reset()


def check_initialised(name: str, value: Tensor) -> None:
    """Refuse a parameter built on the meta device that no initialiser wrote (still the NaN it was filled
    with): its value from configure_model is gone, and plain Lightning would have trained from it."""
    if value.is_floating_point() and bool(torch.isnan(value).any()):
        raise ValueError(f"parameter '{name}' was built on the meta device (greedysnake runs configure_model there) "
                         "and nothing initialised it: its module has no reset_parameters() and init_module_weights "
                         "left it alone, so the value configure_model gave it is gone. Give that module a "
                         "reset_parameters(), initialise the parameter in init_module_weights(module), or create it "
                         "in __init__ (real memory: its value is kept)")


def is_matmul_weight(block: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of ``block`` is the weight of a module whose forward is one autocast op
    (stored in half under mixed precision, engine/state/half_weights.py)."""
    module_name, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return False
    module = block.get_submodule(module_name) if module_name else block
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
        return True
    # transformers' Conv1D (GPT-2) is one addmm; matched by name so transformers is not imported here.
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers")


@dataclass(frozen=True)
class WeightFormat:
    """Where every parameter of one unit sits in its stored weights under half-precision weight storage
    (engine/state/half_weights.py explains the main vector, the frozen part and the full-precision tail). Plain
    layout data: the planner sizes a unit's stored weights from it and the engine builds them with it."""

    dtype: torch.dtype  # the half dtype of the main vector
    full: torch.dtype  # the master dtype, kept by the tail and the frozen part
    numel: int  # the layout's elements
    train_end: int
    half: tuple[bool, ...]  # per slot: stored in half
    tail_offsets: tuple[int, ...]  # per slot: offset in the tail, -1 when not there
    tail_pieces: tuple[tuple[int, int, int], ...]  # (master offset, numel, tail offset) of the tail's parameters
    tail_numel: int

    @classmethod
    def for_layout(cls, layout: UnitLayout, dtype: torch.dtype, full: torch.dtype) -> WeightFormat:
        half, tail_offsets, pieces, tail = [], [], [], 0
        for s in layout.slots:
            h = s.trainable and is_matmul_weight(layout.blocks[s.block], s.name)
            half.append(h)
            tail_offsets.append(tail if s.trainable and not h else -1)
            if s.trainable and not h:
                pieces.append((s.offset, s.numel, tail))
                tail += s.numel
        return cls(dtype, full, layout.numel, layout.train_end, tuple(half), tuple(tail_offsets), tuple(pieces), tail)

    @property
    def ratio(self) -> int:
        """Half elements per full-precision element."""
        return torch.empty((), dtype=self.full).element_size() // torch.empty((), dtype=self.dtype).element_size()

    @property
    def main_numel(self) -> int:
        return self.train_end + self.ratio * (self.numel - self.train_end)

    @property
    def tail_start(self) -> int:
        """Where the tail starts in a working buffer (half elements; 64-byte aligned)."""
        return -(-self.main_numel // 32) * 32

    @property
    def buffer_numel(self) -> int:
        return self.tail_start + self.ratio * self.tail_numel

    @property
    def tail_bytes(self) -> int:
        return self.tail_numel * torch.empty((), dtype=self.full).element_size()

    def leaves(self, layout: UnitLayout, main: Tensor, tail: Tensor) -> list[Tensor]:
        """One leaf per parameter (views, no copies) from a main vector and a tail, in slot order."""
        out = []
        for s, half, t in zip(layout.slots, self.half, self.tail_offsets):
            if t >= 0:
                view = tail[t:t + s.numel]
            elif half:
                view = main[s.offset:s.offset + s.numel]
            else:  # frozen: full precision, two half elements each
                start = self.train_end + self.ratio * (s.offset - self.train_end)
                view = main[start:start + self.ratio * s.numel].view(self.full)
            out.append(view.view(s.shape).detach().requires_grad_(s.trainable))
        return out

    def split_buffer(self, buffer: Tensor) -> tuple[Tensor, Tensor]:
        """(main vector, tail) views of a working buffer of ``buffer_numel`` half elements."""
        tail = buffer[self.tail_start:self.tail_start + self.ratio * self.tail_numel].view(self.full)
        return buffer[:self.main_numel], tail

    def store(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """(main vector, tail) of a unit's full-precision flat vector (materialization)."""
        t = self.train_end
        main = torch.empty(self.main_numel, dtype=self.dtype)
        main[:t].copy_(flat[:t])  # round to nearest even: the cast autocast makes
        main[t:].view(self.full).copy_(flat[t:self.numel])
        return main, self.tail_values(flat[:t])

    def tail_values(self, trainable: Tensor) -> Tensor:
        """The tail's contents from the trainable part's full-precision values [0, train_end)."""
        tail = torch.empty(self.tail_numel, dtype=self.full, device=trainable.device)
        for offset, numel, t in self.tail_pieces:
            tail[t:t + numel].copy_(trainable[offset:offset + numel])
        return tail

    def frozen_range(self) -> tuple[int, int]:
        """[lo, hi) of the frozen part in the main vector (half elements)."""
        return self.train_end, self.main_numel
