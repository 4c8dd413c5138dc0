"""The engine's helper threads compute on one intra-op thread; the main thread keeps its own count."""
from __future__ import annotations

import threading

import lightning as L
import pytest
import torch

from snake_strategy.engine.optimizer.worker_threads import single_threaded_ops
from snake_strategy.gpt import GPTConfig
from tests.helpers import run_snake


def test_one_thread_for_the_calling_thread_only():
    main_before = torch.get_num_threads()
    seen = {}

    def helper():
        seen["took"] = single_threaded_ops()
        seen["count"] = torch.get_num_threads()

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    if not seen["took"]:
        pytest.skip("torch is not built with an OpenMP runtime this process has loaded")
    assert seen["count"] == 1
    assert torch.get_num_threads() == main_before


def test_training_leaves_the_main_thread_count_alone(tmp_path):
    """The helpers start during setup and step while the main thread computes: its count must not move
    (it did with torch.set_num_threads in the helpers, and resumes stopped being bitwise)."""
    before = torch.get_num_threads()
    counts = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            counts.append(torch.get_num_threads())

    cfg = GPTConfig(vocab_size=64, context_len=16, d_model=32, num_heads=4, num_layers=3)
    run_snake(cfg, 3, 2, 2, "32-true", storage={"ssd_dir": str(tmp_path), "weights": "ssd", "optimizer": "ssd"},
              schedule_extra={"alpha": 0.25}, callbacks=[Watch()])
    assert counts == [before] * 3
