"""One unit's forward and backward timed before step 1: the model's own compute rates at the run's shapes
and precision, for the prediction the planner makes before the first step (planning/run_prediction.py for a
fit, snake_strategy/dry_run.py for a dry run; both time through ``time_forward_backward``).

The forward and the backward are timed apart: per FLOP they run at different speeds (a weight gradient's
inner dimension is the pass's token count, small next to the model's width at short sequences; attention's
backward does more than twice its forward), and a step runs them in different proportions (a recompute is a
second forward, a kept graph saves it). The first of the two runs also records the forward graph's saved
bytes as ``KeptGraphs`` would hold them: how many units "auto" will keep.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from snake_strategy.engine.step.kept_graphs import KeptGraphs

RUNS = 3  # the first run warms the allocator and the kernels (measured at gpt_1b: 0.41, 0.32, 0.32, 0.30 s
# forward): the fastest counts
# A pass of more tokens times only whole micro-batches up to this many (at least one): the matmuls' rates have
# settled by then (gpt_1b: 197 GFLOP/s forward at 512 tokens) and the timing of gpt_4b's 4,096-token task
# would take 50 s; the forward graph's bytes, linear in the tokens, are scaled to the whole task.
TIMED_TOKENS = 1024


def timed_micro_batches(num_micro: int, tokens_per_micro: int) -> int:
    """How many of a task's ``num_micro`` micro-batches the timing runs (``TIMED_TOKENS``)."""
    return max(1, min(num_micro, TIMED_TOKENS // max(1, tokens_per_micro)))


def time_forward_backward(forward: Callable[[Tensor, list[Tensor]], Tensor], hidden: Tensor, leaves: list[Tensor],
                          num_trainable: int, kept: KeptGraphs, autocast: Callable, device: torch.device
                          ) -> tuple[float, float, int]:
    """(forward s, backward s, forward graph bytes) of ``forward(x, outputs)`` over ``hidden``: the input
    gradient and the gradients of the first ``num_trainable`` ``leaves``, seeded with ones. Call it under
    the RNG fork and eval mode the caller wants (nothing here draws random numbers)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    trainable = leaves[:num_trainable]
    best_forward_s = best_backward_s = float("inf")
    graph_bytes = 0
    for run in range(RUNS):
        x = hidden.detach().requires_grad_(True)
        sync()
        start_s = time.perf_counter()
        with kept.recording(leaves) as rec, autocast():  # saves weights by reference, as a kept graph does
            outputs: list[Tensor] = []
            y = forward(x, outputs)
            roots = [r for r in (y, *outputs) if r.requires_grad]
        sync()
        forward_done_s = time.perf_counter()
        if run == 0:
            graph_bytes = rec.num_bytes
        with kept.unpacking(leaves), autocast():
            if roots:
                torch.autograd.grad(roots, [x, *trainable], [torch.ones_like(r) for r in roots], allow_unused=True)
        sync()
        best_forward_s = min(best_forward_s, forward_done_s - start_s)
        best_backward_s = min(best_backward_s, time.perf_counter() - forward_done_s)
        del x, y, outputs, roots
    return best_forward_s, best_backward_s, graph_bytes
