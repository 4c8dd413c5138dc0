"""LoRA vs full fine-tuning of the same >= 1B-parameter Llama-shaped model, its base on the SSD.

    python benchmarks/finetune.py                          # hidden 2048 x 20 layers, vocab 32000: 1.16 B params
    python benchmarks/finetune.py --layers 4 --steps 2     # smaller, for a quick look

1. Random weights (norms 1, the rest N(0, 0.02)) are written as sharded safetensors + config.json with
   ``snake_strategy.hf.export_hf``, one tensor in memory at a time.
2. Each system runs in a fresh subprocess (its own peak RSS): ``HFCausalLM(dir)`` built on the meta
   device and streamed in from the directory unit by unit;
   - ``lora``: ``peft.get_peft_model`` (rank 8 on q_proj/v_proj) on the meta-built model, adapters
     initialised as peft does when each unit is materialized; the base is frozen;
   - ``full``: every parameter trained.
   Both with the same storage: weights and Adam moments on the SSD, gradients and activation checkpoints
   on the host, vertical schedule, 2 micro-batches of 1 x ``--context`` tokens, fp32, alpha 0.25.
3. Per step: seconds, bytes moved per tier/state/direction (the engine's counters, training + optimizer
   phase), the process's peak RSS during training (at the end of fit, before teardown gives the trained
   weights back to the module, which then holds the whole model) and after it, the engine's host plan;
   the load average of the machine before and after each run.

Writes ``benchmarks/results/finetune/finetune.json`` and ``finetune.png``. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import peak_rss_bytes, results_dir, ssd_bytes, step_probe, write_random_hf

HERE = Path(__file__).resolve().parent
RESULTS = results_dir("finetune")
GIB = 2**30


def llama_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def write_model(args) -> int:
    """Random weights as sharded safetensors in ``args.dir``; returns the parameter count."""
    return write_random_hf(Path(args.dir), llama_config(args), max_shard_bytes=GIB)


def worker(args) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import snake_strategy
    from snake_strategy.hf import HFCausalLM

    module = HFCausalLM(args.dir, learning_rate=1e-4)
    if args.worker == "lora":
        import peft
        with torch.device("meta"):
            module.configure_model()  # nothing of the base in memory: the strategy streams it in
        torch.manual_seed(0)
        peft.get_peft_model(module, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                    lora_dropout=0.0))
    ssd_dir = tempfile.mkdtemp(prefix=f"snake-finetune-{args.worker}-", dir=args.ssd_root)
    storage = snake_strategy.StorageConfig(ssd_dir=ssd_dir, weights={"ssd": 1.0}, optimizer={"ssd": 1.0},
                                           gradients={"host": 1.0}, checkpoints={"host": 1.0},
                                           host_budget_bytes=int(args.host_budget_gib * GIB))
    schedule = snake_strategy.ScheduleConfig(kind="vertical", num_micro_batches=2, alpha=0.25)
    strategy = snake_strategy.GreedySnakeStrategy(storage=storage, schedule=schedule, progress=True)
    probe = step_probe(label=f"{args.worker} ")

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (2 * args.steps, args.context), generator=g)
    loader = DataLoader([{"input_ids": row} for row in ids], batch_size=2, shuffle=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe])
    start = time.perf_counter()
    load_before = os.getloadavg()
    trainer.fit(module, train_dataloaders=loader)
    shutil.rmtree(ssd_dir, ignore_errors=True)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)

    def per_tier(t: dict, direction: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, v in t.items():
            tier, _, d = key.split("/")
            if d == direction:
                out[tier] = out.get(tier, 0) + v
        return out

    steady = probe.traffic[1:] or probe.traffic
    return dict(system=args.worker, trainable_params=trainable, s_per_step=probe.steady_s_per_step(),
                step_s=probe.step_s, losses=probe.losses, setup_s=(probe.setup_done or start) - start,
                peak_rss_bytes=probe.train_peak_rss_bytes, host_plan_bytes=sum(probe.host_plan_bytes.values()),
                peak_rss_after_teardown_bytes=peak_rss_bytes(),
                traffic_per_step=steady[-1], read_bytes_per_step_by_tier=per_tier(steady[-1], "read"),
                write_bytes_per_step_by_tier=per_tier(steady[-1], "write"),
                ssd_read_bytes_per_step=ssd_bytes(steady[-1], "read"), ssd_write_bytes_per_step=ssd_bytes(steady[-1], "write"),
                load_average_before=load_before, load_average_after=os.getloadavg())


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    names = [r["system"] for r in runs]
    panels = [("s / step", [r["s_per_step"] for r in runs]),
              ("SSD read GB / step", [r["ssd_read_bytes_per_step"] / 1e9 for r in runs]),
              ("SSD written GB / step", [r["ssd_write_bytes_per_step"] / 1e9 for r in runs]),
              ("peak RSS in training GiB", [r["peak_rss_bytes"] / GIB for r in runs])]
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 3.2))
    for ax, (title, values) in zip(axes, panels):
        ax.bar(names, values, color=["tab:green", "tab:blue"][:len(values)])
        ax.set_title(title)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom")
    fig.suptitle(f"{report['params'] / 1e9:.2f} B-param Llama shape, base on SSD, {report['steps']} steps "
                 "(shared 2-core machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--host-budget-gib", type=float, default=8.0)
    p.add_argument("--systems", default="lora,full")
    p.add_argument("--ssd-root", default=None, help="where the model and the SSD tiers go (default: the temp dir)")
    p.add_argument("--out", default=str(RESULTS / "finetune.json"))
    p.add_argument("--worker", choices=("lora", "full"), help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    args.dir = tempfile.mkdtemp(prefix="snake-finetune-model-", dir=args.ssd_root)
    try:
        start = time.perf_counter()
        params = write_model(args)
        write_s = time.perf_counter() - start
        print(f"wrote {params / 1e9:.2f} B params to {args.dir} in {write_s:.0f} s", flush=True)
        runs = []
        for system in args.systems.split(","):
            cmd = [sys.executable, __file__, "--worker", system, "--dir", args.dir] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k in ("layers", "hidden", "intermediate", "vocab", "context", "steps", "host_budget_gib", "ssd_root")
                and v is not None]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            sys.stdout.write(proc.stdout[-2000:])
            result = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")),
                          None)
            if proc.returncode != 0 or result is None:
                result = dict(system=system, failed=True, stderr=proc.stderr[-3000:])
            runs.append(result)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    report = dict(params=params, model_bytes=params * 4, steps=args.steps, context=args.context, micro_batches=2,
                  host_budget_bytes=int(args.host_budget_gib * GIB), write_model_s=write_s, runs=runs,
                  command=" ".join([sys.executable, "benchmarks/finetune.py"] + (argv or sys.argv[1:])))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if all(not r.get("failed") for r in runs):
        _plot(report, out.with_suffix(".png"))
    print(json.dumps({r["system"]: {k: r.get(k) for k in ("s_per_step", "ssd_read_bytes_per_step",
                                                            "ssd_write_bytes_per_step", "peak_rss_bytes", "failed")}
                      for r in runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
