"""One unit's forward and backward timed before step 1: the model's own compute rates at the run's shapes
and precision, for the prediction the planner makes before the first step (planning/run_prediction.py for a
fit, snake_strategy/dry_run.py for a dry run; both time through ``time_forward_backward`` and
``time_nonlayer``).

The forward and the backward are timed apart: per FLOP they run at different speeds (a weight gradient's
inner dimension is the pass's token count, small next to the model's width at short sequences; attention's
backward does more than twice its forward), and a step runs them in different proportions (a recompute is a
second forward, a kept graph saves it). The first run also records the forward graph's saved
bytes as ``KeptGraphs`` would hold them: how many units "auto" will keep.

On a CPU the pass's tensors come from fresh pages (the engine returns every large free to the OS,
storage/aligned.py), and right after a fit's setup freed the materialization's buffers, this VM served fresh
pages at a sixth of their settled speed for the first ~1.25 GB touched (256 MB pieces: 0.39 s each, then
0.06 s; sleeping 4 s changed nothing, touching did): the first three timed runs of gpt_1b's unit were 35%
slower than the rest. ``settle_fresh_memory`` touches fresh pieces until one costs no more than
``SETTLED_FRESH_OVER_REFILL`` times refilling it, so the runs time the model, not the page allocator's state
(the first step would pay the same cost).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from snake_strategy.contract import batch_tensors, micro_batch_tokens, unpack_pre_stage
from snake_strategy.engine.step.kept_graphs import KeptGraphs

RUNS = 3  # the first run also warms the kernels and the allocator's caches; the fastest counts
# The non-layer pass runs after the unit's runs warmed the process, again only while one run is short: a large
# model's is long (gpt_1b: 3.8 s over 512 tokens, as long as four unit passes; three runs made the timing 17 s,
# 60% of a step), a small model's lasts milliseconds, where one descheduling of a loaded machine would be the
# whole measurement (the fastest run counts).
NONLAYER_MAX_RUNS = 3
NONLAYER_REPEAT_UNDER_S = 0.25
# A pass of more tokens times only whole micro-batches up to this many (at least one): the matmuls' rates have
# settled by then (gpt_1b: 197 GFLOP/s forward at 512 tokens) and the timing of gpt_4b's 4,096-token task
# would take 50 s; the forward graph's bytes, linear in the tokens, are scaled to the whole task.
TIMED_TOKENS = 1024

log = logging.getLogger(__name__)


# Fresh-memory settling: pieces of up to 256 MiB, each allocated, filled, refilled and freed (one piece alive at
# a time), until filling fresh pages costs at most this many refills of them (settled here: 6-9x; unsettled:
# ~50x), touching at most SETTLE_WEIGHT_MULTIPLE times the unit's weight bytes (the pass's own footprint is a
# few times them; gpt_1b's 201 MB unit needed 1.25 GB) and at most SETTLE_MAX_BYTES: a small model's pass
# settles in one small piece instead of paying 256 MiB in every fit.
SETTLE_PIECE_ELEMS = 64 * 2**20
SETTLED_FRESH_OVER_REFILL = 15.0
SETTLE_WEIGHT_MULTIPLE = 8
SETTLE_MAX_BYTES = 4 * 2**30


def settle_fresh_memory(max_bytes: int) -> None:
    """Touch fresh host memory, at most ``max_bytes`` of it, until the kernel serves it at its settled cost
    (see the module docstring)."""
    piece_elems = max(1, min(SETTLE_PIECE_ELEMS, max_bytes // 4))
    pieces = max(1, max_bytes // (4 * piece_elems))
    for touched in range(1, pieces + 1):
        piece_start_s = time.perf_counter()
        piece = torch.ones(piece_elems)
        fresh_s = time.perf_counter() - piece_start_s
        refill_start_s = time.perf_counter()
        piece.fill_(2.0)
        refill_s = time.perf_counter() - refill_start_s
        del piece
        if fresh_s <= SETTLED_FRESH_OVER_REFILL * refill_s:
            break
    log.debug("fresh memory: %d of at most %d pieces of %d MiB touched, the last %.1fx its refill (settled: "
              "<= %.0fx)", touched, pieces, piece_elems * 4 // 2**20, fresh_s / max(refill_s, 1e-9),
              SETTLED_FRESH_OVER_REFILL)


def timed_task(micro_batches: list[Any], batched_forward: bool) -> tuple[int, int]:
    """(how many of ``micro_batches`` the timing runs, how many one task runs): a task is every micro-batch under
    batched passes, else one; the timing runs whole micro-batches of it up to ``TIMED_TOKENS``, at least one.
    The fit and the dry run time the same micro-batches this way."""
    task = len(micro_batches) if batched_forward else 1
    return max(1, min(task, TIMED_TOKENS // max(1, micro_batch_tokens(micro_batches[0])))), task


def time_forward_backward(forward: Callable[[Tensor, list[Tensor]], Tensor], hidden: Tensor, leaves: list[Tensor],
                          num_trainable: int, kept: KeptGraphs, autocast: Callable, device: torch.device
                          ) -> tuple[float, float, int]:
    """(forward s, backward s, forward graph bytes) of ``forward(x, outputs)`` over ``hidden``: the input
    gradient and the gradients of the first ``num_trainable`` ``leaves``, seeded with ones. Call it under
    the RNG fork and eval mode the caller wants (nothing here draws random numbers)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cpu":
        weight_bytes = sum(leaf.numel() * leaf.element_size() for leaf in leaves)
        settle_fresh_memory(min(SETTLE_MAX_BYTES, SETTLE_WEIGHT_MULTIPLE * weight_bytes))
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
        forward_s, backward_s = forward_done_s - start_s, time.perf_counter() - forward_done_s
        log.debug("unit timing run %d: forward %.3f s, backward %.3f s", run, forward_s, backward_s)
        best_forward_s, best_backward_s = min(best_forward_s, forward_s), min(best_backward_s, backward_s)
        del x, y, outputs, roots
    return best_forward_s, best_backward_s, graph_bytes


class _NonLayerPass(nn.Module):
    """The non-layer work of one task as ``functional_call`` runs it: ``pre_stage`` of each micro-batch, and
    ``post_stage`` on a leaf of the hidden state (the blocks in between are timed apart). The loss is not
    called: the contract does not make ``compute_loss`` free of side effects (a counter, a metric), and its
    cost is small next to the head's (gpt_1b: the softmax over 50257 logits, ~0.3 of 2.9 s)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = module

    def forward(self, micro_batches: list[Any]) -> tuple[Tensor, Tensor, list[Tensor]]:
        hiddens = [unpack_pre_stage(self.inner.pre_stage(b))[0] for b in micro_batches]
        hidden = torch.cat(hiddens) if len(hiddens) > 1 else hiddens[0]
        x = hidden.detach().requires_grad_(True)
        return hidden, x, [t for t in batch_tensors(self.inner.post_stage(x)) if t.requires_grad]


def time_nonlayer(module: nn.Module, micro_batches: list[Any], tensors: dict[str, Tensor], autocast: Callable,
                  device: torch.device) -> float:
    """Seconds of the non-layer work over ``micro_batches`` (the embedding's forward and backward, the head's
    forward and backward, seeded with ones), run again while a run is short (``NONLAYER_MAX_RUNS``,
    ``NONLAYER_REPEAT_UNDER_S``; the fastest counts), with the
    non-layer parameters and buffers ``tensors`` (by name, as ``module.named_parameters`` names them; the
    trainable ones require grad): the part of a step the blocks' FLOPs do not count (the embedding's dense
    gradient, the head at its own shapes)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    wrapper = _NonLayerPass(module)
    named = {f"inner.{name}": t for name, t in tensors.items()}
    trainable = [t for t in tensors.values() if t.requires_grad]
    best_s = float("inf")
    for _ in range(NONLAYER_MAX_RUNS):
        sync()
        start_s = time.perf_counter()
        with torch.enable_grad(), autocast():
            hidden, x, outputs = torch.func.functional_call(wrapper, named, (micro_batches,))
            grads = (torch.autograd.grad(outputs, [x, *trainable], [torch.ones_like(o) for o in outputs],
                                         allow_unused=True) if outputs else (None,))
            if hidden.requires_grad and trainable and grads[0] is not None:  # the embedding's backward
                torch.autograd.grad(hidden, trainable, grads[0], allow_unused=True)
        sync()
        best_s = min(best_s, time.perf_counter() - start_s)
        del hidden, x, outputs, grads
        if best_s >= NONLAYER_REPEAT_UNDER_S:
            break
    return best_s
