"""LayerPipe's split backward (``schedule.split_backward``): a unit's input gradient now, its Linear
weight gradients later, as one product over all micro-batches (docs/design.md, "Split backward").

During an input-gradient task ``BX(u, m)`` the recompute runs under ``DeferLinearWeights``, a torch
function mode that routes every ``F.linear`` whose weight is one of the unit's trainable leaves through
``_DeferredLinear``. Its backward returns the input gradient (``dY @ W``) and the bias gradient at once,
and *stashes* the pair (X, dY) instead of computing the weight gradient. Every other operation (and an
F.linear of anything else: frozen weights, the head, a weight used inside another torch function) goes
through autograd unchanged, so the split is exact for any block; it is only *faster* where the block's
weights meet their inputs through ``F.linear`` (every ``nn.Linear``, peft's LoRA layers).

The weight-gradient task ``W(u)`` then computes, per call site of each stashed weight,
``dW = cat(dY)^T @ cat(X)`` over all micro-batches: the same products autograd computes per
micro-batch, summed inside one matmul instead of by the gradient accumulator. Cost: the stashed X and
dY of every Linear for all micro-batches of the unit stay in memory until ``W(u)`` (the memory model
counts the batched backward's workspace for it), plus one concatenated copy of each during the product.

Autocast (bf16-mixed, 16-mixed) is reproduced as autocast does it: the inputs are cast to the autocast
dtype before the product (differentiably, so the bias and input gradients flow back through the casts),
and the deferred weight gradient is computed in that dtype and cast to the weight's dtype, which is what
autograd's backward of the cast does.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode


class WeightGradStash:
    """(X, dY) pairs of one unit's deferred Linear products, by (leaf index, call number in the task)."""

    def __init__(self, dtypes: list[torch.dtype]) -> None:
        self._dtypes = dtypes  # each trainable leaf's: its gradient's dtype, as autograd would give it
        self.num_products = 0  # call sites turned into one product each by weight_grads
        self._pairs: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = defaultdict(list)

    def add(self, key: tuple[int, int], x: Tensor, grad_out: Tensor) -> None:
        self._pairs[key].append((x.detach(), grad_out.detach()))

    def weight_grads(self) -> tuple[Tensor | None, ...]:
        """Per trainable leaf, its deferred gradient (None where nothing was deferred): one product per
        call site over every stashed micro-batch. Empties the stash."""
        grads: list[Tensor | None] = [None] * len(self._dtypes)
        for (leaf, _), pairs in sorted(self._pairs.items()):
            xs = [x.reshape(-1, x.shape[-1]) for x, _ in pairs]
            gs = [g.reshape(-1, g.shape[-1]) for _, g in pairs]
            x = torch.cat(xs) if len(xs) > 1 else xs[0]  # a copy per Linear: the price of one product
            g = torch.cat(gs) if len(gs) > 1 else gs[0]
            grad = g.t().mm(x).to(self._dtypes[leaf])
            grads[leaf] = grad if grads[leaf] is None else grads[leaf] + grad
            self.num_products += 1
        self._pairs.clear()
        return tuple(grads)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, stash: WeightGradStash,
                key: tuple[int, int]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.stash, ctx.key, ctx.has_bias = stash, key, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            ctx.stash.add(ctx.key, x, grad_out)  # dW = dY^T X later, in W(u), for all micro-batches at once
        grad_b = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_b, None, None


class DeferLinearWeights(TorchFunctionMode):
    """Active during a split task's recompute: F.linear of the given trainable leaves is deferred."""

    def __init__(self, leaves: list[Tensor], stash: WeightGradStash, device_type: str) -> None:
        super().__init__()
        self._index = {id(leaf): i for i, leaf in enumerate(leaves) if leaf.requires_grad}
        self._stash, self._device_type = stash, device_type
        self._calls: dict[int, int] = defaultdict(int)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0] if args else kwargs["input"], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            leaf = self._index.get(id(weight))
            if leaf is not None:
                key = (leaf, self._calls[leaf])
                self._calls[leaf] += 1
                if torch.is_autocast_enabled(self._device_type):
                    # What autocast does to F.linear: every floating input (not fp64) in the autocast dtype.
                    dtype = torch.get_autocast_dtype(self._device_type)
                    x, weight, bias = (_cast(t, dtype) for t in (x, weight, bias))
                    with torch.autocast(self._device_type, enabled=False):
                        return _DeferredLinear.apply(x, weight, bias, self._stash, key)
                return _DeferredLinear.apply(x, weight, bias, self._stash, key)
        return func(*args, **kwargs)


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)
