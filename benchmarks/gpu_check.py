"""The GPU check: one prepared script, under 8 minutes on one H200.

    python benchmarks/gpu_check.py                 # everything; writes benchmarks/results/gpu_check/gpu_*.json
    python benchmarks/gpu_check.py --dry-run       # print the plan; on a machine without CUDA: exit 0
    python benchmarks/gpu_check.py --only exactness,bandwidth

Sections, in order (each later one is skipped, and says so, when the time budget is spent):

1. ``exactness``: greedysnake (weights + optimizer on the SSD, vertical) vs plain Lightning on the GPU,
   element-wise after 5 steps of a small GPT. fp32: rtol/atol 1e-5 as on CPU. bf16-mixed: a *measured*
   tolerance, the distance between plain Lightning in bf16-mixed and in fp32 (the precision's own
   error); greedysnake in bf16-mixed must stay within it of plain bf16-mixed.
2. ``bandwidth``: pinned host<->device copy bandwidth (1 GiB, best of 5 each way): the PCIe roof.
3. ``r1`` and ``wide`` (d=4096, 8 layers, context 1024, bf16-true, weights + master + moments on the
   SSD): tokens/s, MFU (model FLOPs over the dense bf16 peak), the engine's host+SSD bytes per step as
   PCIe GB/s vs the measured pinned bandwidth, exposed I/O (the engine's I/O wait over the step, and
   the step time over the same run with every state on the device), peak GPU memory. Plain Lightning
   on the same shape where it fits in the time.
4. ``zero_infinity``: DeepSpeed ZeRO-Infinity on the same shapes when ``deepspeed`` imports (its
   driver, benchmarks/zero_infinity.py, runs DeepSpeed's CPU accelerator only: recorded as skipped).

Every training run is its own subprocess (clean peak memory, a crash costs one entry). Writes
``benchmarks/results/gpu_check/gpu_<section>.json`` (or ``--out-dir``) and prints one line per result.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BUDGET_S = 450  # of the 8 minutes: leave room for start-up and writing results
PEAK_BF16_FLOPS = 989e12  # H200 dense bf16 (the data sheet's figure; ~790e12 measured on large products)

SHAPES = {
    "exact": dict(vocab_size=64, d_model=64, num_layers=4, num_heads=4, context_len=32, tied_head=True),
    "r1": dict(vocab_size=50257, d_model=768, num_layers=6, num_heads=12, context_len=128, tied_head=False),
    "wide": dict(vocab_size=50257, d_model=4096, num_layers=8, num_heads=32, context_len=1024, tied_head=True),
}
SSD = dict(weights={"ssd": 1.0}, master={"ssd": 1.0}, optimizer={"ssd": 1.0}, gradients={"host": 1.0},
           checkpoints={"host": 1.0})
DEVICE = dict(weights={"device": 1.0}, master={"device": 1.0}, optimizer={"device": 1.0},
              gradients={"device": 1.0}, checkpoints={"device": 1.0})
# (name, shape, system, storage, precision, micro-batch size, micro-batches, steps incl. 1 warm-up)
RUNS = {
    "r1": [("r1_snake_ssd", "r1", "snake", SSD, "bf16-mixed", 2, 4, 6),
           ("r1_snake_device", "r1", "snake", DEVICE, "bf16-mixed", 2, 4, 6),
           ("r1_plain", "r1", "plain", None, "bf16-mixed", 2, 4, 6)],
    "wide": [("wide_snake_ssd", "wide", "snake", SSD, "bf16-true", 4, 8, 4),
             ("wide_snake_device", "wide", "snake", DEVICE, "bf16-true", 4, 8, 4),
             ("wide_plain", "wide", "plain", None, "bf16-mixed", 4, 8, 4)],
}
SECTIONS = ("exactness", "bandwidth", "r1", "wide", "zero_infinity")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# ---------------------------------------------------------------------- worker side (one subprocess)
def _loader(shape: dict, batch_size: int, num_batches: int, seed: int = 1234):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(shape["vocab_size"], (batch_size * num_batches, shape["context_len"]), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=batch_size, shuffle=False)


def _fit(shape: dict, system: str, storage: dict | None, precision: str, micro: int, num_micro: int, steps: int,
         ssd_dir: str, record_params: bool = False, accelerator: str = "gpu") -> dict:
    """One training run on the GPU: plain Lightning (accumulate_grad_batches) or greedysnake.
    (``accelerator="cpu"``: the same code on the CPU, for tests/gpu/test_gpu_check.py.)"""
    import lightning as L
    import torch

    cuda = accelerator == "gpu"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()  # sync point: benchmark timing only

    import snake_strategy
    from snake_strategy.gpt import GPTConfig, GPTModule

    cfg = GPTConfig(**shape)
    torch.manual_seed(0)
    module = GPTModule(cfg, learning_rate=1e-3)
    marks, stats, params = [], [], []

    class Timer(L.Callback):
        def on_train_start(self, trainer, pl_module):
            sync()
            marks.append(time.perf_counter())
            self.seen = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self.seen:
                self.seen = trainer.global_step
                sync()
                marks.append(time.perf_counter())
                engine = getattr(trainer.strategy, "engine", None)
                if engine is not None:
                    stats.append(engine.last_step)

    common = dict(accelerator=accelerator, devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                  num_sanity_val_steps=0, callbacks=[Timer()], precision=precision)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if system == "plain":
        trainer = L.Trainer(strategy="auto", accumulate_grad_batches=num_micro, **common)
        trainer.fit(module, train_dataloaders=_loader(shape, micro, steps * num_micro))
    else:
        strategy = snake_strategy.GreedySnakeStrategy(
            storage=dict(storage, ssd_dir=ssd_dir),
            schedule=dict(kind="vertical", num_micro_batches=num_micro, alpha=0.25))
        trainer = L.Trainer(strategy=strategy, **common)
        trainer.fit(module, train_dataloaders=_loader(shape, micro * num_micro, steps))
    if record_params:
        params = {k: v.detach().double().cpu() for k, v in module.state_dict().items()}
    durations = [b - a for a, b in zip(marks, marks[1:])][1:]  # the first step is warm-up
    s_per_step = statistics.median(durations) if durations else float("nan")
    tokens = micro * num_micro * cfg.context_len
    flops = module.flops_per_token(cfg.context_len) * tokens
    out = dict(s_per_step=s_per_step, step_s=durations, tokens_per_s=tokens / s_per_step,
               mfu=flops / s_per_step / PEAK_BF16_FLOPS,
               peak_gpu_bytes=torch.cuda.max_memory_allocated() if cuda else 0,
               params=cfg.num_params())
    if stats[1:]:
        timed = stats[1:]
        traffic = [s.step_traffic() for s in timed]
        # Every host or SSD byte the engine moves crosses PCIe once (compute and optimizer are on the GPU).
        pcie = statistics.median(sum(v for k, v in t.items() if k.split("/")[0] in ("host", "ssd")) for t in traffic)
        io_wait = statistics.median(s.io_wait_s for s in timed)
        out.update(pcie_bytes_per_step=int(pcie), pcie_GBps=pcie / s_per_step / 1e9, io_wait_s=io_wait,
                   exposed_io_engine=io_wait / s_per_step, traffic_per_step=traffic[len(traffic) // 2])
    return (out, params) if record_params else out


def _diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _close(a: dict, b: dict, rtol: float, atol: float) -> bool:
    return all(bool(((a[k] - b[k]).abs() <= atol + rtol * b[k].abs()).all()) for k in a)


def worker_exactness(ssd_dir: str, accelerator: str = "gpu", shape: dict | None = None, steps: int = 5) -> dict:
    shape = shape or SHAPES["exact"]
    runs = {}
    for name, system, precision in [("plain_32", "plain", "32-true"), ("snake_32", "snake", "32-true"),
                                    ("plain_bf16", "plain", "bf16-mixed"), ("snake_bf16", "snake", "bf16-mixed")]:
        _, runs[name] = _fit(shape, system, SSD, precision, 2, 4, steps, ssd_dir, True, accelerator)
    measured_tol = _diff(runs["plain_bf16"], runs["plain_32"])
    bf16_diff = _diff(runs["snake_bf16"], runs["plain_bf16"])
    fp32_ok = _close(runs["snake_32"], runs["plain_32"], 1e-5, 1e-5)
    return dict(fp32_max_abs_diff=_diff(runs["snake_32"], runs["plain_32"]), fp32_pass=fp32_ok,
                bf16_max_abs_diff=bf16_diff, bf16_measured_tolerance=measured_tol,
                bf16_pass=bf16_diff <= measured_tol, passed=fp32_ok and bf16_diff <= measured_tol)


def pinned_bandwidth(num_bytes: int = 2**30, reps: int = 5) -> dict:
    """Best-of-``reps`` pinned copy bandwidth each way, timed with CUDA events (GB/s, 1e9 bytes)."""
    import torch

    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d_GBps", dev, host), ("d2h_GBps", host, dev)):
        best = float("inf")
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()  # sync point: measuring
            best = min(best, start.elapsed_time(end) / 1e3)
        out[name] = num_bytes / best / 1e9
    return out


def run_worker(spec: dict) -> dict:
    if spec["kind"] == "exactness":
        return worker_exactness(spec["ssd_dir"], spec.get("accelerator", "gpu"))
    if spec["kind"] == "bandwidth":
        return pinned_bandwidth()
    name, shape, system, storage, precision, micro, num_micro, steps = spec["run"]
    shape = dict(SHAPES[shape], **spec.get("shape_override", {}))
    return dict(name=name, system=system, precision=precision,
                **_fit(shape, system, storage, precision, micro, num_micro, steps, spec["ssd_dir"],
                       accelerator=spec.get("accelerator", "gpu")))


# ---------------------------------------------------------------------- parent side
def _spawn(spec: dict, timeout_s: float, ssd_root: str | None) -> dict:
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    ssd_dir = tempfile.mkdtemp(prefix="gpu-check-", dir=ssd_root)
    spec = dict(spec, ssd_dir=ssd_dir)
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--json-out", out]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout_s), env=env)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout_s:.0f} s")
    finally:
        subprocess.run(["rm", "-rf", ssd_dir], check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()
        return dict(error=tail.splitlines()[-1] if tail else f"exit {proc.returncode}", log_tail=tail[-3000:])
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    result["wall_s"] = time.perf_counter() - start
    return result


def _summarize(runs: dict, bandwidth: dict | None) -> dict:
    """Cross-run numbers: exposed I/O against the all-on-device run, PCIe use against the measured roof."""
    summary = {}
    for prefix in ("r1", "wide"):
        ssd, device = runs.get(f"{prefix}_snake_ssd", {}), runs.get(f"{prefix}_snake_device", {})
        if "s_per_step" in ssd and "s_per_step" in device:
            summary[f"{prefix}_exposed_io_vs_device"] = max(0.0, 1 - device["s_per_step"] / ssd["s_per_step"])
        if "pcie_GBps" in ssd and bandwidth and "h2d_GBps" in bandwidth:
            roof = (bandwidth["h2d_GBps"] + bandwidth["d2h_GBps"]) / 2
            summary[f"{prefix}_pcie_fraction_of_pinned_roof"] = ssd["pcie_GBps"] / roof
        plain = runs.get(f"{prefix}_plain", {})
        if "tokens_per_s" in ssd and "tokens_per_s" in plain:
            summary[f"{prefix}_snake_ssd_over_plain_tokens"] = ssd["tokens_per_s"] / plain["tokens_per_s"]
    return summary


def _write(out_dir: Path, section: str, payload: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu_{section}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="total time for all sections")
    parser.add_argument("--out-dir", default=str(HERE / "results" / "gpu_check"))
    parser.add_argument("--ssd-root", default=None, help="where SSD files go (default: the temp dir)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = run_worker(json.loads(args.worker))
        Path(args.json_out).write_text(json.dumps(result, default=str))
        return 0
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
    if not cuda_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False): nothing measured. "
              "Run this script on a machine with an NVIDIA GPU.", flush=True)
        return 0
    if args.dry_run:
        for section in sections:
            plan = [r[0] for r in RUNS.get(section, [])]
            print(f"{section}: {', '.join(plan) if plan else 'one worker'}", flush=True)
        return 0
    deadline = time.perf_counter() + args.budget_s
    out_dir = Path(args.out_dir)
    bandwidth = None
    runs: dict[str, dict] = {}
    for section in sections:
        left = deadline - time.perf_counter()
        if section == "zero_infinity":
            try:
                import deepspeed  # noqa: F401
                note = ("skipped: deepspeed imports, but benchmarks/zero_infinity.py drives DeepSpeed's CPU "
                        "accelerator only; a CUDA ZeRO-Infinity run is not written yet")
            except Exception as err:  # ImportError, or DeepSpeed failing at import on this machine
                note = f"skipped: deepspeed does not import ({type(err).__name__})"
            print(f"zero_infinity: {note}", flush=True)
            _write(out_dir, section, dict(skipped=note))
            continue
        if left < 20:
            print(f"{section}: skipped, the time budget is spent", flush=True)
            _write(out_dir, section, dict(skipped="time budget spent"))
            continue
        if section in ("exactness", "bandwidth"):
            result = _spawn(dict(kind=section), left, args.ssd_root)
            bandwidth = result if section == "bandwidth" else bandwidth
            print(f"{section}: {json.dumps({k: v for k, v in result.items() if k != 'log_tail'})}", flush=True)
            _write(out_dir, section, result)
            continue
        results = {}
        for run in RUNS[section]:
            left = deadline - time.perf_counter()
            if left < 20:
                results[run[0]] = dict(skipped="time budget spent")
                continue
            results[run[0]] = r = _spawn(dict(kind="train", run=list(run)), left, args.ssd_root)
            brief = {k: r[k] for k in ("s_per_step", "tokens_per_s", "mfu", "pcie_GBps", "exposed_io_engine",
                                       "peak_gpu_bytes", "error") if k in r}
            print(f"{run[0]}: {json.dumps(brief)}", flush=True)
        runs.update(results)
        _write(out_dir, section, dict(runs=results, summary=_summarize(results, bandwidth), bandwidth=bandwidth,
                                      peak_bf16_flops=PEAK_BF16_FLOPS))
    print(f"summary: {json.dumps(_summarize(runs, bandwidth))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
