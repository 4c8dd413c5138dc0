"""The low-bit AdamW's step against torch's fused AdamW on the same tensors, in one process, the two taking
turns: the check issue 45 names ("at least 0.8x the params/s of torch's fused fp32 AdamW on one thread").

    python benchmarks/lowbit_step.py                       # 1 and 2 threads, ~1 min
    python benchmarks/lowbit_step.py --threads 1 --rounds 40 --out /tmp/lowbit_step.json

Both optimizers start from the same parameter and gradient and step them in place (one copy each). After
``--warmup`` steps (the 8-bit class compiles its kernel at its first), ``--rounds`` rounds each time
``--steps-per-round`` steps of fused AdamW, then as many of ``FastAdamW8bit``; the ratio is taken per round
(fused's seconds over the 8-bit's), so a machine that drifts between rounds moves both sides of a ratio
alike. Reported per thread count: the median params/s of each, the median ratio and its spread.
``--shapes`` takes ``AxB`` shapes separated by commas (default one 4096 x 4096 matrix).

Writes ``benchmarks/results/optimizer_kernels/lowbit_step.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import results_dir  # noqa: E402


def seconds_per_step(optimizer: torch.optim.Optimizer, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps


def side_by_side(shapes: list[tuple[int, ...]], threads: int, warmup: int, rounds: int, steps: int) -> dict:
    from snake_strategy.optimizers import FastAdamW8bit
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    starts = [torch.randn(s, generator=generator) for s in shapes]
    grads = [torch.randn(s, generator=generator) * 1e-3 for s in shapes]
    sides = {}
    for name, cls, kwargs in (("adamw_fused", torch.optim.AdamW, {"fused": True}),
                              ("fast_adamw8bit", FastAdamW8bit, {})):
        params = [torch.nn.Parameter(s.clone()) for s in starts]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer = cls(params, lr=1e-3, weight_decay=1e-2, **kwargs)
        first = time.perf_counter()
        optimizer.step()
        sides[name] = {"optimizer": optimizer, "first_step_s": time.perf_counter() - first}
        for _ in range(warmup):
            optimizer.step()
    numel = sum(s.numel() for s in starts)
    per_round = {name: [] for name in sides}
    for _ in range(rounds):
        for name, side in sides.items():
            per_round[name].append(seconds_per_step(side["optimizer"], steps))
    ratios = [a / b for a, b in zip(per_round["adamw_fused"], per_round["fast_adamw8bit"])]
    return {"threads": threads, "params": numel,
            "m_params_per_s": {n: numel / statistics.median(s) / 1e6 for n, s in per_round.items()},
            "first_step_s": {n: side["first_step_s"] for n, side in sides.items()},
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratios": ratios}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for row in report["rows"]:
        ax.plot(range(1, len(row["ratios"]) + 1), row["ratios"], marker=".",
                label=f"{row['threads']} thread(s): median {row['ratio_median']:.2f}x")
    ax.axhline(0.8, color="grey", linestyle="--", linewidth=1, label="0.8x")
    ax.set_xlabel("round")
    ax.set_ylabel("FastAdamW8bit / fused AdamW params/s")
    ax.set_title("Low-bit step against torch's fused AdamW, same tensors, taking turns")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default="4096x4096")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--out", default=str(results_dir("optimizer_kernels") / "lowbit_step.json"))
    args = ap.parse_args()
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        row = side_by_side(shapes, threads, args.warmup, args.rounds, args.steps_per_round)
        rates = row["m_params_per_s"]
        print(f"{threads} thread(s): fused AdamW {rates['adamw_fused']:.0f} M params/s, FastAdamW8bit "
              f"{rates['fast_adamw8bit']:.0f}; ratio median {row['ratio_median']:.3f} "
              f"[{row['ratio_min']:.2f}, {row['ratio_max']:.2f}] over {args.rounds} rounds", flush=True)
        rows.append(row)
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
              "args": vars(args), "shapes": shapes, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
