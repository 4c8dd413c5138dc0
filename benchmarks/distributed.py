"""Data parallel on this machine: the r1 preset (GPT d=768 x 6, vocab 50257, ctx 128, micro-batch 2) with
1 rank x 8 micro-batches and 2 ranks x 4 micro-batches (Adam moments replicated, or partitioned: each
rank keeps half), the same global batch of 16 sequences, weights and optimizer state on the SSD tier,
alpha 0.25.

    python benchmarks/distributed.py                  # 1 rank, 2 ranks replicated, 2 ranks partitioned
    python benchmarks/distributed.py --steps 4 --runs 2:partitioned
    python benchmarks/distributed.py --steps 2 --runs 1,2:partitioned --checkpoint   # + a save at the end

Per rank and step (medians over the steps after the first): SSD bytes read and written (the engine's
counters and /proc/self/io), bytes sent by collectives (ring model, ``engine/parallel/reduce.py``), the
optimizer state on the rank's SSD (master + Adam moments), and the step time. ``--checkpoint``: a
directory checkpoint saved after the last step; per rank the bytes its save wrote (its shard with
partitioned state, checkpoint_shards.py) and the seconds ``trainer.save_checkpoint`` took. The ranks share this
machine's cores, so two ranks are not expected to be faster: the point is the per-rank bytes. Every run
is its own process group started by Lightning's launcher (``devices=N``). Lightning sets
OMP_NUM_THREADS=cores/N for the processes it launches (when unset) but not for a single process: run
with ``OMP_NUM_THREADS=1`` to compare step times at one intra-op thread per process (on a loaded
2-core machine, 2 spinning OpenMP threads made one rank 3-7x slower). Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import plot_ranks, results_dir  # noqa: E402
from compare import PRESETS, _proc_io  # noqa: E402  (the presets and the /proc I/O reader)

RESULTS = results_dir("distributed")


def run_worker(args) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    import snake_strategy
    from snake_strategy.data import ByteWindows, load_corpus
    from snake_strategy.gpt import GPTModule, preset as gpt_preset

    preset = PRESETS[args.preset]
    cfg = gpt_preset(preset["model"])
    cfg.context_len = preset["context_len"]
    global_micro = preset["num_micro"] * 2  # the global batch: 2 x the preset's micro-batches
    num_micro = global_micro // args.world
    per_rank = preset["micro_batch_size"] * num_micro
    marks, io_marks, stats = [], [], []

    class Timer(L.Callback):
        def on_train_start(self, trainer, pl_module):
            marks.append(time.perf_counter())
            io_marks.append(_proc_io())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks.append(time.perf_counter())
            io_marks.append(_proc_io())
            stats.append(trainer.strategy.engine.last_step)
            self.layout = trainer.strategy.engine.storage_layout()
            engine = trainer.strategy.engine  # the files are removed at teardown: measure them now
            self.files_bytes = sum(os.path.getsize(os.path.join(engine.ssd.path, f)) for f in engine.ssd_files())

    storage = snake_strategy.StorageConfig(ssd_dir=args.ssd_dir, weights={"ssd": 1.0}, optimizer={"ssd": 1.0},
                                           gradients={"host": 1.0}, checkpoints={"host": 1.0})
    schedule = snake_strategy.ScheduleConfig(kind="vertical", num_micro_batches=num_micro, alpha=0.25)
    strategy = snake_strategy.GreedySnakeStrategy(storage=storage, schedule=schedule,
                                                  shard_optimizer_state=args.partitioned)
    timer = Timer()
    saves = []  # (bytes this rank's unit files took, s) of its checkpoint_save phase
    strategy.progress.listeners.append(
        lambda e: saves.append((e.done_bytes, e.elapsed_s)) if e.phase == "checkpoint_save" and e.stage == "end" else None)

    class SaveAtEnd(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if args.checkpoint and trainer.global_step == args.steps:
                start = time.perf_counter()
                trainer.save_checkpoint(args.ssd_dir.rstrip("/") + "-checkpoint.ckpt")  # the same name on every rank
                self.save_s = time.perf_counter() - start

    save_at_end = SaveAtEnd()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.world, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[timer, save_at_end], precision="32-true")
    windows = ByteWindows(load_corpus("stdlib"), cfg.context_len)
    data = Subset(windows, range(per_rank * args.world * args.steps))
    sampler = (DistributedSampler(data, num_replicas=args.world, rank=trainer.global_rank, shuffle=False)
               if args.world > 1 else None)
    torch.manual_seed(0)
    module = GPTModule(cfg, learning_rate=3e-4)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=per_rank, sampler=sampler))

    def per_step(values):
        return int(statistics.median(values[1:])) if len(values) > 1 else int(values[0])

    traffic = [s.step_traffic() for s in stats]

    def total(pred):
        return per_step([sum(v for k, v in t.items() if pred(k)) for t in traffic])

    layout = timer.layout
    result = dict(
        world=args.world, rank=trainer.global_rank, num_micro=num_micro, samples_per_rank_step=per_rank,
        torch_threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        step_s=[b - a for a, b in zip(marks, marks[1:])],
        ssd_read_bytes_per_step=total(lambda k: k.startswith("ssd/") and k.endswith("/read")),
        ssd_write_bytes_per_step=total(lambda k: k.startswith("ssd/") and k.endswith("/write")),
        proc_read_bytes_per_step=per_step([b[0] - a[0] for a, b in zip(io_marks, io_marks[1:])]),
        proc_write_bytes_per_step=per_step([b[1] - a[1] for a, b in zip(io_marks, io_marks[1:])]),
        collective_sent_bytes_per_step=total(lambda k: k.startswith("net/")),
        optimizer_state_ssd_bytes=sum(u["exp_avg_ssd"] + u["exp_avg_sq_ssd"] + u["master_ssd"] for u in layout),
        ssd_files_bytes=timer.files_bytes,  # every state file of this rank (weights, moments, gradients)
        traffic_per_step=traffic[len(traffic) // 2],
    )
    if args.checkpoint:  # the unit files this rank wrote (rank 0 also writes nonlayer.pt and meta.pt)
        result.update(checkpoint_unit_bytes=saves[-1][0], checkpoint_units_s=saves[-1][1],
                      checkpoint_save_s=save_at_end.save_s)
    result["s_per_step"] = statistics.median(result["step_s"][1:])
    Path(args.json_out).mkdir(parents=True, exist_ok=True)
    (Path(args.json_out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, indent=1))


def _run(world: int, partitioned: bool, args) -> list[dict]:
    out = tempfile.mkdtemp(prefix=f"dp-bench-{world}-")
    ssd = tempfile.mkdtemp(prefix=f"dp-ssd-{world}-", dir=args.ssd_root)
    cmd = [sys.executable, __file__, "--worker", "--world", str(world), "--steps", str(args.steps),
           "--preset", args.preset, "--json-out", out, "--ssd-dir", ssd] + (["--partitioned"] if partitioned else []) \
        + (["--checkpoint"] if args.checkpoint else [])
    print(f"running {world} rank(s) ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"{world} rank(s) failed:\n{proc.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    shutil.rmtree(ssd.rstrip("/") + "-checkpoint.ckpt", ignore_errors=True)
    for r in ranks:
        print(f"  rank {r['rank']}/{world}: {r['s_per_step']:.2f} s/step, SSD read {r['ssd_read_bytes_per_step'] / 1e6:.0f} MB"
              f" write {r['ssd_write_bytes_per_step'] / 1e6:.0f} MB, sent {r['collective_sent_bytes_per_step'] / 1e6:.0f} MB"
              f" per step, optimizer state on SSD {r['optimizer_state_ssd_bytes'] / 1e6:.0f} MB"
              + (f"; checkpoint: unit files {r['checkpoint_unit_bytes'] / 1e6:.0f} MB in {r['checkpoint_units_s']:.1f} s, "
                 f"save {r['checkpoint_save_s']:.1f} s" if "checkpoint_save_s" in r else ""), flush=True)
    return ranks


def _plot(report: dict, path: Path) -> None:
    keys = [("ssd_read_bytes_per_step", "SSD read / step"), ("ssd_write_bytes_per_step", "SSD write / step"),
            ("collective_sent_bytes_per_step", "sent by collectives / step"),
            ("optimizer_state_ssd_bytes", "optimizer state on SSD")]
    plot_ranks(report, path, keys, "MB per rank",
               f"greedysnake data parallel, {report['preset']} preset, global batch {report['global_batch']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="r1", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--runs", default="1,2:replicated,2:partitioned",
                   help="comma-separated runs: WORLD[:replicated|:partitioned] (the optimizer state across ranks)")
    p.add_argument("--partitioned", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", action="store_true", help="save a directory checkpoint after the last step")
    p.add_argument("--ssd-root", default=None, help="where the SSD directories go (default: the temp dir)")
    p.add_argument("--timeout-s", type=int, default=3600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    p.add_argument("--ssd-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    preset = PRESETS[args.preset]
    runs = {}
    for spec in args.runs.split(","):
        world, _, mode = spec.partition(":")
        name = f"{world} rank{'s' if int(world) > 1 else ''}" + (f" {mode}" if mode else "")
        runs[name] = _run(int(world), mode == "partitioned", args)
    report = dict(preset=args.preset, steps=args.steps, global_batch=preset["micro_batch_size"] * preset["num_micro"] * 2,
                  machine="2 shared CPU cores (other jobs running), gloo on 127.0.0.1", runs=runs,
                  deepspeed="not installed in this environment: no ZeRO-Infinity 2-rank run")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.checkpoint:  # a run of its own: keep the step benchmark's files as they are
        (RESULTS / f"{args.preset}_checkpoint.json").write_text(json.dumps(report, indent=1))
        print(f"wrote {RESULTS / f'{args.preset}_checkpoint.json'}")
        return 0
    (RESULTS / f"{args.preset}.json").write_text(json.dumps(report, indent=1))
    _plot(report, RESULTS / f"{args.preset}.png")
    print(f"wrote {RESULTS / f'{args.preset}.json'} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
