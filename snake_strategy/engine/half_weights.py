"""Half-precision storage of the blocks' matmul weights under mixed precision (bf16-mixed, 16-mixed).

Autocast runs the matmul ops (linear, conv, mm, addmm, ...) in half precision: it rounds each fp32
weight to half right before the product. A weight stored already rounded gives the same product, bit
for bit, so the engine stores and moves the *matmul weights* in half precision (half the weight bytes
on every tier) and keeps what autocast runs in fp32 in fp32. The fp32 master copy is its own store
(``storage.master``) and the optimizer refreshes the half copy after every update, as in bf16-true.

Which parameters are stored in half: the trainable ``weight`` of an ``nn.Linear``, of a convolution and
of transformers' ``Conv1D`` (GPT-2's ``addmm``). Everything else keeps the master dtype: 1-D parameters
(norm gains, biases: autocast casts a Linear's bias itself), any other parameter, and frozen ones (their
stored copy is the only copy: the base weights are exported exactly as they came in).

A unit's stored weights::

    main vector (the ``weights`` TieredTensor, half dtype, placed as storage.weights says)
      [0, train_end)                every trainable element, rounded to half, at its master index: the
                                    optimizer refreshes it chunk by chunk on the same page-aligned ranges
      [train_end, train_end + 2F)   the F frozen elements in full precision, two half elements each
    tail (a small full-precision TieredTensor, in memory: on the host, or the device when the weights are)
      the trainable parameters kept in full precision, packed (for a GPT block: the LayerNorm gains and
      the biases, 0.2% of its elements)

A working buffer holds the main vector, then the tail. The half elements at the tail parameters' master
indices are written (the refresh converts whole chunks) but never read.

Exactness rests on the weight only ever reaching ops that autocast runs in that half dtype. The first
time a unit runs, ``UseCheck`` (a TorchFunctionMode) follows every half-stored weight through views
and refuses the run when one reaches any other op (before any update: it is the first step's forward).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from snake_strategy.config import TierSplit
from snake_strategy.units import UnitLayout

# Ops that autocast runs in its lower-precision dtype on CPU and CUDA (torch's autocast op lists), named
# as torch functions and Tensor methods. A half-stored weight may reach these only.
HALF_OPS = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
})
# Ops that only re-view their input: the result is the same weight, still to be checked where it goes.
VIEW_OPS = frozenset({
    "t", "T", "mT", "view", "reshape", "transpose", "permute", "__getitem__", "unsqueeze", "squeeze",
    "expand", "expand_as", "contiguous", "flatten", "unflatten", "chunk", "split", "narrow", "unbind",
    "view_as", "reshape_as", "movedim", "swapaxes", "detach",
})
# Non-tensor results that depend on the values (everything else non-tensor is metadata: shape, dtype).
VALUE_READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy",
                         "__array__", "__repr__", "__format__", "__str__"})


def is_matmul_weight(block: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of ``block`` is the weight of a module whose forward is one autocast op."""
    module_name, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return False
    module = block.get_submodule(module_name) if module_name else block
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
        return True
    # transformers' Conv1D (GPT-2) is one addmm; matched by name so transformers is not imported here.
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers")


def tail_split(weights: TierSplit) -> TierSplit:
    """Where the full-precision tail lives: on the device when the weights are wholly there (used in place),
    else on the host (a few KiB per block, read by every fetch: never worth an SSD page)."""
    return TierSplit(device=1.0, host=0.0) if weights.device == 1.0 else TierSplit(host=1.0)


@dataclass(frozen=True)
class WeightFormat:
    """Where every parameter of one unit sits in its stored weights (see the module docstring)."""

    dtype: torch.dtype  # the half dtype of the main vector
    full: torch.dtype  # the master dtype, kept by the tail and the frozen part
    numel: int  # the layout's elements
    train_end: int
    half: tuple[bool, ...]  # per slot: stored in half
    tail_offsets: tuple[int, ...]  # per slot: offset in the tail, -1 when not there
    tail_pieces: tuple[tuple[int, int, int], ...]  # (master offset, numel, tail offset) of the tail's parameters
    tail_numel: int

    @classmethod
    def for_layout(cls, layout: UnitLayout, dtype: torch.dtype, full: torch.dtype) -> "WeightFormat":
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


class UseCheck(TorchFunctionMode):
    """Follows half-stored weights through one forward; ``ValueError`` when one reaches an op autocast would
    not have run in ``dtype`` (where a stored, already rounded weight would change the result)."""

    def __init__(self, weights: dict[int, tuple[str, Tensor]], dtype: torch.dtype, device_type: str) -> None:
        super().__init__()
        self._names = {key: name for key, (name, _) in weights.items()}
        self._alive = [t for _, t in weights.values()]  # ids stay unique while the tensors live
        self._dtype, self._device_type = dtype, device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = [self._names[id(a)] for a in tree_leaves((args, kwargs)) if isinstance(a, Tensor) and id(a) in self._names]
        out = func(*args, **kwargs)
        if not hit:
            return out
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: Tensor.T, Tensor.shape, ...
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in HALF_OPS and torch.is_autocast_enabled(self._device_type) \
                and torch.get_autocast_dtype(self._device_type) == self._dtype:
            return out
        results = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        if name in VIEW_OPS:
            for t in results:
                self._names[id(t)] = hit[0]
                self._alive.append(t)
            return out
        if not results and name not in VALUE_READS:
            return out  # metadata: shape, dtype, device, size(), dim()
        raise ValueError(
            f"block parameter '{hit[0]}' is stored in {self._dtype} (half-precision weight storage of "
            f"mixed precision) but reaches '{name}', which autocast does not run in {self._dtype}: the result "
            "would differ from plain autocast. Turn the storage off with "
            "GreedySnakeStrategy(precision_plugin=GreedySnakePrecision(<precision>, half_weights=False))")


def checked(names_and_leaves: list[tuple[str, Tensor]], dtype: torch.dtype, device_type: str):
    """The context that checks one forward over these half-stored leaves."""
    if not names_and_leaves:
        return contextlib.nullcontext()
    return UseCheck({id(t): (n, t) for n, t in names_and_leaves}, dtype, device_type)
