"""The overlap really overlaps: weight prefetches finish before compute needs them, observed through the
engine's public trace. Compute is made slow deterministically (blocks that sleep), the SSD a little slow
through the public test hook, so the outcome does not depend on the machine's load."""
from __future__ import annotations

import time

import lightning as L
import torch
from torch import nn

from snake_strategy import EngineHooks
from tests.helpers import StackModule, fit_snake, token_loader

COMPUTE_S = 0.04  # per block call
SSD_DELAY_S = 0.002  # per 4 MiB I/O chunk (a unit here is one chunk)


class SleepyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        time.sleep(COMPUTE_S)  # stands for a big matmul: compute the prefetch can hide behind
        return x + torch.tanh(self.lin(x))


def SleepyStack(width=64, depth=6) -> StackModule:
    return StackModule(lambda i: SleepyBlock(width), width, depth, vocab=32)


class Fetches(L.Callback):
    def __init__(self):
        self.steps, self.stats = [], []

    def on_train_batch_end(self, trainer, *args):
        self.steps.append(list(trainer.strategy.engine.trace.last.fetches))
        self.stats.append(trainer.strategy.engine.last_step.as_dict())


def _run(tmp_path, prefetch_depth):
    rec = Fetches()
    fit_snake(SleepyStack(), token_loader(2 * 2, 2, seq_len=8, vocab=32), steps=2,
              storage={"ssd_dir": str(tmp_path / f"ssd{prefetch_depth}"), "weights": "ssd", "optimizer": "ssd"},
              schedule={"kind": "vertical", "num_micro_batches": 2, "prefetch_depth": prefetch_depth},
              hooks=EngineHooks(before_ssd_transfer=lambda direction, n: time.sleep(SSD_DELAY_S)), callbacks=[rec],
              record=None, seed=None)
    return rec


def test_prefetched_weights_are_ready_before_compute_needs_them(tmp_path):
    rec = _run(tmp_path, prefetch_depth=1)
    for fetches, stats in zip(rec.steps, rec.stats):
        assert len(fetches) == 2 * 6 - 1  # the vertical schedule's weight fetches
        # Only the step's first unit is fetched on demand; every later one was prefetched ...
        assert [f.prefetched for f in fetches] == [False] + [True] * (len(fetches) - 1)
        # ... and was complete before its task asked for it (compute per unit >> one fetch).
        late = [(f.unit, f.exposed_s) for f in fetches[1:] if f.exposed_s > 0]
        assert late == [], late
        # Exposed I/O is a small, stated fraction of the step.
        assert stats["io_wait_s"] <= 0.1 * stats["train_s"], stats


def test_without_prefetch_every_fetch_is_exposed(tmp_path):
    rec = _run(tmp_path, prefetch_depth=0)
    for fetches in rec.steps:
        assert not any(f.prefetched for f in fetches)
        assert all(f.done_s > f.needed_s for f in fetches)  # compute waited for each one
