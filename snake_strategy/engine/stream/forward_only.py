"""Forward-only passes over streamed units: evaluation, validation inside fit, and generation.

Both engines keep each unit's compute weights in its tiers and a ``WeightStreamer`` that fetches them.
A forward-only pass reads every unit once, in order, and runs all the micro-batches of the batch through
it before the next unit (the vertical order of training), the next units prefetched meanwhile. Nothing
is written to any tier. The batch is cut into up to ``num_micro_batches`` micro-batches, as training
cuts its batches, so no unit ever holds more than one micro-batch's temporaries: validation inside
``fit`` stays within the memory the training plan counted (one micro-batch's workspace).

Outputs equal an unsplit forward when the blocks treat samples independently (the contract's rule for
batched passes; no BatchNorm): ``post_stage`` runs once on the concatenated hidden states.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from snake_strategy.contract import (batch_size, check_block_output, reads_block_outputs, slice_batch,
                                     unpack_pre_stage)
from snake_strategy.schedule import FORWARD, Task


def split_eval_batch(batch: Any, num_micro: int) -> list[Any]:
    """``batch`` as up to ``num_micro`` micro-batches of equal size (the last may be smaller)."""
    size = batch_size(batch)
    num = max(1, min(num_micro, size))
    step = -(-size // num)
    return [slice_batch(batch, lo, min(lo + step, size)) for lo in range(0, size, step)]


def stream_blocks(units: Sequence[Any], weights: Any, hiddens: list[Tensor], sides: list[dict[str, Any]],
                  trace: Any = None, check: Callable[[Any, int], Any] = check_block_output,
                  outputs: list[list[Tensor]] | None = None) -> list[Tensor]:
    """Every unit's blocks over each micro-batch (``hiddens[m]`` with side inputs ``sides[m]``), unit by
    unit: each unit's weights are fetched once (``weights``: a ``WeightStreamer``), read-only. ``check``
    validates each block's return value; with ``outputs`` (one list per micro-batch) every block's output
    for the loss is appended to its micro-batch's list, in block order.

    Runs outside inference mode (Lightning evaluates under it): a pooled weight buffer first allocated in
    inference mode would be an inference tensor that the prefetch thread (outside it) cannot fill."""
    tasks = [Task(FORWARD, u, tuple(range(len(hiddens)))) for u in range(len(units))]
    try:
        with torch.inference_mode(False), torch.no_grad():
            for u, task in enumerate(tasks):
                weights.prefetch_after(tasks, u)
                if trace is not None:
                    trace.task(task)
                flat, layout = weights.flat(u), units[u].layout
                hiddens = [layout.forward(flat, h, side, check, None if outputs is None else outputs[m])
                           for m, (h, side) in enumerate(zip(hiddens, sides))]
        return hiddens
    finally:
        weights.drain()


def streamed_forward(module: Any, batch: Any, num_micro: int, device: torch.device, autocast_dtype: torch.dtype | None,
                     run_blocks: Callable[..., list[Tensor]]) -> tuple[Tensor, list[Tensor]]:
    """``(post_stage outputs, block outputs)`` of the whole batch: ``pre_stage`` per micro-batch,
    ``run_blocks`` (an engine's ``stream_blocks``) over all of them, ``post_stage`` once on the
    concatenation, as a plain forward computes it. Block outputs (a loss that reads them, else an empty
    list): each block's, concatenated over the micro-batches."""
    micro_batches = split_eval_batch(batch, num_micro)
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    outputs: list[list[Tensor]] | None = [[] for _ in micro_batches] if reads_block_outputs(module) else None
    with torch.inference_mode(False), torch.no_grad(), autocast:
        staged = [unpack_pre_stage(module.pre_stage(mb)) for mb in micro_batches]
        hiddens = run_blocks([h for h, _ in staged], [side for _, side in staged], outputs)
        block_outputs = [] if outputs is None else [_cat(list(per_block)) for per_block in zip(*outputs)]
        return module.post_stage(_cat(hiddens)), block_outputs


def _cat(tensors: list[Tensor]) -> Tensor:
    return torch.cat(tensors) if len(tensors) > 1 else tensors[0]
