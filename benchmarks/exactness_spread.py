"""How far greedysnake is from plain Lightning / plain torch, and why (docs/guide/guarantees.md states the bounds).

    PYTHONPATH=. python benchmarks/exactness_spread.py fp32 [--seeds 3]    # per schedule, lr, precision
    PYTHONPATH=. python benchmarks/exactness_spread.py fp16-clip norm 0.05  # or: value 0.001
    PYTHONPATH=. python benchmarks/exactness_spread.py batch-noise          # batched vs per-micro-batch

Uses the tests' model and data (``tests/helpers.py``), so the numbers are the ones the tests' bounds
were set from. Prints one JSON line per measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from snake_strategy.gpt import Block, GPTConfig, GPTModule
from snake_strategy.precision import GreedySnakePrecision
from tests.helpers import SMALL_GPT, fp16_clip_reference, run_reference, run_snake, token_data, trainer_kwargs

STEPS, MICRO, MICRO_SIZE = 5, 4, 2


def _max_abs(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def fp32_spread(seeds: int) -> None:
    """Max |snake - plain| per step for the auto, unbatched and batched schedules at lr 1e-3 and 1e-2."""
    for precision in ("32-true", "64-true"):
        for lr in (1e-3, 1e-2):
            for seed in range(seeds):
                ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, lr=lr, seed=seed)
                for name, kind, extra in (("auto", "auto", {}), ("vertical_unbatched", "vertical", {}),
                                          ("vertical_batched", "vertical",
                                           {"batched_forward": True, "batched_backward": True})):
                    got, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, lr=lr, seed=seed,
                                       schedule_kind=kind, schedule_extra=extra)
                    print(json.dumps({"precision": precision, "lr": lr, "seed": seed, "schedule": name,
                                      "max_abs_per_step": [_max_abs(a, b) for a, b in zip(got, ref)]}), flush=True)


class _States(L.Callback):
    def __init__(self) -> None:
        self.states: list[dict] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.states.append(trainer.strategy.engine.state_dict())


def fp16_clip(algorithm: str, value: float, lr: float = 1e-3, steps: int = 4) -> None:
    gpt = dataclasses.replace(SMALL_GPT, tied_head=False)
    x, y = token_data(steps * MICRO * MICRO_SIZE, gpt.context_len, gpt.vocab_size)
    ref, _ = fp16_clip_reference(x, y, gpt, steps, MICRO, MICRO_SIZE, lr, algorithm, value)
    torch.manual_seed(0)
    log = _States()
    strategy = snake_strategy.GreedySnakeStrategy(schedule={"kind": "vertical", "num_micro_batches": MICRO},
                                                  precision_plugin=GreedySnakePrecision("16-mixed"))
    L.Trainer(strategy=strategy, max_steps=steps, callbacks=[log], gradient_clip_val=value,
              gradient_clip_algorithm=algorithm, **trainer_kwargs()).fit(
        GPTModule(gpt, learning_rate=lr), DataLoader(TensorDataset(x, y), batch_size=MICRO * MICRO_SIZE))

    def flips(a: dict, b: dict) -> int:  # matmul weights whose fp16 casts (what autocast multiplies) differ
        return sum(int((a[k].half() != b[k].half()).sum()) for k in a if a[k].dim() == 2)

    out = {"algorithm": algorithm, "value": value, "lr": lr,
           "snake_vs_torch": [_max_abs(a, b) for a, b in zip(log.states, ref)],
           "fp16_cast_flips_snake_vs_torch": [flips(a, b) for a, b in zip(log.states, ref)]}
    if algorithm == "norm":
        ref64, _ = fp16_clip_reference(x, y, gpt, steps, MICRO, MICRO_SIZE, lr, algorithm, value, norm_in_float64=True)
        out["torch_float64_norm_vs_torch"] = [_max_abs(a, b) for a, b in zip(ref64, ref)]
        out["snake_vs_torch_float64_norm"] = [_max_abs(a, b) for a, b in zip(log.states, ref64)]
        out["fp16_cast_flips_torch_float64_norm_vs_torch"] = [flips(a, b) for a, b in zip(ref64, ref)]
    print(json.dumps(out))


def batch_noise() -> None:
    """Relative difference of two GPT blocks run on a batch vs per micro-batch, and of a mixing block."""
    torch.manual_seed(0)
    for d, seq, micro_size, micro in ((32, 16, 2, 4), (128, 64, 4, 4), (768, 128, 2, 8)):
        cfg = GPTConfig(vocab_size=64, d_model=d, num_layers=2, num_heads=4, context_len=seq)
        blocks = nn.Sequential(Block(cfg), Block(cfg))
        for dtype, autocast in ((torch.float64, None), (torch.float32, None), (torch.float32, torch.bfloat16),
                                (torch.float32, torch.float16)):
            b = blocks.to(dtype)
            x = torch.randn(micro_size * micro, seq, d, dtype=dtype)
            with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                batched = b(x).double()
                each = torch.cat([b(xi) for xi in x.split(micro_size)]).double()
            print(json.dumps({"d_model": d, "dtype": str(dtype), "autocast": str(autocast),
                              "relative": float((batched - each).abs().max() / each.abs().max())}))

    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, h):
            return h + torch.tanh(self.lin(h - h.mean(0)))

    mix, x = Mix(), torch.randn(8, 16, 32)
    with torch.no_grad():
        batched, each = mix(x), torch.cat([mix(xi) for xi in x.split(2)])
    print(json.dumps({"mixing_block_relative": float((batched - each).abs().max() / each.abs().max())}))


def main() -> None:
    logging.disable(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("fp32").add_argument("--seeds", type=int, default=3)
    clip = sub.add_parser("fp16-clip")
    clip.add_argument("algorithm", choices=["norm", "value"])
    clip.add_argument("value", type=float)
    clip.add_argument("--lr", type=float, default=1e-3)
    sub.add_parser("batch-noise")
    args = parser.parse_args()
    if args.what == "fp32":
        fp32_spread(args.seeds)
    elif args.what == "fp16-clip":
        fp16_clip(args.algorithm, args.value, args.lr)
    else:
        batch_noise()


if __name__ == "__main__":
    main()
