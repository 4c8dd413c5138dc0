"""Accounting of a plan: host memory, SSD space and the planner's view of the model.

Functions of a built (or building) ``SnakeEngine``; they read its layouts and configs, allocate
nothing, and raise ValueError with the numbers when a plan does not fit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from snake_strategy.contract import batch_tensors
from snake_strategy.overlap import STEP_CHUNK_ELEMS, forward_split
from snake_strategy.planner import ModelShape

if TYPE_CHECKING:
    from snake_strategy.engine import SnakeEngine


def check_ssd_space(engine: SnakeEngine) -> None:
    if engine.ssd is None:
        return
    numel = sum(layout.numel for layout in engine.layouts)
    master_bytes = torch.empty((), dtype=engine.dtypes.master).element_size()
    compute_bytes = torch.empty((), dtype=engine.dtypes.compute).element_size()
    s = engine.storage
    needed = numel * (compute_bytes * s.weights.ssd + 2 * master_bytes * s.optimizer.ssd)
    needed += stored_gradient_elems(engine) * master_bytes * s.gradients.ssd
    if engine.dtypes.compute != engine.dtypes.master:
        needed += numel * master_bytes * s.master.ssd
    engine.ssd.check_free_space(int(needed), "weights, master weights, optimizer moments and gradients")


def host_bytes_plan(engine: SnakeEngine, checkpoint_bytes: int = 0) -> dict[str, int]:
    """Host memory the plan needs, by item (on a CPU device, "device" shares live in host memory too).

    ``checkpoint_bytes`` is one unit input of one micro-batch (known once a batch has been seen).
    """
    def size(dtype: torch.dtype) -> int:
        return torch.empty((), dtype=dtype).element_size()

    e_c, e_m = size(engine.dtypes.compute), size(engine.dtypes.master)
    on_cpu = engine.device.type == "cpu"
    s = engine.storage

    def in_memory(split) -> float:
        return split.host + (split.device if on_cpu else 0.0)

    numel = sum(layout.numel for layout in engine.layouts)
    unit = max(layout.numel for layout in engine.layouts)
    plan = {
        "weights": int(numel * e_c * in_memory(s.weights)),
        "optimizer_moments": int(2 * numel * e_m * in_memory(s.optimizer)),
        "gradients": int(stored_gradient_elems(engine) * e_m * in_memory(s.gradients)),
        # compute copy, 2 moments, gradient accumulator, and one transient gradient from autograd
        "nonlayer_params_and_state": sum(p.numel() for p in engine.nonlayer)
        * (e_c + 4 * e_m + (e_m if engine.dtypes.compute != engine.dtypes.master else 0)),
        # resident + prefetched units, two gradient accumulators (one filling, one with the worker),
        # the worker's chunk of master + moments + gradient
        "working_buffers": (1 + engine.schedule.prefetch_depth) * unit * e_c + 2 * unit * e_m
        + 4 * min(unit, STEP_CHUNK_ELEMS) * e_m,
    }
    if engine.dtypes.compute != engine.dtypes.master:
        plan["master"] = int(numel * e_m * in_memory(s.master))
    if checkpoint_bytes:
        num_micro = engine.schedule.num_micro_batches
        on_ssd = len(engine.activations._ssd_micro) if hasattr(engine, "activations") else 0
        plan["checkpoints"] = (num_micro - on_ssd) * len(engine.layouts) * checkpoint_bytes
        plan["activation_grads"] = num_micro * checkpoint_bytes
    return plan


def check_host_budget(engine: SnakeEngine, checkpoint_bytes: int = 0) -> None:
    budget = engine.storage.host_budget_bytes
    if budget is None:
        return
    plan = host_bytes_plan(engine, checkpoint_bytes)
    needed = sum(plan.values())
    if needed > budget:
        biggest = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sorted(plan.items(), key=lambda kv: -kv[1]))
        raise ValueError(
            f"the plan needs {needed / 2**30:.2f} GiB ({needed} bytes) of host memory but "
            f"storage.host_budget_bytes allows {budget / 2**30:.2f} GiB ({budget} bytes): {biggest}. "
            "To fit: move weights/optimizer/gradients/checkpoints shares to 'ssd', lower "
            "schedule.prefetch_depth, use smaller units (schedule.blocks_per_unit), fewer micro-batches "
            "or a smaller micro-batch, or raise storage.host_budget_bytes"
        )


def stored_gradient_elems(engine: SnakeEngine) -> int:
    """Elements the gradient store really holds: the horizontal schedule parks whole partial sums;
    the vertical one only each unit's forward part (nothing at alpha 0)."""
    if engine.schedule.kind == "horizontal":
        return sum(layout.numel for layout in engine.layouts)
    return sum(forward_split(layout.numel, engine._effective_alpha()) for layout in engine.layouts)


def model_shape(engine: SnakeEngine, micro_batch: Any, checkpoint_bytes: int) -> ModelShape:
    """The planner's view of this model for the given micro-batch (shapes only, no compute)."""
    block_ids = {id(p) for p in engine.module.blocks.parameters()}
    head = {id(m.weight): m.weight.numel() for m in engine.module.modules()
            if isinstance(m, nn.Linear) and id(m.weight) not in block_ids}
    tokens = max((t.numel() for t in batch_tensors(micro_batch) if not t.is_floating_point()), default=0)
    tokens = tokens or batch_tensors(micro_batch)[0].shape[0]
    return ModelShape(
        num_units=len(engine.units), params_per_unit=max(u.layout.numel for u in engine.units),
        nonlayer_params=sum(p.numel() for p in engine.nonlayer), head_params=sum(head.values()),
        tokens_per_micro=tokens, num_micro=engine.schedule.num_micro_batches, checkpoint_bytes=checkpoint_bytes,
        weight_bytes=torch.empty((), dtype=engine.dtypes.compute).element_size(),
        master_bytes=torch.empty((), dtype=engine.dtypes.master).element_size(),
    )


def largest_block_matrix(engine: SnakeEngine) -> tuple[int, int]:
    """(out, in) of the largest 2-D block parameter: the matmul shape the compute roof is probed at."""
    shapes = [s.shape for u in engine.units for s in u.layout.slots if len(s.shape) == 2]
    return tuple(max(shapes, key=lambda sh: sh[0] * sh[1])) if shapes else (1, 1)
