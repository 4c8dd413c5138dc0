"""Norm clipping at full speed: gpt_1b on the defaults (``GreedySnakeStrategy()``: the planner places
everything within 60% of MemAvailable, read once by this command and given to every case, so that the
cases plan for the same memory), side by side in one command, each case in its own process:

- ``none``: no clipping (the overlapped step, alpha from the planner);
- ``high``: ``gradient_clip_val`` far above the norm (never triggers): every step speculative, committed;
- ``always``: a ``gradient_clip_val`` every step exceeds: one rollback, then the deferred mode;
- ``always_deferred``: the same with ``schedule.speculation="off"`` (alpha 1: the deferred step).

    flock /tmp/snake-bench.lock python benchmarks/clipping.py            # gpt_1b, 6 steps per case
    python benchmarks/clipping.py --preset small --steps 4 --out /tmp/c.json   # a quick look
    flock /tmp/snake-bench.lock python benchmarks/clipping.py --cases none,high --repeat 2   # ABAB

``--repeat N`` runs the case list N times, interleaved (none, high, none, high, ...): each round's ratio
is against that round's unclipped case, and the report gives every round's ratio and their median (this
machine's step times drift by 10-30% within an hour).

Writes ``benchmarks/results/clipping/<preset>.json`` (per case: step times, peak RSS in training, the host budget
and plan, speculation and rollbacks per step, rollback-state bytes written per step and read per
rollback) and the same name with ``.png``. Not part of the test suite (~20 minutes on gpt_1b).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "clipping"
CASES = {"none": dict(clip=None), "high": dict(clip=1e6), "always": dict(clip=1e-3),
         "always_deferred": dict(clip=1e-3, speculation="off")}


def run_case(name: str, preset_name: str, steps: int, context_len: int, micro_batch_size: int, lr: float,
             ssd_root: str | None, host_budget_bytes: int | None = None, trace_dir: str | None = None) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, Subset

    import snake_strategy
    from snake_strategy.data import ByteWindows, load_corpus
    from snake_strategy.gpt import GPTModule, preset

    case = CASES[name]
    cfg = preset(preset_name)
    cfg.context_len = context_len
    torch.manual_seed(0)
    module = GPTModule(cfg, learning_rate=lr)
    schedule = {"speculation": case["speculation"]} if "speculation" in case else None
    # placement "auto", as the defaults: a storage mapping without it means "manual" (every state on the host).
    ssd_dir = tempfile.mkdtemp(prefix="snake-clip-", dir=ssd_root)
    strategy = snake_strategy.GreedySnakeStrategy(storage={"ssd_dir": ssd_dir, "placement": "auto",
                                                           "host_budget_bytes": host_budget_bytes},
                                                  schedule=schedule,
                                                  trace_path=f"{trace_dir}/{name}.json" if trace_dir else None)
    rows: list[dict] = []
    marks: dict[str, float] = {}
    peak: list[int] = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            marks["step"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            engine = trainer.strategy.engine
            stats = engine.last_step
            traffic = stats.step_traffic()
            rows.append({"step_s": time.perf_counter() - marks["step"], "loss": float(outputs["loss"]),
                         "alpha": engine.alpha, "speculation": stats.speculation,
                         "rollbacks": stats.rollbacks, "clip_factor": stats.clip_factor,
                         "grad_norm": stats.grad_norm,
                         "rollback_write_bytes": sum(v for k, v in traffic.items()
                                                     if "/rollback/" in k and k.endswith("/write")),
                         "rollback_read_bytes": sum(v for k, v in traffic.items()
                                                    if "/rollback/" in k and k.endswith("/read")),
                         "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
            print(f"{name} step {len(rows)}: {rows[-1]['step_s']:.1f} s, speculation {rows[-1]['speculation']}, "
                  f"rollbacks {rows[-1]['rollbacks']}, factor {rows[-1]['clip_factor']}, "
                  f"peak RSS {rows[-1]['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)

        def on_train_end(self, trainer, pl_module):
            trainer.strategy.engine.flush()
            peak.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    batch = micro_batch_size * 4  # the default schedule's 4 micro-batches
    windows = ByteWindows(load_corpus("stdlib"), context_len)
    loader = DataLoader(Subset(windows, range(batch * steps)), batch_size=batch, shuffle=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Probe()],
                        gradient_clip_val=case["clip"])
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    plan = strategy.plan
    times = [r["step_s"] for r in rows]
    breakdowns = []
    if trace_dir:  # where each step's time went: busy seconds of compute, the disk and the worker
        from snake_strategy.timeline import STEPS, lanes, read_trace, step_breakdown
        events = read_trace(f"{trace_dir}/{name}.json")
        breakdowns = [dict(index=e["args"]["step"], **step_breakdown(events, e["args"]["step"]))
                      for e in lanes(events)[STEPS]]
    return dict(breakdown_s=breakdowns, case=name, clip=case["clip"], speculation_setting=case.get("speculation", "on"),
                params=cfg.num_params(), steps=rows, s_per_step=statistics.median(times[1:] or times),
                peak_rss_bytes=peak[0] if peak else None, host_budget_bytes=plan.host_budget_bytes,
                plan_host_bytes=plan.host_bytes, describe=plan.describe(), step_mode=plan.step_mode,
                rollback_state_bytes=plan.rollback_bytes, rollback_tier=plan.storage.rollback,
                total_s=time.perf_counter() - start)


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in report["cases"] if "error" not in c]
    rounds = len({c.get("round", 0) for c in cases}) > 1

    def label(c: dict) -> str:
        return f"{c['case']} {c.get('round', 0) + 1}" if rounds else c["case"]

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for c in cases:
        a.plot(range(1, len(c["steps"]) + 1), [r["step_s"] for r in c["steps"]], marker="o", label=label(c))
    a.set_xlabel("step")
    a.set_ylabel("seconds")
    a.set_title(f"{report['preset']}: step time")
    a.legend()
    names = [label(c) for c in cases]
    b.bar(names, [c["peak_rss_bytes"] / 2**30 for c in cases], label="peak RSS in training")
    b.plot(names, [c["host_budget_bytes"] / 2**30 for c in cases], "r_", markersize=30, label="host budget")
    b.set_ylabel("GiB")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _summarize(report: dict, out: Path) -> None:
    """Ratios to the same round's unclipped case, their medians, rollback bytes; writes the JSON and the plot."""
    done = [c for c in report["cases"] if "error" not in c]
    ratios: dict[str, list[float]] = {}
    for c in done:
        base = next((b for b in done if b["case"] == "none" and b.get("round", 0) == c.get("round", 0)), None)
        c["peak_rss_within_budget"] = c["peak_rss_bytes"] <= c["host_budget_bytes"]
        if base is not None:
            c["vs_unclipped"] = c["s_per_step"] / base["s_per_step"]
            ratios.setdefault(c["case"], []).append(c["vs_unclipped"])
    report["vs_unclipped_per_round"] = ratios
    report["vs_unclipped_median"] = {name: statistics.median(r) for name, r in ratios.items()}
    for c in done:
        rolled = [i for i, r in enumerate(c["steps"]) if r["rollbacks"] and
                  (i == 0 or r["rollbacks"] > c["steps"][i - 1]["rollbacks"])]
        # a rollback's redo reads the saved state in the next step's forward
        c["rollback_read_bytes_per_rollback"] = [c["steps"][i + 1]["rollback_read_bytes"] for i in rolled
                                                 if i + 1 < len(c["steps"])]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    _plot(report, out.with_suffix(".png"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt_1b")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--ssd-root", default=None)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--host-budget-bytes", type=int, default=None,
                   help="one budget for every case (default: the default budget, 0.6 x MemAvailable, read once "
                        "here: each case then plans for the same memory and only the step mode differs)")
    p.add_argument("--repeat", type=int, default=1, help="run the case list this many times, interleaved")
    p.add_argument("--trace-dir", default=None,
                   help="write each case's timeline there (<case>.json) and add each step's busy seconds per "
                        "resource (timeline.step_breakdown) to the report")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # worker: run one case, print its JSON
    p.add_argument("--out", default=None, help="result file (default: results/clipping/<preset>.json)")
    args = p.parse_args(argv)
    args.out = args.out or str(RESULTS / f"{args.preset}.json")
    if args.case:
        result = run_case(args.case, args.preset, args.steps, args.context_len, args.micro_batch_size, args.lr,
                          args.ssd_root, args.host_budget_bytes, args.trace_dir)
        print("RESULT " + json.dumps(result))
        return 0
    if args.host_budget_bytes is None:
        from snake_strategy.planning.machine import host_budget
        args.host_budget_bytes = host_budget(None).budget_bytes
    report = {"preset": args.preset, "steps": args.steps, "context_len": args.context_len,
              "micro_batch_size": args.micro_batch_size, "host_budget_bytes": args.host_budget_bytes, "cases": []}
    for round_, name in [(r, n) for r in range(args.repeat) for n in args.cases.split(",")]:
        cmd = [sys.executable, __file__, "--case", name, "--preset", args.preset, "--steps", str(args.steps),
               "--context-len", str(args.context_len), "--micro-batch-size", str(args.micro_batch_size),
               "--lr", str(args.lr), "--host-budget-bytes", str(args.host_budget_bytes)
               ] + (["--ssd-root", args.ssd_root] if args.ssd_root else []) + (
                   ["--trace-dir", args.trace_dir] if args.trace_dir else [])
        lines = []
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            for line in proc.stdout:  # the per-step lines as they come
                if line.startswith("RESULT "):
                    lines.append(line)
                else:
                    print(line, end="", flush=True)
            proc.wait()
            err.seek(0)
            error = err.read()
        if proc.returncode != 0 or not lines:
            report["cases"].append({"case": name, "round": round_, "error": error[-3000:]})
            continue
        report["cases"].append({**json.loads(lines[-1][len("RESULT "):]), "round": round_})
        _summarize(report, Path(args.out))  # after every case: a long run cut short keeps what it measured
    for c in report["cases"]:
        if "error" in c:
            print(f"{c['case']}: FAILED {c['error'][-500:]}")
            continue
        print(f"{c['case']:>16}: {c['s_per_step']:.1f} s/step ({c.get('vs_unclipped', float('nan')):.2f}x), peak RSS "
              f"{c['peak_rss_bytes'] / 2**30:.2f} of {c['host_budget_bytes'] / 2**30:.2f} GiB, rollbacks "
              f"{c['steps'][-1]['rollbacks']}, {c['describe']}")
    if args.repeat > 1:
        for name, ratio in report.get("vs_unclipped_median", {}).items():
            print(f"{name:>16}: median {ratio:.2f}x over {args.repeat} rounds "
                  f"({', '.join(f'{r:.2f}' for r in report['vs_unclipped_per_round'][name])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
