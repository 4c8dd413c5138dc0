"""Exposed I/O with the SSD as the bottleneck: a compare.py preset (vertical batched, fp32, weights and
Adam moments on the SSD) with every SSD chunk throttled to ``--ssd-mb-s`` per I/O thread through the
public ``EngineHooks.before_ssd_transfer`` (a slower disk, whatever the CPU load), so the optimizer's
state traffic and the next unit's weight reads really compete for the disk.

    python benchmarks/io_priority.py --preset io_bound --ssd-mb-s 150 --steps 4

Prints one JSON line: median s/step after the first step, the exposed I/O (``io_wait_s``: time the
compute thread waited for weights and checkpoints) and its share of the step, the optimizer wait. Run
it from two code trees (before/after a change, one process each) to compare them on the same load.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="io_bound")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ssd-mb-s", type=float, default=150.0, help="throttle per I/O thread (MB/s)")
    parser.add_argument("--ssd-root", default=None)
    args = parser.parse_args(argv)

    import lightning as L

    import snake_strategy
    from snake_strategy.engine import EngineHooks

    sys.path.insert(0, str(HERE))
    from common import step_probe
    from compare import PRESETS, _loader, preset_module

    p = PRESETS[args.preset]
    cfg, module = preset_module(p)
    micro, num_micro = p["micro_batch_size"], p["num_micro"]
    probe = step_probe()

    def throttle(direction: str, num_bytes: int) -> None:
        time.sleep(num_bytes / (args.ssd_mb_s * 1e6))  # on the I/O thread: the chunk takes this long

    with tempfile.TemporaryDirectory(dir=args.ssd_root) as ssd_dir:
        storage = snake_strategy.StorageConfig(ssd_dir=ssd_dir, weights="ssd", optimizer="ssd", gradients="host",
                                               checkpoints="host")
        schedule = snake_strategy.ScheduleConfig(kind="vertical", num_micro_batches=num_micro, alpha=0.25,
                                                 batched_forward=True, batched_backward=True)
        strategy = snake_strategy.GreedySnakeStrategy(storage=storage, schedule=schedule,
                                                      hooks=EngineHooks(before_ssd_transfer=throttle))
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe], precision="32-true")
        trainer.fit(module, train_dataloaders=_loader(cfg.context_len, micro * num_micro, args.steps))
    durations = probe.step_s[1:]
    timed = probe.stats[1:]
    io_wait = [s.io_wait_s for s in timed]
    print(json.dumps({"preset": args.preset, "ssd_mb_s_per_thread": args.ssd_mb_s,
                      "s_per_step": statistics.median(durations), "step_s": durations, "io_wait_s": io_wait,
                      "exposed_io_fraction": statistics.median(w / d for w, d in zip(io_wait, durations)),
                      "optimizer_wait_s": [s.optimizer_wait_s for s in timed],
                      "backpressure_wait_s": [s.backpressure_wait_s for s in timed]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
