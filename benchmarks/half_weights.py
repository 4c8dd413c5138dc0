"""Half-precision weight storage on and off, one subprocess each, on a compare.py preset in bf16-mixed
(weights, master and moments on the SSD, vertical batched):

    python benchmarks/half_weights.py --preset io_bound --steps 4

Prints one JSON line per setting: median s/step (after the first step), the exposed I/O wait, and one
steady step's bytes from the engine's public counters (SSD reads/writes, weight fetch reads, the
host tail's reads). Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(preset_name: str, half: bool, steps: int, ssd_root: str | None) -> dict:
    import lightning as L

    import snake_strategy
    from snake_strategy import GreedySnakePrecision

    sys.path.insert(0, str(HERE))
    from common import ssd_bytes, step_probe
    from compare import PRESETS, _loader, preset_module

    p = PRESETS[preset_name]
    cfg, module = preset_module(p)
    micro, num_micro = p["micro_batch_size"], p["num_micro"]
    probe = step_probe()

    with tempfile.TemporaryDirectory(dir=ssd_root) as ssd_dir:
        storage = snake_strategy.StorageConfig(ssd_dir=ssd_dir, weights="ssd", master="ssd", optimizer="ssd",
                                               gradients="host", checkpoints="host")
        schedule = snake_strategy.ScheduleConfig(kind="vertical", num_micro_batches=num_micro, alpha=0.25,
                                                 batched_forward=True, batched_backward=True)
        strategy = snake_strategy.GreedySnakeStrategy(
            storage=storage, schedule=schedule,
            precision_plugin=GreedySnakePrecision("bf16-mixed", half_weights=half))
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe])
        trainer.fit(module, train_dataloaders=_loader(cfg.context_len, micro * num_micro, steps))
    durations = probe.step_s[1:]
    last = probe.traffic[-1]  # a steady step: the previous step's forward parts are inside it
    return {"half_weights": half, "preset": preset_name, "s_per_step": statistics.median(durations),
            "step_s": durations, "io_wait_s": [s.io_wait_s for s in probe.stats[1:]],
            "ssd_weight_read_bytes": last.get("ssd/weights/read", 0),
            "ssd_read_bytes": ssd_bytes(last, "read"), "ssd_write_bytes": ssd_bytes(last, "write"),
            "host_weight_read_bytes": last.get("host/weights/read", 0), "traffic": last}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="io_bound")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ssd-root", default=None)
    parser.add_argument("--worker", choices=["half", "full"], default=None)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.preset, args.worker == "half", args.steps, args.ssd_root)), flush=True)
        return 0
    for setting in ("half", "full"):
        cmd = [sys.executable, __file__, "--worker", setting, "--preset", args.preset, "--steps", str(args.steps)]
        if args.ssd_root:
            cmd += ["--ssd-root", args.ssd_root]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(proc.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
