"""Half-precision storage of the blocks' matmul weights under mixed precision (bf16-mixed, 16-mixed).

Autocast runs the matmul ops (linear, conv, mm, addmm, ...) in half precision: it rounds each fp32
weight to half right before the product. A weight stored already rounded gives the same product, bit
for bit, so the engine stores and moves the *matmul weights* in half precision (half the weight bytes
on every tier) and keeps what autocast runs in fp32 in fp32. The fp32 master copy is its own store
(``storage.master``) and the optimizer refreshes the half copy after every update, as in bf16-true.

Which parameters are stored in half (``units.is_matmul_weight``; a unit's stored layout is
``units.WeightFormat``, which the planner sizes too): the trainable ``weight`` of an ``nn.Linear``, of a convolution and
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

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from snake_strategy.config import TierShares

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


def tail_shares(weights: TierShares) -> TierShares:
    """Where the full-precision tail lives: on the device when the weights are wholly there (used in place),
    else on the host (a few KiB per block, read by every fetch: never worth an SSD page)."""
    return TierShares(device=1.0, host=0.0) if weights.device == 1.0 else TierShares(host=1.0)


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
