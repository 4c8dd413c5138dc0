"""The paper's headline curve: tokens/s against tokens per optimizer step, the micro-batch fixed (as device
memory fixes it) and the step grown by more micro-batches, for the planner's default and the forced
schedules (and DeepSpeed ZeRO-Infinity where it is installed), with the planner's predicted curve and its
compute and SSD floors on the same axes.

    python benchmarks/throughput_curve.py                                  # gpt_1b, M = 2,4,8,16, 3 steps each
    python benchmarks/throughput_curve.py --preset io_bound --context-len 32 --num-micro 2,4 --steps 2

Systems: ``auto`` (``GreedySnakeStrategy()`` defaults: the planner's schedule and placement), ``vertical``
and ``horizontal`` (``ScheduleConfig(kind=...)``, every other schedule field its explicit-kind default; the
planner places the states in the same budget), ``zero_infinity`` (``benchmarks/zero_infinity.py``, weights
and optimizer on NVMe; skipped with a note when DeepSpeed is not installed). Every point is its own child
process (``snake_strategy.tune.run_in_child``), the systems of one micro-batch count back to back so
that machine drift hits them alike; ``--rounds N`` runs them N times in alternating order (ABBA) and takes
the median. Per point: s/step (median of steps 2..N), tokens/s, the engine's SSD
bytes per step, the peak RSS, the plan's predicted s/step, bound and floor terms. Per micro-batch count:
auto's tokens/s over horizontal's and over ZeRO-Infinity's, measured and predicted (ZeRO-Infinity's
prediction is the horizontal plan's: the same order of weight fetches).

Writes ``benchmarks/results/throughput_curve/<name>.json`` and ``.png``. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import results_dir

from snake_strategy.tune import Variant, merge_runs, run_order, run_variant

HERE = Path(__file__).resolve().parent
RESULTS = results_dir("throughput_curve")
SYSTEMS = ("auto", "vertical", "horizontal", "zero_infinity")
PREDICTION_TERMS = ("roofline_s", "bound", "compute_s", "ssd_s", "optimizer_s", "host_copy_s")


def run_zero_infinity(args: argparse.Namespace, num_micro: int) -> dict:
    """One ZeRO-Infinity point in its own process (DeepSpeed patches process-global state)."""
    nvme = tempfile.mkdtemp(prefix="curve-zi-", dir=args.ssd_root)
    out = Path(nvme) / "result.json"
    cmd = [sys.executable, str(HERE / "zero_infinity.py"), "--preset", args.preset, "--context-len",
           str(args.context_len), "--micro-batch-size", str(args.micro_batch_size), "--num-micro", str(num_micro),
           "--steps", str(args.steps), "--nvme-dir", nvme, "--json-out", str(out), *shlex.split(args.zi_args)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess(cmd, 1, "", f"timed out after {args.timeout_s} s")
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not out.exists():
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        error = lines[-1] if lines else f"exit status {proc.returncode}"
        if proc.returncode < 0:  # its last line is whatever it printed before the signal, not the cause
            error = f"killed by signal {-proc.returncode}" + (" (SIGKILL: the OOM killer when memory ran out)"
                                                              if proc.returncode == -9 else "")
        result = dict(status="failed", error=error, output_tail=(proc.stderr or proc.stdout)[-3000:])
    else:
        zi = json.loads(out.read_text())
        # its SSD bytes are the process's block-device counters (/proc/self/io), not an engine's traffic
        result = dict(status="ok", **{k: zi[k] for k in ("s_per_step", "step_s", "tokens_per_step", "tokens_per_s",
                                                         "peak_rss_bytes", "ssd_read_bytes_per_step",
                                                         "ssd_write_bytes_per_step")})
    shutil.rmtree(nvme, ignore_errors=True)  # DeepSpeed's swap files: the model's state, GBs
    print(f"[M={num_micro}] zero_infinity: {result.get('s_per_step', result.get('error'))} ({wall:.0f} s)",
          file=sys.stderr, flush=True)
    return dict(name=f"zero_infinity M={num_micro}", wall_s=wall, **result)


def point(system: str, num_micro: int, result: dict) -> dict:
    """One point of the curve: what the table, the ratios and the plot read (the whole run kept under ``run``)."""
    p = dict(system=system, num_micro=num_micro, status=result["status"])
    if result["status"] != "ok":
        return dict(p, error=result["error"])
    p.update({k: result[k] for k in ("tokens_per_step", "tokens_per_s", "s_per_step", "step_s", "peak_rss_bytes",
                                     "ssd_read_bytes_per_step", "ssd_write_bytes_per_step")})
    p["s_per_step_runs"] = result.get("s_per_step_runs", [result["s_per_step"]])
    prediction = result.get("prediction")
    if prediction:
        p.update({f"predicted_{k}": prediction[k] for k in PREDICTION_TERMS})
        p["planned_host_bytes"] = result["planned_host_bytes"]
    p["run"] = {k: v for k, v in result.items() if k not in p and k != "output_tail"}
    return p


def ratios(points: list[dict]) -> list[dict]:
    """Per micro-batch count: auto's tokens/s over the others', measured, and the same ratio of the plans'
    predicted s/step (ZeRO-Infinity has no plan: the horizontal plan's prediction stands for it)."""
    out = []
    for num_micro in sorted({p["num_micro"] for p in points}):
        at = {p["system"]: p for p in points if p["num_micro"] == num_micro and p["status"] == "ok"}
        if "auto" not in at:
            continue
        auto = at["auto"]
        row = dict(num_micro=num_micro, tokens_per_step=auto["tokens_per_step"])
        for other in ("horizontal", "zero_infinity", "vertical"):
            if other in at:
                row[f"auto_over_{other}"] = at[other]["s_per_step"] / auto["s_per_step"]
        horizontal = at.get("horizontal", {}).get("predicted_roofline_s")
        if horizontal and "predicted_roofline_s" in auto:
            row["predicted_auto_over_horizontal"] = horizontal / auto["predicted_roofline_s"]
            if "zero_infinity" in at:
                row["predicted_auto_over_zero_infinity"] = row["predicted_auto_over_horizontal"]
        out.append(row)
    return out


def table(report: dict) -> str:
    rows = [f"{'system':<14}{'M':>4}{'tokens':>8}{'tokens/s':>10}{'s/step':>9}{'predicted':>10}{'bound':>10}"
            f"{'compute':>9}{'ssd':>8}{'optim':>8}{'read GB':>9}{'write GB':>9}{'peak RSS':>10}"]
    for p in report["points"]:
        if p["status"] != "ok":
            rows.append(f"{p['system']:<14}{p['num_micro']:>4}  {p['status']}: {p['error'][:120]}")
            continue
        pred = f"{p['predicted_roofline_s']:>10.2f}" if "predicted_roofline_s" in p else f"{'-':>10}"
        terms = (f"{p['predicted_bound']:>10}{p['predicted_compute_s']:>9.2f}{p['predicted_ssd_s']:>8.2f}"
                 f"{p['predicted_optimizer_s']:>8.2f}") if "predicted_roofline_s" in p else f"{'':>35}"
        rows.append(f"{p['system']:<14}{p['num_micro']:>4}{p['tokens_per_step']:>8}{p['tokens_per_s']:>10.1f}"
                    f"{p['s_per_step']:>9.2f}{pred}{terms}{p['ssd_read_bytes_per_step'] / 1e9:>9.2f}"
                    f"{p['ssd_write_bytes_per_step'] / 1e9:>9.2f}{p['peak_rss_bytes'] / 2**30:>8.2f}Gi")
    for r in report["ratios"]:
        parts = [f"M={r['num_micro']} ({r['tokens_per_step']} tokens/step):"]
        for other in ("horizontal", "zero_infinity", "vertical"):
            if f"auto_over_{other}" in r:
                predicted = r.get(f"predicted_auto_over_{other}")
                parts.append(f"auto/{other} {r[f'auto_over_{other}']:.2f}"
                             + (f" (predicted {predicted:.2f})" if predicted else ""))
        rows.append("  ".join(parts))
    return "\n".join(rows + report["notes"])


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ok = [p for p in report["points"] if p["status"] == "ok"]
    for system in SYSTEMS:
        pts = sorted((p for p in ok if p["system"] == system), key=lambda p: p["tokens_per_step"])
        if pts:
            line, = ax.plot([p["tokens_per_step"] for p in pts], [p["tokens_per_s"] for p in pts], marker="o",
                            label=system)
            if system == "auto" and "predicted_roofline_s" in pts[0]:
                x = [p["tokens_per_step"] for p in pts]
                ax.plot(x, [p["tokens_per_step"] / p["predicted_roofline_s"] for p in pts], linestyle="--",
                        color=line.get_color(), label="auto, predicted")
                ax.plot(x, [p["tokens_per_step"] / p["predicted_compute_s"] for p in pts], linewidth=0.8,
                        color="black", label="compute roofline")
                ssd = [(p["tokens_per_step"], p["tokens_per_step"] / p["predicted_ssd_s"]) for p in pts
                       if p["predicted_ssd_s"] > 0]
                if ssd:
                    ax.plot(*zip(*ssd), linewidth=0.8, color="tab:gray", label="SSD floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per optimizer step")
    ax.set_ylabel("tokens / s")
    s = report["settings"]
    ax.set_title(f"{report['preset']}: micro-batch {s['micro_batch_size']} x context {s['context_len']}, "
                 f"more micro-batches per step", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt_1b")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--num-micro", default="2,4,8,16", help="comma-separated micro-batches per step: the points")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="steps per point; s/step is the median of steps 2..N")
    p.add_argument("--host-budget-bytes", type=int, default=None, help="storage.host_budget_bytes of every point")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every system at each point, every other round in reverse order; a point's s/step "
                        "is the median of its runs")
    p.add_argument("--append", action="store_true",
                   help="keep the points of the result file already there that this run does not measure")
    p.add_argument("--timeout-s", type=float, default=None, help="give up on a point's run after this long")
    p.add_argument("--ssd-root", default=None, help="directory for the SSD tiers (default: the temp dir)")
    p.add_argument("--name", default=None, help="result file name (default: the preset's)")
    p.add_argument("--zi-args", default="",
                   help="extra arguments of benchmarks/zero_infinity.py for its points, e.g. \"--param-buffers 12 "
                        "--ds-overrides '{...}'\" (a model its defaults do not fit in memory)")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"--systems names unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    micro_counts = [int(m) for m in args.num_micro.split(",")]
    notes = []
    if "zero_infinity" in systems and importlib.util.find_spec("deepspeed") is None:
        systems.remove("zero_infinity")
        notes.append("zero_infinity skipped: DeepSpeed is not installed (the 'bench' extra, see benchmarks/zero_infinity.py)")
        print(notes[-1], file=sys.stderr)
    from snake_strategy.planning.machine import probe_hardware
    probe_hardware(args.ssd_root)  # once here (cached on disk), so that no point's peak RSS holds the probe's buffers
    spec = dict(preset=args.preset, context_len=args.context_len, micro_batch_size=args.micro_batch_size, num_micro=0,
                steps=args.steps, host_budget_bytes=args.host_budget_bytes, ssd_dir=args.ssd_root, hardware="probe",
                accelerator="auto", learning_rate=3e-4, schedule={}, storage={})
    start = time.perf_counter()
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = args.name or args.preset
    points = []
    if args.append and (RESULTS / f"{name}.json").exists():
        # another run's points on the same axes (a long preset measured in parts); this run's replace its own
        earlier = json.loads((RESULTS / f"{name}.json").read_text())
        mine = {(s, m) for s in systems for m in micro_counts}
        points = [p for p in earlier["points"] if (p["system"], p["num_micro"]) not in mine]
        notes += [n for n in earlier.get("notes", []) if n not in notes]
        notes.append(f"points from more than one run: {earlier['settings']} and this run's")
    settings = dict(spec, num_micro=micro_counts, systems=systems, rounds=args.rounds, zi_args=args.zi_args)
    for num_micro in micro_counts:
        runs: dict[str, list[dict]] = {}
        for system in run_order(systems, args.rounds):
            if system == "zero_infinity":
                result = run_zero_infinity(args, num_micro)
            else:
                given = {} if system == "auto" else {"kind": system}
                result = run_variant(dict(spec, num_micro=num_micro), Variant(f"{system} M={num_micro}", given),
                                     f"M={num_micro}", args.timeout_s)
            runs.setdefault(system, []).append(result)
        points += [point(system, num_micro, merge_runs(runs[system])) for system in systems]
        points.sort(key=lambda p: (p["num_micro"], SYSTEMS.index(p["system"])))
        # written after every point, so that a long curve stopped half-way keeps what it measured
        report = dict(preset=args.preset, settings=settings,
                      wall_s=time.perf_counter() - start, points=points, ratios=ratios(points), notes=notes)
        (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    plot(report, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
