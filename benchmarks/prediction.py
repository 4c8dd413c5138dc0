"""The planner against the truth: predicted and measured step time, planned host bytes and the peak RSS
of the steps, on the defaults (``GreedySnakeStrategy()``: every setting the planner's).

    python benchmarks/prediction.py                                # r1, io_bound, gpt_1b (+ clip, bf16)
    python benchmarks/prediction.py --cases gpt_4b --steps 5 --cgroup-gib 16   # inside a 16 GiB memory cgroup
    python benchmarks/prediction.py --cases gpt_1b_moe,hf_llama_1b           # experts; an HF Llama from safetensors

Each case is a child process (a clean peak RSS). Per step it keeps the wall time and the engine's measured
busy times (``StepStats``: compute, SSD, optimizer worker); per run the prediction made before step 1
(from the hardware probe), the corrected one (``plan.prediction`` after the steps: the first steady step's
measured rates), the bound each names, the plan's host bytes against the peak RSS of the steps
(``VmHWM``, reset after setup) and the budget. Writes ``benchmarks/results/prediction/<name>.json``.
Not part of the test suite (gpt_4b: ~15 minutes).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import cgroup_peak_bytes, enter_cgroup, make_cgroup, results_dir, ssd_bytes, write_random_hf

RESULTS = results_dir("prediction")

# The presets' data as the other benchmarks feed them: context, samples per micro-batch, micro-batches.
CASES = {
    "r1": dict(preset="r1", context_len=128, micro_batch_size=2, num_micro=4),
    "io_bound": dict(preset="io_bound", context_len=32, micro_batch_size=1, num_micro=8),
    "gpt_1b": dict(preset="gpt_1b", context_len=128, micro_batch_size=1, num_micro=4),
    "gpt_1b_clip": dict(preset="gpt_1b", context_len=128, micro_batch_size=1, num_micro=4, clip=1.0),
    "gpt_1b_bf16": dict(preset="gpt_1b", context_len=128, micro_batch_size=1, num_micro=4, precision="bf16-mixed"),
    "gpt_4b": dict(preset="gpt_4b", context_len=128, micro_batch_size=1, num_micro=4),
    # 12 blocks of 8 experts (top-2) at gpt_1b's width: the router's choice moves the FLOPs per token
    "gpt_1b_moe": dict(preset="gpt_1b_moe", context_len=128, micro_batch_size=1, num_micro=4),
    # an HF Llama of TinyLlama-1.1B's shape, random bf16 safetensors written to a temporary directory first
    "hf_llama_1b": dict(hf_llama=dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                                      max_position_embeddings=2048, tie_word_embeddings=False),
                        context_len=128, micro_batch_size=1, num_micro=4),
}


def _vm_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def run_case(name: str, steps: int, ssd_root: str | None) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, Subset

    import snake_strategy
    from snake_strategy.data import ByteWindows, load_corpus
    from snake_strategy.gpt import GPTModule, preset

    case = CASES[name]
    torch.manual_seed(0)
    batch = case["micro_batch_size"] * case["num_micro"]
    model_dir = None
    if "hf_llama" in case:
        from transformers import LlamaConfig

        from snake_strategy.hf import HFCausalLM
        model_dir = Path(tempfile.mkdtemp(prefix="snake-pred-hf-", dir=ssd_root))
        write_random_hf(model_dir, LlamaConfig(**case["hf_llama"]), dtype=torch.bfloat16)
        module = HFCausalLM(model_dir, learning_rate=1e-4)
        ids = torch.randint(0, case["hf_llama"]["vocab_size"], (batch * steps, case["context_len"]),
                            generator=torch.Generator().manual_seed(1))
        loader = DataLoader([{"input_ids": row} for row in ids], batch_size=batch, shuffle=False)
    else:
        cfg = preset(case["preset"])
        cfg.context_len = case["context_len"]
        module = GPTModule(cfg, learning_rate=1e-4)
        windows = ByteWindows(load_corpus("stdlib"), case["context_len"])
        loader = DataLoader(Subset(windows, range(batch * steps)), batch_size=batch, shuffle=False)
    ssd_dir = tempfile.mkdtemp(prefix="snake-pred-", dir=ssd_root)
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"ssd_dir": ssd_dir},
        schedule={"num_micro_batches": case["num_micro"]})
    step_s, stats, marks = [], [], {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            marks["setup_host"] = trainer.strategy.plan.step_host_bytes  # planned before step 1 (None: no batch yet)
            hardware = trainer.strategy.plan.hardware  # the rates before step 1: the probe's and the timed unit's
            marks["setup_hardware"] = dataclasses.asdict(hardware) if hardware is not None else None
            marks["setup_rss"] = _vm_status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: the steps' peak

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            marks["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step_s.append(time.perf_counter() - marks["start"])
            if len(step_s) == 1:  # predicted again with step 1's kept graphs and checkpoints, not yet calibrated
                marks["step1_prediction"] = trainer.strategy.plan.prediction
            s = trainer.strategy.engine.last_step
            stats.append(s)
            compute = s.train_s - s.io_wait_s - s.backpressure_wait_s
            print(f"{name} step {len(step_s)}: {step_s[-1]:.1f} s (compute {compute:.1f}, ssd busy {s.ssd_busy_s:.1f}, "
                  f"optimizer busy {s.optimizer_busy_s:.1f}, io wait {s.io_wait_s:.1f}, optimizer tail {s.optimizer_s:.1f}),"
                  f" RSS peak {_vm_status('VmHWM') / 2**30:.2f} GiB", flush=True)

        def on_train_end(self, trainer, pl_module):
            engine = trainer.strategy.engine
            engine.flush()
            marks["peak"] = _vm_status("VmHWM")
            marks["engine_items"] = engine.host_bytes_plan(engine.checkpoint_bytes)
            marks["engine_host"] = sum(marks["engine_items"].values())

    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        precision=case.get("precision", "32-true"), gradient_clip_val=case.get("clip"),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Probe()])
    trainer.fit(module, train_dataloaders=loader)
    if model_dir is not None:
        shutil.rmtree(model_dir)
    left_behind = sorted(str(f.relative_to(ssd_dir)) for f in Path(ssd_dir).rglob("*"))  # the engine's files: none
    shutil.rmtree(ssd_dir)
    plan = strategy.plan
    setup = plan.setup_prediction  # made before step 1 ran
    steady = step_s[1:] or step_s
    measured = statistics.median(steady)
    return dict(
        case=name, **case, steps=steps, step_s=step_s, s_per_step=measured, ssd_dir_left_behind=left_behind,
        tokens_per_step=batch * case["context_len"],
        setup_prediction=setup.as_dict() if setup else None, setup_hardware=marks.get("setup_hardware"),
        step1_prediction=marks["step1_prediction"].as_dict() if marks.get("step1_prediction") else None,
        step1_error=(marks["step1_prediction"].roofline_s / measured - 1) if marks.get("step1_prediction") else None,
        prediction=plan.prediction.as_dict() if plan.prediction else None,
        setup_error=(setup.roofline_s / measured - 1) if setup else None,
        error=(plan.prediction.roofline_s / measured - 1) if plan.prediction else None,
        stats=[s.as_dict() for s in stats],
        ssd_read_bytes_per_step=statistics.median(ssd_bytes(s.step_traffic(), "read") for s in stats[1:] or stats),
        ssd_write_bytes_per_step=statistics.median(ssd_bytes(s.step_traffic(), "write") for s in stats[1:] or stats),
        host_budget_bytes=plan.host_budget_bytes, plan_host_bytes=plan.host_bytes,
        engine_host_bytes=marks["engine_host"], engine_host_items=marks["engine_items"],
        setup_host_bytes=marks["setup_host"],
        # the process's baseline at setup + the host plan made before step 1, against the steps' peak RSS
        setup_memory_error=((plan.process_baseline_bytes + marks["setup_host"]) / marks["peak"] - 1)
        if marks["setup_host"] else None,
        setup_rss_bytes=marks["setup_rss"], peak_rss_bytes=marks["peak"], describe=plan.describe(),
        plan=plan.as_dict())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="r1,io_bound,gpt_1b,gpt_1b_clip,gpt_1b_bf16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ssd-root", default=None)
    p.add_argument("--cgroup-gib", type=float, default=None, help="run each case in a memory cgroup of this size (root)")
    p.add_argument("--name", default=None, help="results file name (default: the cases joined by '+')")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(run_case(args.worker, args.steps, args.ssd_root)))
        return
    results = []
    for name in args.cases.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, __file__, "--worker", name, "--out", out.name, "--steps", str(args.steps)]
            cmd += ["--ssd-root", args.ssd_root] if args.ssd_root else []
            cgroup = make_cgroup(int(args.cgroup_gib * 2**30), f"pred-{name}") if args.cgroup_gib else None
            rc = subprocess.run(cmd, preexec_fn=enter_cgroup(cgroup) if cgroup else None).returncode
            peak = cgroup_peak_bytes(cgroup) if cgroup else None
            if cgroup:
                os.rmdir(cgroup)
            if rc != 0:
                results.append(dict(case=name, failed=rc, cgroup_gib=args.cgroup_gib))
                continue
            results.append({**json.loads(Path(out.name).read_text()), "cgroup_gib": args.cgroup_gib,
                            "cgroup_peak_bytes": peak})
        r = results[-1]
        pred = r["prediction"]
        print(f"== {name}: measured {r['s_per_step']:.2f} s/step; predicted {pred['roofline_s']:.2f} ({pred['bound']}-bound, "
              f"error {100 * r['error']:+.0f}%), at setup {r['setup_prediction']['roofline_s']:.2f} "
              f"({r['setup_prediction']['bound']}, {100 * r['setup_error']:+.0f}%), after step 1 "
              f"{r['step1_prediction']['roofline_s']:.2f} ({100 * r['step1_error']:+.0f}%); host plan "
              f"{r['engine_host_bytes'] / 2**30:.2f} GiB (before step 1: memory error "
              f"{100 * (r['setup_memory_error'] or 0):+.0f}%), peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, budget "
              f"{r['host_budget_bytes'] / 2**30:.2f} GiB", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name or '+'.join(args.cases.split(','))}.json"
    path.write_text(json.dumps(dict(cases=results), indent=1))
    print(f"wrote {path}")
    _plot([r for r in results if "failed" not in r], path.with_suffix(".png"))


def _plot(results: list[dict], path: Path) -> None:
    """Predicted (before step 1, calibrated) against measured s/step, one point per case, log-log."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 5))
    measured = [r["s_per_step"] for r in results]
    ax.scatter(measured, [r["setup_prediction"]["roofline_s"] for r in results], label="before step 1")
    ax.scatter(measured, [r["prediction"]["roofline_s"] for r in results], marker="x", label="calibrated")
    for r in results:
        ax.annotate(r["case"], (r["s_per_step"], r["setup_prediction"]["roofline_s"]), fontsize=8)
    lo, hi = min(measured) / 1.5, max(measured) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [0.85 * lo, 0.85 * hi], [1.15 * lo, 1.15 * hi], color="grey", alpha=0.2, label="±15%")
    ax.set(xscale="log", yscale="log", xlabel="measured s/step (median of steps 2-5)", ylabel="predicted s/step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
