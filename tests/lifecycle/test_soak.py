"""Soak (opt-in, `pytest --runslow tests/lifecycle/test_soak.py`): 300 steps of the tiny model with every state
on the SSD; after warm-up, RSS, open file descriptors and threads do not grow, and the SSD
directory is empty after teardown."""
import os
import resource
import threading

import lightning as L
import psutil
import pytest

import snake_strategy
from snake_strategy.data import TextDataModule
from snake_strategy.gpt import GPTModule

STEPS, WARMUP = 300, 30


class Sampler(L.Callback):
    def __init__(self):
        self.samples = []
        self.proc = psutil.Process()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.samples.append((self.proc.memory_info().rss, self.proc.num_fds(), threading.active_count(),
                             len(os.listdir(trainer.strategy.engine.ssd.path))))


@pytest.mark.slow
def test_soak_300_steps_ssd_all(tmp_path):
    ssd_dir = tmp_path / "ssd"
    strategy = snake_strategy.GreedySnakeStrategy(
        storage=dict(ssd_dir=str(ssd_dir), weights={"ssd": 1.0}, optimizer={"ssd": 1.0}, gradients={"ssd": 1.0},
                     checkpoints={"ssd": 1.0}, checkpoint_host_ends=1),
        schedule=dict(num_micro_batches=4, alpha=0.25))
    sampler = Sampler()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0, callbacks=[sampler])
    trainer.fit(GPTModule("tiny"), TextDataModule(context_len=64, micro_batch_size=2, num_micro_batches=4))
    after_warmup = sampler.samples[WARMUP:]
    rss = [s[0] for s in after_warmup]
    assert max(rss) - rss[0] < 32 * 2**20, (rss[0], max(rss))
    assert len({s[1] for s in after_warmup}) == 1, "open file descriptors changed"
    assert len({s[2] for s in after_warmup}) == 1, "thread count changed"
    assert [p for p in ssd_dir.rglob("*") if p.is_file()] == []
    print(f"soak: RSS {rss[0] / 2**20:.0f} -> {max(rss) / 2**20:.0f} MB max, fds {after_warmup[0][1]}, "
          f"threads {after_warmup[0][2]}, peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MB")
