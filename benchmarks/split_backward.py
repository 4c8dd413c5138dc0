"""One unit's backward (recompute + gradients) three ways, interleaved, on the compare.py presets' shapes:

    per-micro   the unbatched vertical schedule: M recomputes, M autograd passes
    split       schedule.split_backward: M recomputes with input gradients, Linear weight gradients as one
                product per Linear over all micro-batches (engine/step/split_backward.py)
    batched     schedule.batched_backward: one recompute and one autograd pass over all micro-batches

No I/O, no optimizer: this isolates the compute difference the split makes, on a machine too loaded for
whole-run comparisons to resolve it. Prints medians; writes benchmarks/results/split_backward/split_backward.json.

    python benchmarks/split_backward.py [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.func import functional_call

from snake_strategy.engine.step.split_backward import DeferLinearWeights, WeightGradStash
from snake_strategy.gpt import Block, preset

SHAPES = {  # (preset, d_model, heads, micro-batch size, context, micro-batches) as in benchmarks/compare.py
    "r1": ("r1", 768, 12, 2, 128, 4),
    "io_bound": ("io_bound", 1024, 16, 1, 32, 8),
    "deep": ("small", 512, 8, 2, 64, 4),
}


def _unit(name: str):
    model, d, heads, micro, ctx, num_micro = SHAPES[name]
    cfg = preset(model)
    cfg.d_model, cfg.num_heads, cfg.context_len = d, heads, ctx
    torch.manual_seed(0)
    block = Block(cfg)
    params = {n: p.detach().clone().requires_grad_() for n, p in block.named_parameters()}
    xs = [torch.randn(micro, ctx, d) for _ in range(num_micro)]
    gs = [torch.randn(micro, ctx, d) for _ in range(num_micro)]
    return block, params, xs, gs


def per_micro(block, params, xs, gs):
    leaves = list(params.values())
    for x, g in zip(xs, gs):
        x = x.requires_grad_()
        y = functional_call(block, params, (x,))
        torch.autograd.grad(y, [x] + leaves, g)


def split(block, params, xs, gs):
    leaves = list(params.values())
    stash = WeightGradStash([p.dtype for p in leaves])
    for x, g in zip(xs, gs):
        x = x.requires_grad_()
        with DeferLinearWeights(leaves, stash, "cpu"):
            y = functional_call(block, params, (x,))
        torch.autograd.grad(y, [x] + leaves, g, allow_unused=True)
    stash.weight_grads()


def batched(block, params, xs, gs):
    x = torch.cat(xs).requires_grad_()
    y = functional_call(block, params, (x,))
    torch.autograd.grad(y, [x] + list(params.values()), torch.cat(gs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    modes = {"per_micro": per_micro, "split": split, "batched": batched}
    report = {"threads": torch.get_num_threads(), "shapes": {}}
    for name in SHAPES:
        unit = _unit(name)
        for fn in modes.values():
            fn(*unit)  # warm-up
        times = {m: [] for m in modes}
        for _ in range(args.reps):  # interleaved: a load change hits every mode alike
            for m, fn in modes.items():
                start = time.perf_counter()
                fn(*unit)
                times[m].append(time.perf_counter() - start)
        med = {m: statistics.median(t) for m, t in times.items()}
        report["shapes"][name] = {"median_s": med, "all_s": times,
                                  "split_over_per_micro": med["split"] / med["per_micro"],
                                  "split_over_batched": med["split"] / med["batched"]}
        print(f"{name:9s} per-micro {med['per_micro'] * 1e3:7.1f} ms  split {med['split'] * 1e3:7.1f} ms  "
              f"batched {med['batched'] * 1e3:7.1f} ms  split/per-micro {med['split'] / med['per_micro']:.2f}  "
              f"split/batched {med['split'] / med['batched']:.2f}", flush=True)
    out = Path(__file__).resolve().parent / "results" / "split_backward" / "split_backward.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
