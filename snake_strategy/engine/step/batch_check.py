"""The first step's check that a batched pass gives each sample what its own micro-batch would.

A batched pass (``schedule.batched_forward`` / ``batched_backward``) runs a unit once over all its
micro-batches concatenated. That equals running it per micro-batch only when the blocks treat samples
independently: a block that computes statistics over the batch dim (``h - h.mean(0)``, BatchNorm by
hand, attention across samples) sees 8 samples in the batched forward and 2 in a per-micro-batch
recompute, and trains parameters that match neither plain accumulation nor one big batch. Nothing in a
block's code says which kind it is, so the runner asks once: the run's first batched task runs its unit
both ways (two extra forwards of one unit, once per run, before any update) and the difference decides.

Both runs use the blocks in eval mode (dropout off) under a forked RNG stream, so the step's own
dropout masks are unchanged. The tolerance covers summation-order noise only (measured:
a d=768 GPT block pair differs by 2.7e-16 in fp64, 1.4e-7 in fp32, 1.1e-3 under bf16
autocast, relative to the largest output value); a mixing block differs by O(0.1) (0.27 for the
``h + tanh(W (h - h.mean(0)))`` block of the tests).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)


def batching_tolerance(compute: torch.dtype, autocast: torch.dtype | None, device: torch.device) -> float:
    """Largest relative difference (max |batched - per micro-batch| / max |per micro-batch|) that is
    summation order, not mixing: it follows the precision the unit's products run in."""
    if autocast is not None or compute in (torch.float16, torch.bfloat16):
        return 5e-2  # 16-bit products: one rounding of a bf16 output is 4e-3 relative
    if compute == torch.float64:
        return 1e-8
    reduced = torch.get_float32_matmul_precision() != "highest" or (
        device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    return 1e-2 if reduced else 1e-4  # TF32 / bf16-internal fp32 products carry ~1e-3 relative noise


@contextlib.contextmanager
def eval_mode(blocks: list[nn.Module]):
    modes = [(m, m.training) for b in blocks for m in b.modules()]
    try:
        for b in blocks:
            b.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training


def check_batching(forward: Callable[[Tensor, dict[str, Any]], Tensor], blocks: list[nn.Module],
                   xs: list[Tensor], sides: list[dict[str, Any]], batched_side: dict[str, Any], unit: int,
                   tolerance: float, settings: str, device: torch.device) -> None:
    """Run ``forward`` over ``xs`` concatenated and over each alone; ValueError when they differ by more
    than ``tolerance`` (relative). ``settings`` names what turned batching on, for the message."""
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad(), eval_mode(blocks), \
            torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        start = torch.get_rng_state()
        batched = forward(torch.cat(xs), batched_side)
        if not torch.equal(start, torch.get_rng_state()):
            # Random even in eval mode (functional dropout with training=True): the two runs would draw
            # other masks, so their difference says nothing. Left unchecked, said once.
            log.warning("unit %d draws random numbers in eval mode: the check that batched passes give each "
                        "sample its own micro-batch's result was skipped", unit)
            return
        each = torch.cat([forward(x, side) for x, side in zip(xs, sides)])
    scale = each.detach().abs().max().double()
    if not bool(torch.isfinite(scale)) or not bool(torch.isfinite(batched).all()):
        return  # a non-finite output: the step's own checks (loss scaling, NaN) deal with it
    diff = (batched.double() - each.double()).abs().max()
    relative = float(diff / scale) if scale > 0 else float(diff)
    if relative > tolerance:
        first = blocks[0]
        raise ValueError(
            f"{settings}: running unit {unit} once over its {len(xs)} micro-batches concatenated changes its "
            f"output by {relative:.2g} (relative to its largest value; summation order alone stays under "
            f"{tolerance:.0e} in this precision) compared with running it per micro-batch. Its blocks "
            f"({type(first).__name__}) mix samples (statistics over the batch dim, e.g. `h - h.mean(0)` or "
            "attention across samples), so a batched pass would train other parameters than plain gradient "
            "accumulation. Refused before any update; set schedule.batched_forward=False and "
            "schedule.batched_backward=False (and do not set LayeredModule.independent_samples=True)")
