"""Does an 8-bit AdamW state train as well as fp32 AdamW? The small preset (byte-level GPT, 10.7 M parameters)
on the standard-library corpus for ``--steps`` optimizer steps under plain Lightning, once per optimizer and
seed (the seed sets the weights and the data order), the same LR schedule (warmup then cosine) for all.

    python benchmarks/lowbit_quality.py                       # 300 steps, 3 seeds, ~25 min on 2 cores
    python benchmarks/lowbit_quality.py --steps 50 --seeds 0  # a smoke run
    python benchmarks/lowbit_quality.py --optimizers fast_adamw8bit \
        --reuse benchmarks/results/lowbit_quality/lowbit_quality.json   # one class again, the others' runs kept

The verdict per low-bit optimizer: its final loss (the mean train loss of the last ``--tail`` steps, and the
validation loss at the end) against the seed-to-seed spread of fp32 AdamW's, i.e. inside [min, max] of the fp32
seeds widened by nothing. Writes ``benchmarks/results/lowbit_quality/lowbit_quality.json`` and ``.png`` (the loss
curves).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import results_dir  # noqa: E402

from snake_strategy.data import TextDataModule  # noqa: E402
from snake_strategy.gpt import GPTModule, WarmupCosineSchedule  # noqa: E402

OPTIMIZERS = ("adamw", "fast_adamw8bit", "fused_adamw8bit")


def make_optimizer(name: str, groups: list[dict], lr: float, betas: tuple[float, float]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    from snake_strategy.optimizers import FastAdamW8bit, FusedAdamW8bit
    cls = {"fast_adamw8bit": FastAdamW8bit, "fused_adamw8bit": FusedAdamW8bit}[name]
    return cls(groups, lr=lr, betas=betas)


class Module(GPTModule):
    def __init__(self, optimizer: str, **kw) -> None:
        super().__init__(**kw)
        self.optimizer_name = optimizer
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach() if isinstance(loss, torch.Tensor) else loss["loss"].detach()))
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = make_optimizer(self.optimizer_name, groups, hp.learning_rate, tuple(hp.betas))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosineSchedule(hp.warmup_steps, hp.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def validation_loss(module: GPTModule, data: TextDataModule, batches: int) -> float:
    module.eval()
    losses = []
    with torch.no_grad():
        for i, batch in enumerate(data.val_dataloader()):
            if i == batches:
                break
            losses.append(float(module.compute_loss(module(batch), batch)))
    return statistics.mean(losses)


def run(name: str, seed: int, args) -> dict:
    L.seed_everything(seed, workers=True)
    data = TextDataModule(context_len=128, micro_batch_size=args.batch, num_micro_batches=1, seed=seed)
    module = Module(name, config="small", learning_rate=args.lr, weight_decay=0.1, betas=(0.9, 0.95),
                    warmup_steps=args.steps // 10, max_steps=args.steps)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    wall_s = time.perf_counter() - start
    data.setup("validate")
    losses = module.losses
    return dict(optimizer=name, seed=seed, losses=losses, final_train_loss=statistics.mean(losses[-args.tail:]),
                val_loss=validation_loss(module, data, args.val_batches), wall_s=wall_s)


def verdict(runs: list[dict]) -> dict:
    out = {}
    base = [r for r in runs if r["optimizer"] == "adamw"]
    if not base:
        return {"note": "no fp32 AdamW runs to judge against: add adamw to --optimizers or pass --reuse"}
    for key in ("final_train_loss", "val_loss"):
        lo, hi = min(r[key] for r in base), max(r[key] for r in base)
        out[key] = {"adamw_spread": [lo, hi]}
        for name in sorted({r["optimizer"] for r in runs} - {"adamw"}):
            vals = [r[key] for r in runs if r["optimizer"] == name]
            # the same seed is the same initial weights and data order: the paired difference isolates the optimizer
            paired = [r[key] - next(b[key] for b in base if b["seed"] == r["seed"])
                      for r in runs if r["optimizer"] == name]
            out[key][name] = dict(values=vals, mean=statistics.mean(vals),
                                  mean_within_adamw_spread=lo <= statistics.mean(vals) <= hi,
                                  all_within_adamw_spread=all(lo <= v <= hi for v in vals),
                                  none_above_adamw_spread=all(v <= hi for v in vals),
                                  minus_adamw_same_seed=paired)
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = dict(zip(OPTIMIZERS, ("black", "tab:red", "tab:blue")))
    for r in report["runs"]:
        smooth = [statistics.mean(r["losses"][max(0, i - 9):i + 1]) for i in range(len(r["losses"]))]
        ax.plot(smooth, color=colors.get(r["optimizer"]), alpha=0.7, lw=1,
                label=r["optimizer"] if r["seed"] == report["args"]["seeds"][0] else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (10-step mean)")
    ax.set_title("small preset, plain Lightning: fp32 AdamW against 8-bit states, seeds as lines")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizers", default="adamw,fast_adamw8bit,fused_adamw8bit")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batch", type=int, default=4, help="windows of 128 bytes per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--out", default=str(results_dir("lowbit_quality") / "lowbit_quality.json"))
    ap.add_argument("--verdict-only", action="store_true", help="recompute the verdict and plot of --out's runs")
    ap.add_argument("--reuse", default=None,
                    help="an earlier report: its runs of the optimizers not in --optimizers join this one (same steps, "
                         "seeds, batch and lr), e.g. to rerun a changed low-bit class against recorded fp32 AdamW runs")
    args = ap.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    report = dict(args=vars(args), runs=[])
    if args.verdict_only:
        report = json.loads(Path(args.out).read_text())
        args.seeds = []
    if args.reuse:
        earlier = json.loads(Path(args.reuse).read_text())
        same = ("steps", "batch", "lr", "tail", "val_batches")
        if any(earlier["args"][k] != vars(args)[k] for k in same) or not set(args.seeds) <= set(earlier["args"]["seeds"]):
            raise ValueError(f"--reuse {args.reuse} ran with other settings ({ {k: earlier['args'][k] for k in same} }, "
                             f"seeds {earlier['args']['seeds']}): rerun every optimizer instead")
        rerun = set(args.optimizers.split(","))
        report["runs"] += [{**r, "reused_from": args.reuse} for r in earlier["runs"]
                           if r["optimizer"] not in rerun and r["seed"] in args.seeds]
    for seed in args.seeds:
        for name in args.optimizers.split(","):
            row = run(name, seed, args)
            report["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    report["verdict"] = verdict(report["runs"])
    print(json.dumps(report["verdict"], indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print("wrote", out)


if __name__ == "__main__":
    main()
