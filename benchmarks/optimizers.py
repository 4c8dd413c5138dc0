"""Optimizers side by side at scale: what each one's state costs a step when it lives on the SSD.

For each optimizer (``CASES``), in its own process, one after the other in one command:

- ``--preset`` (gpt_1b by default) on the defaults (``GreedySnakeStrategy()``, one host budget read once here
  and given to every case): seconds per step (median of the steps after the first), SSD bytes read and
  written per step, optimizer-state bytes per parameter as stored, peak RSS, the plan;
- ``--loss-preset`` (small) for ``--loss-steps`` steps under greedysnake and under plain Lightning with the
  same optimizer, the same data and seed: both loss curves and their largest difference (fp32), beside the
  optimizer's own spread: plain Lightning against itself with the step's samples in 2 micro-batches of 4
  instead of 4 of 2 (only the summation order differs).

Cases: ``adamw`` (torch.optim.AdamW, fp32 state: the fused fast path), ``fast_adamw8bit`` (the opt-in
``snake_strategy.optimizers.FastAdamW8bit``: 8-bit moments of its own format, one compiled step), ``adamw8bit`` (bitsandbytes'
AdamW8bit: uint8 moments + fp32 scales per 256 values, its own step), ``fused_adamw8bit`` (the opt-in
``snake_strategy.optimizers.FusedAdamW8bit``: the same kind of state, stepped by torch's fused kernel), ``adafactor`` (torch.optim.Adafactor:
factored second moments), ``sgd_momentum`` (torch.optim.SGD, momentum 0.9), ``muon`` (torch.optim.Muon on the
2-D matrices; it steps nothing else, and Lightning's automatic optimization takes one optimizer, so the 1-D
gains and biases are frozen in this case).

    flock /tmp/snake-bench.lock python benchmarks/optimizers.py                  # gpt_1b, 3 steps per case
    python benchmarks/optimizers.py --preset gpt_4b --cases adamw,adamw8bit --steps 3 --loss-steps 0
    python benchmarks/optimizers.py --preset small --steps 3 --loss-steps 10 --out /tmp/o.json   # a quick look
    python benchmarks/optimizers.py --cases adamw,fast_adamw8bit --steps 4 --loss-steps 0 --cgroup-gib 16 \
        --out benchmarks/results/optimizers/gpt_1b_fast_adamw8bit.json    # each case in a 16 GiB memory cgroup

Writes ``benchmarks/results/optimizers/<preset>.json`` and ``.png``. Not part of the test suite.
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
sys.path.insert(0, str(HERE.parent))
from benchmarks.common import cgroup_peak_bytes, enter_cgroup, make_cgroup, results_dir, ssd_bytes, step_probe  # noqa: E402

RESULTS = results_dir("optimizers")
CASES = ("adamw", "fast_adamw8bit", "adamw8bit", "fused_adamw8bit", "adafactor", "sgd_momentum", "muon")
LR = {"adamw": 1e-3, "fast_adamw8bit": 1e-3, "adamw8bit": 1e-3, "fused_adamw8bit": 1e-3, "adafactor": 1e-2, "sgd_momentum": 0.05,
      "muon": 0.02}


def make_optimizer(name: str, module, lr: float):
    import torch
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    if name == "adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(groups, lr=lr)
    if name == "fused_adamw8bit":
        from snake_strategy.optimizers import FusedAdamW8bit
        return FusedAdamW8bit(groups, lr=lr)
    if name == "fast_adamw8bit":
        from snake_strategy.optimizers import FastAdamW8bit
        return FastAdamW8bit(groups, lr=lr)
    if name == "adafactor":
        return torch.optim.Adafactor(groups, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if name == "muon":
        return torch.optim.Muon(groups, lr=lr)
    raise ValueError(f"unknown case {name}; choose from {CASES}")


def module_for(name: str, preset_name: str, context_len: int, lr: float):
    from snake_strategy.gpt import GPTModule, preset

    class Module(GPTModule):
        def configure_optimizers(self):
            if name == "muon":  # torch's Muon steps 2-D matrices only
                for p in self.parameters():
                    if p.dim() < 2:
                        p.requires_grad_(False)
            return make_optimizer(name, self, lr)

    cfg = preset(preset_name)
    cfg.context_len = context_len
    return Module(cfg, learning_rate=lr)


def _loader(steps: int, batch: int, context_len: int):
    from torch.utils.data import DataLoader, Subset

    from snake_strategy.data import ByteWindows, load_corpus
    windows = ByteWindows(load_corpus("stdlib"), context_len)
    return DataLoader(Subset(windows, range(batch * steps)), batch_size=batch, shuffle=False)


def run_scale(name: str, preset_name: str, steps: int, context_len: int, budget: int | None, ssd_root: str | None) -> dict:
    import lightning as L
    import torch

    import snake_strategy
    torch.manual_seed(0)
    module = module_for(name, preset_name, context_len, LR[name])
    ssd_dir = tempfile.mkdtemp(prefix="snake-opt-", dir=ssd_root)
    strategy = snake_strategy.GreedySnakeStrategy(storage={"ssd_dir": ssd_dir, "placement": "auto",
                                                           "host_budget_bytes": budget})
    probe = step_probe(f"{name} ", flush_at_end=True, rss_in_line=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe])
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=_loader(steps, 4, context_len))
    left_behind = sorted(str(f.relative_to(ssd_dir)) for f in Path(ssd_dir).rglob("*"))  # the engine's files: none
    shutil.rmtree(ssd_dir)
    plan = strategy.plan
    steady = probe.traffic[1:] or probe.traffic  # each step's traffic, the optimizer worker's included
    return dict(case=name, params=module.config.num_params(), s_per_step=probe.steady_s_per_step(),
                step_s=probe.step_s, losses=probe.losses,
                ssd_read_bytes_per_step=statistics.median(ssd_bytes(t, "read") for t in steady),
                ssd_write_bytes_per_step=statistics.median(ssd_bytes(t, "write") for t in steady),
                state_bytes_per_param=plan.as_dict()["optimizer"]["state_bytes_per_param"],
                optimizer=plan.as_dict()["optimizer"], peak_rss_bytes=probe.train_peak_rss_bytes,
                host_budget_bytes=plan.host_budget_bytes, plan_host_bytes=plan.host_bytes, describe=plan.describe(),
                optimizer_busy_s=[s.optimizer_busy_s for s in probe.stats], total_s=time.perf_counter() - start,
                ssd_dir_left_behind=left_behind)


def run_losses(name: str, preset_name: str, steps: int, context_len: int) -> dict:
    """The loss curve of greedysnake and of plain Lightning with the same optimizer, data and seed."""
    import lightning as L
    import torch

    import snake_strategy
    curves = {}
    # lightning_2x4: plain Lightning on the same samples cut into 2 micro-batches of 4: only the gradients'
    # summation order differs from "lightning", so the two bound the optimizer's own spread.
    for label in ("greedysnake", "lightning", "lightning_2x4"):
        torch.manual_seed(0)
        module = module_for(name, preset_name, context_len, LR[name])
        losses: list[float] = []

        class Losses(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(float(outputs["loss"]))

        strategy = snake_strategy.GreedySnakeStrategy() if label == "greedysnake" else "auto"
        accumulate = {"greedysnake": 1, "lightning": 4, "lightning_2x4": 2}[label]
        kw = {} if accumulate == 1 else {"accumulate_grad_batches": accumulate}
        batch = 8 // accumulate  # 8 samples a step either way
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Losses()], **kw)
        trainer.fit(module, train_dataloaders=_loader(steps * 8 // batch, batch, context_len))
        # Under accumulate_grad_batches Lightning reports each micro-batch's loss divided by the 4: their sum is
        # the step's mean loss, what greedysnake reports.
        curves[label] = [sum(losses[i:i + accumulate]) for i in range(0, len(losses), accumulate)]
    diff = max(abs(a - b) for a, b in zip(curves["greedysnake"], curves["lightning"]))
    spread = max(abs(a - b) for a, b in zip(curves["lightning_2x4"], curves["lightning"]))
    return dict(case=name, loss_preset=preset_name, curves=curves, max_abs_loss_diff=diff, own_spread=spread,
                final_loss={k: v[-1] for k, v in curves.items()}, first_loss=curves["lightning"][0])


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = [c for c in report["cases"] if "s_per_step" in c]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = [c["case"] for c in cases]
    axes[0].bar(names, [c["s_per_step"] for c in cases])
    axes[0].set_ylabel("s / step")
    axes[0].set_title(f"{report['preset']}: step time")
    axes[1].bar(names, [(c["ssd_read_bytes_per_step"] + c["ssd_write_bytes_per_step"]) / 2**30 for c in cases])
    axes[1].set_ylabel("GiB over the SSD per step")
    axes[1].set_title("SSD bytes (read + write)")
    for c in report.get("losses", []):
        axes[2].plot(c["curves"]["lightning"], label=f"{c['case']} (Lightning)")
        axes[2].plot(c["curves"]["greedysnake"], "--", label=f"{c['case']} (greedysnake)")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("loss")
    axes[2].set_title(f"{report.get('loss_preset')}: loss curves")
    axes[2].legend(fontsize=6)
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _summary_line(c: dict) -> str:
    """One case's line of the final summary: a scale run, a loss-curve run, or a failure."""
    if "error" in c:
        return f"FAILED {c['args']}: {c['error'][-800:]}"
    if "curves" in c:
        return (f"{c['case']:>13}: loss {c['first_loss']:.3f} -> {c['final_loss']['lightning']:.4f} (Lightning) / "
                f"{c['final_loss']['greedysnake']:.4f} (greedysnake), max |diff| {c['max_abs_loss_diff']:.2e}; "
                f"Lightning against itself (2x4 vs 4x2 micro-batches) {c.get('own_spread', float('nan')):.2e}")
    return (f"{c['case']:>13}: {c['s_per_step']:.1f} s/step ({c.get('speedup_vs_adamw', float('nan')):.2f}x AdamW), "
            f"SSD {c['ssd_read_bytes_per_step'] / 2**30:.2f} GiB read + {c['ssd_write_bytes_per_step'] / 2**30:.2f} "
            f"GiB written, {c['state_bytes_per_param']:.3g} B/param of state, peak RSS "
            f"{c['peak_rss_bytes'] / 2**30:.2f} of {c['host_budget_bytes'] / 2**30:.2f} GiB")


def _subprocess(args: list[str], cgroup_gib: float | None = None) -> dict:
    """A worker process, inside a fresh memory cgroup of ``cgroup_gib`` when given (its peak recorded)."""
    cgroup = make_cgroup(int(cgroup_gib * 2**30), "optimizers") if cgroup_gib else None
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=enter_cgroup(cgroup) if cgroup else None)
    result = None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        else:
            print(line, end="", flush=True)
    error = proc.stderr.read()
    proc.wait()
    result = result if proc.returncode == 0 and result is not None else {"error": error[-3000:], "args": args}
    if cgroup:
        result.update(cgroup_bytes=int(cgroup_gib * 2**30), cgroup_peak_bytes=cgroup_peak_bytes(cgroup))
        os.rmdir(cgroup)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt_1b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--loss-preset", default="small")
    p.add_argument("--loss-steps", type=int, default=50)
    p.add_argument("--host-budget-bytes", type=int, default=None)
    p.add_argument("--ssd-root", default=None)
    p.add_argument("--cgroup-gib", type=float, default=None,
                   help="run each scale case in a memory cgroup of this size, on its default host budget there")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.worker:
        kind, name = args.worker.split(":")
        result = run_scale(name, args.preset, args.steps, args.context_len, args.host_budget_bytes, args.ssd_root) \
            if kind == "scale" else run_losses(name, args.loss_preset, args.loss_steps, args.context_len)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    out = Path(args.out or RESULTS / f"{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.host_budget_bytes is None and args.cgroup_gib is None:
        from snake_strategy.planning.machine import host_budget
        args.host_budget_bytes = host_budget(None).budget_bytes
    report = {"preset": args.preset, "steps": args.steps, "context_len": args.context_len, "cgroup_gib": args.cgroup_gib,
              "loss_preset": args.loss_preset, "loss_steps": args.loss_steps,
              "host_budget_bytes": args.host_budget_bytes, "cases": [], "losses": []}
    common = ["--preset", args.preset, "--steps", str(args.steps), "--context-len", str(args.context_len),
              "--loss-preset", args.loss_preset,
              "--loss-steps", str(args.loss_steps)] + (["--ssd-root", args.ssd_root] if args.ssd_root else [])
    common += ["--host-budget-bytes", str(args.host_budget_bytes)] if args.host_budget_bytes is not None else []
    names = args.cases.split(",")
    for name in names:
        if args.steps > 0:
            report["cases"].append(_subprocess(["--worker", f"scale:{name}", *common], args.cgroup_gib))
        if args.loss_steps > 0:
            report["losses"].append(_subprocess(["--worker", f"losses:{name}", *common]))
        base = next((c for c in report["cases"] if c.get("case") == "adamw" and "s_per_step" in c), None)
        for c in report["cases"]:
            if base is not None and "s_per_step" in c:
                c["speedup_vs_adamw"] = base["s_per_step"] / c["s_per_step"]
        out.write_text(json.dumps(report, indent=1))  # after every case: a run cut short keeps what it measured
    _plot(report, out.with_suffix(".png"))
    for c in report["cases"] + report["losses"]:
        print(_summary_line(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
