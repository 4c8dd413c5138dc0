"""Side-by-side benchmark: plain Lightning, greedysnake horizontal, greedysnake vertical, and DeepSpeed
ZeRO-Infinity, on one model and global batch, one after the other in one command.

    python benchmarks/compare.py --preset r1          # GPT d=768 x 6, vocab 50257, ctx 128, 2 x M=4
    python benchmarks/compare.py --preset io_bound    # GPT d=1024 x 12, byte vocab, ctx 32, 1 x M=8
    python benchmarks/compare.py --preset io_bound --sweep 2,4,8,16   # throughput vs tokens per step

Every system runs in its own subprocess (clean peak RSS, no shared state), with weights and optimizer
state on the SSD where the system offloads. Writes ``benchmarks/results/compare/<preset>.json`` and a PNG plot,
and prints a table. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import peak_rss_bytes, ssd_bytes

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "compare"

PRESETS = {
    "r1": dict(model="r1", context_len=128, micro_batch_size=2, num_micro=4, steps=6),
    "io_bound": dict(model="io_bound", context_len=32, micro_batch_size=1, num_micro=8, steps=5),
    "tiny": dict(model="tiny", context_len=64, micro_batch_size=2, num_micro=4, steps=6),
    # deeper and narrower than r1: many small units, where per-unit overheads and turning points add up
    "deep": dict(model="small", context_len=64, micro_batch_size=2, num_micro=4, steps=6,
                 overrides=dict(d_model=512, num_layers=24, num_heads=8)),
}
# "auto": the default settings (schedule kind "auto": the planner's choice), on the same SSD placement as
# the others; "split": vertical with LayerPipe's split backward (unbatched forward).
SYSTEMS = ("plain", "horizontal", "vertical", "vertical_batched", "split", "auto", "zero_infinity")


# ---------------------------------------------------------------------- worker side (one system)
def _proc_io() -> tuple[int, int]:
    """Bytes this process read from / wrote to block devices (O_DIRECT I/O included)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _loader(context_len: int, batch_size: int, num_batches: int):
    from torch.utils.data import DataLoader, Subset

    from snake_strategy.data import ByteWindows, load_corpus

    windows = ByteWindows(load_corpus("stdlib"), context_len)
    return DataLoader(Subset(windows, range(batch_size * num_batches)), batch_size=batch_size, shuffle=False)


def preset_module(preset: dict):
    """A preset's GPT config (its overrides applied) and a module built from it under seed 0: the model
    every system and every benchmark built on these presets trains."""
    import torch

    from snake_strategy.gpt import GPTModule, preset as gpt_preset

    cfg = dataclasses.replace(gpt_preset(preset["model"]), **preset.get("overrides", {}))
    cfg.context_len = preset["context_len"]
    torch.manual_seed(0)
    return cfg, GPTModule(cfg, learning_rate=3e-4)


def run_worker(system: str, preset: dict, ssd_dir: str, alpha: float, batched_backward: bool) -> dict:
    import lightning as L

    import snake_strategy

    cfg, module = preset_module(preset)
    micro, num_micro, steps = preset["micro_batch_size"], preset["num_micro"], preset["steps"]
    step_marks: list[float] = []
    stats: list = []  # StepStats of each step
    io_marks: list[tuple[int, int]] = []

    class Timer(L.Callback):
        def on_train_start(self, trainer, pl_module):
            step_marks.append(time.perf_counter())
            io_marks.append(_proc_io())
            self.seen = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self.seen:  # an optimizer step just finished
                self.seen = trainer.global_step
                step_marks.append(time.perf_counter())
                io_marks.append(_proc_io())
                engine = getattr(trainer.strategy, "engine", None)
                if engine is not None:
                    stats.append(engine.last_step)

    common = dict(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                  num_sanity_val_steps=0, callbacks=[Timer()], precision="32-true")
    strategy = None
    if system == "plain":
        trainer = L.Trainer(strategy="auto", accumulate_grad_batches=num_micro, **common)
        trainer.fit(module, train_dataloaders=_loader(cfg.context_len, micro, steps * num_micro))
    else:
        storage = snake_strategy.StorageConfig(ssd_dir=ssd_dir, weights={"ssd": 1.0}, optimizer={"ssd": 1.0},
                                               gradients={"host": 1.0}, checkpoints={"host": 1.0})
        # "vertical_batched": the vertical schedule with each unit's forward and backward batched over
        # all its micro-batches (batched_forward + batched_backward): bigger matmuls, same traffic.
        batched = system == "vertical_batched" or (batched_backward and system == "vertical")
        if system == "auto":
            schedule = snake_strategy.ScheduleConfig(num_micro_batches=num_micro)  # everything else: the planner
        else:
            schedule = snake_strategy.ScheduleConfig(kind="horizontal" if system == "horizontal" else "vertical",
                                                     num_micro_batches=num_micro, alpha=alpha,
                                                     batched_backward=batched, batched_forward=batched,
                                                     split_backward=system == "split")
        strategy = snake_strategy.GreedySnakeStrategy(storage=storage, schedule=schedule, hardware="probe")
        trainer = L.Trainer(strategy=strategy, **common)
        trainer.fit(module, train_dataloaders=_loader(cfg.context_len, micro * num_micro, steps))
    durations = [b - a for a, b in zip(step_marks, step_marks[1:])][1:]  # drop the warm-up step
    reads = [b[0] - a[0] for a, b in zip(io_marks, io_marks[1:])][1:]
    writes = [b[1] - a[1] for a, b in zip(io_marks, io_marks[1:])][1:]
    tokens = micro * num_micro * cfg.context_len
    s_per_step = statistics.median(durations)
    result = dict(system=system, s_per_step=s_per_step, step_s=durations, tokens_per_step=tokens,
                  tokens_per_s=tokens / s_per_step, peak_rss_bytes=peak_rss_bytes(),
                  ssd_read_bytes_per_step=int(statistics.median(reads)) if reads else 0,
                  ssd_write_bytes_per_step=int(statistics.median(writes)) if writes else 0)
    if strategy is not None:
        timed = stats[1:]
        counted = [s.step_traffic() for s in timed]
        result["engine_ssd_read_bytes_per_step"] = int(statistics.median(ssd_bytes(c, "read") for c in counted))
        result["engine_ssd_write_bytes_per_step"] = int(statistics.median(ssd_bytes(c, "write") for c in counted))
        result["io_wait_s"] = statistics.median(s.io_wait_s for s in timed)
        result["optimizer_wait_s"] = statistics.median(s.optimizer_wait_s for s in timed)
        result["optimizer_s"] = statistics.median(s.optimizer_s for s in timed)
        result["optimizer_busy_s"] = statistics.median(s.optimizer_busy_s for s in timed)
        result["exposed_io_fraction"] = result["io_wait_s"] / s_per_step
        result["prediction"] = strategy.prediction.as_dict()
        result["hardware"] = strategy.hardware_profile.__dict__
        result["plan"] = strategy.plan.as_dict()  # the concrete settings (what "auto" chose, with reasons)
        result["weight_grad_products"] = statistics.median(s.weight_grad_products for s in timed)
        result["traffic_per_step"] = counted[len(counted) // 2] if counted else {}
    return result


# ---------------------------------------------------------------------- parent side
def _spawn(system: str, preset_name: str, preset: dict, args) -> dict:
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    ssd_dir = tempfile.mkdtemp(prefix=f"bench-{system}-", dir=args.ssd_root)
    if system == "zero_infinity":
        cmd = [sys.executable, str(HERE / "zero_infinity.py"), "--preset", preset["model"],
               "--context-len", str(preset["context_len"]), "--micro-batch-size", str(preset["micro_batch_size"]),
               "--num-micro", str(preset["num_micro"]), "--steps", str(preset["steps"]), "--nvme-dir", ssd_dir,
               "--json-out", out]
    else:
        cmd = [sys.executable, __file__, "--worker", system, "--preset", preset_name, "--json-out", out,
               "--ssd-dir", ssd_dir, "--alpha", str(args.alpha), "--num-micro", str(preset["num_micro"])]
        if args.batched_backward:
            cmd.append("--batched-backward")
    print(f"[{preset_name}] running {system} ...", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        print(f"[{preset_name}] {system} failed:\n{tail}", flush=True)
        return dict(system=system, error=tail.strip().splitlines()[-1] if tail.strip() else "failed")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    print(f"[{preset_name}] {system}: {result['s_per_step']:.2f} s/step ({time.perf_counter() - start:.0f} s total)", flush=True)
    return result


def compare(preset_name: str, args) -> dict:
    preset = dict(PRESETS[preset_name])
    if args.num_micro:
        preset["num_micro"] = args.num_micro
    systems = [s for s in args.systems.split(",") if not (s == "zero_infinity" and "overrides" in preset)]
    # Probe once here (cached on disk per filesystem) so no worker's peak RSS includes the probe buffers.
    from snake_strategy.planning.machine import probe_hardware
    probe_hardware(args.ssd_root)
    results = {s: _spawn(s, preset_name, preset, args) for s in systems}
    ok = {s: r for s, r in results.items() if "s_per_step" in r}
    report = dict(preset=preset_name, settings=preset, alpha=args.alpha, batched_backward=args.batched_backward,
                  systems=results, machine=dict(cores=os.cpu_count()))
    vertical = ok.get("auto") or ok.get("vertical")
    if vertical:
        report["roofline_s_per_step"] = vertical["prediction"]["roofline_s"]
        report["roofline_bound"] = vertical["prediction"]["bound"]
        ratios = {}
        for mine in ("vertical", "vertical_batched", "split", "auto"):
            if mine not in ok:
                continue
            for other in ("plain", "horizontal", "zero_infinity"):
                if other in ok:
                    ratios[f"{other}_over_{mine}"] = ok[other]["s_per_step"] / ok[mine]["s_per_step"]
            ratios[f"{mine}_over_roofline"] = ok[mine]["s_per_step"] / ok[mine]["prediction"]["roofline_s"]
        report["ratios"] = ratios
    return report


def sweep(preset_name: str, micro_counts: list[int], args) -> dict:
    points = []
    for num_micro in micro_counts:
        args.num_micro = num_micro
        args.systems = "horizontal,vertical"
        rep = compare(preset_name, args)
        for system, r in rep["systems"].items():
            if "s_per_step" in r:
                points.append(dict(system=system, num_micro=num_micro, tokens_per_step=r["tokens_per_step"],
                                   tokens_per_s=r["tokens_per_s"], s_per_step=r["s_per_step"]))
    return dict(preset=preset_name, sweep=points)


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if "sweep" in report:
        for system in ("horizontal", "vertical"):
            pts = [p for p in report["sweep"] if p["system"] == system]
            ax.plot([p["tokens_per_step"] for p in pts], [p["tokens_per_s"] for p in pts], marker="o", label=system)
        ax.set_xlabel("tokens per optimizer step")
        ax.set_ylabel("tokens / s")
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.set_title(f"{report['preset']}: throughput vs tokens per step")
    else:
        ok = {s: r for s, r in report["systems"].items() if "s_per_step" in r}
        ax.bar(list(ok), [r["s_per_step"] for r in ok.values()], color="tab:blue")
        if "roofline_s_per_step" in report:
            ax.axhline(report["roofline_s_per_step"], color="tab:red", linestyle="--",
                       label=f"roofline floor ({report['roofline_bound']})")
            ax.legend()
        ax.set_ylabel("s / optimizer step (median)")
        ax.set_title(f"{report['preset']}: weights + optimizer on SSD where offloaded")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(report: dict) -> str:
    rows = ["system          s/step   tokens/s   ssd read/step   ssd write/step   peak RSS   io wait"]
    for s, r in report["systems"].items():
        if "s_per_step" not in r:
            rows.append(f"{s:<14}  failed: {r.get('error', '')[:60]}")
            continue
        rows.append(f"{s:<14} {r['s_per_step']:7.2f} {r['tokens_per_s']:10.0f} {r['ssd_read_bytes_per_step'] / 1e9:12.2f} GB"
                    f" {r['ssd_write_bytes_per_step'] / 1e9:13.2f} GB {r['peak_rss_bytes'] / 2**30:7.2f} GiB"
                    f" {r.get('io_wait_s', float('nan')):7.2f} s")
    if "ratios" in report:
        rows.append(f"roofline floor: {report['roofline_s_per_step']:.2f} s/step ({report['roofline_bound']}-bound)")
        rows += [f"{k}: {v:.2f}" for k, v in report["ratios"].items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="r1", choices=sorted(PRESETS))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--alpha", type=float, default=0.25)
    p.add_argument("--batched-backward", action="store_true",
                   help="vertical: batched unit forward and split (batched) backward over all micro-batches")
    p.add_argument("--num-micro", type=int, default=None)
    p.add_argument("--sweep", default=None, help="comma-separated micro-batch counts (horizontal vs vertical)")
    p.add_argument("--ssd-root", default=None, help="directory for the SSD tiers (default: the temp dir)")
    p.add_argument("--timeout-s", type=int, default=1800)
    p.add_argument("--name", default=None, help="result file name (default: the preset's)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ssd-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        preset = dict(PRESETS[args.preset])
        if args.num_micro:
            preset["num_micro"] = args.num_micro
        result = run_worker(args.worker, preset, args.ssd_dir, args.alpha, args.batched_backward)
        with open(args.json_out, "w") as f:
            json.dump(result, f)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        report = sweep(args.preset, [int(x) for x in args.sweep.split(",")], args)
        name = f"{args.preset}_sweep"
    else:
        report = compare(args.preset, args)
        name = args.name or args.preset
        print(_table(report))
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1))
    _plot(report, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / (name + '.json')} and {name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
