"""A mixture-of-experts GPT at gpt_1b scale (``gpt_1b_moe``: 1.1B parameters, 8 experts per block, top-2) on the
defaults, in a memory cgroup: s/step, bytes per tier per step, the optimizer bytes skipped for experts that sat
a step out, and the peak RSS against the plan.

    python benchmarks/moe.py                                  # both cases, 16 GiB cgroup, 3 steps each
    python benchmarks/moe.py --preset tiny_moe --memory-limit-gib 4 --steps 2    # a quick look

Two cases run as children, each in its own cgroup (``memory.max``), with ``GreedySnakeStrategy()`` on the
defaults (the host budget comes from the cgroup):

- ``many_tokens``: ``--batch`` samples of ``--context-len`` tokens a step: most experts of every block get
  tokens (at initialisation the router still sends whole groups of tokens to the same experts, so some
  sit out even here);
- ``few_tokens``: ``--few-tokens`` tokens a step (4 samples, one per default micro-batch, of
  ``--few-tokens / 4`` tokens): each block routes them to at most 2 x that many experts, the others sit the
  step out, and their master weights and moments stay where they are.

Writes ``benchmarks/results/moe/<preset>.json`` and ``.png``. Not part of the test suite.
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

from common import cgroup_peak_bytes, enter_cgroup, make_cgroup, peak_rss_bytes, results_dir, step_probe

HERE = Path(__file__).resolve().parent
RESULTS = results_dir("moe")
TIERS = ("device", "host", "ssd")


def child(args) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import snake_strategy
    from snake_strategy.gpt import GPTConfig, GPTModule, preset

    cfg = preset(args.preset) if args.preset != "tiny_moe" else GPTConfig(
        vocab_size=256, d_model=128, num_layers=4, num_heads=4, context_len=64, num_experts=8, experts_per_token=2)
    cfg.context_len = max(cfg.context_len, args.context_len)
    torch.manual_seed(0)
    module = GPTModule(cfg, learning_rate=args.lr)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch * args.steps, args.context_len + 1), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch, shuffle=False)
    strategy = snake_strategy.GreedySnakeStrategy(progress=True)  # the defaults: planned for the cgroup
    probe = step_probe(label=f"{args.case} ", flush_at_end=True, rss_in_line=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe])
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    per_tier = [{f"{tier}_{direction}_bytes": sum(v for k, v in t.items()
                                                  if k.startswith(tier + "/") and k.endswith("/" + direction))
                 for tier in TIERS for direction in ("read", "write")} for t in probe.traffic]
    plan = probe.host_plan_bytes
    return dict(
        case=args.case, preset=args.preset, params=cfg.num_params(), active_params_per_token=(
            cfg.num_layers * cfg.block_params(active=True)), tokens_per_step=args.batch * args.context_len,
        s_per_step=probe.steady_s_per_step(), step_s=probe.step_s, losses=probe.losses,
        setup_s=(probe.setup_done or start) - start,
        bytes_per_step=per_tier,
        median_bytes_per_step={k: int(statistics.median(t[k] for t in per_tier)) for k in per_tier[0]},
        optimizer_skipped_bytes=[int(s.optimizer_skipped_bytes) for s in probe.stats],
        peak_rss_bytes=probe.train_peak_rss_bytes or peak_rss_bytes(),
        host_plan_bytes=plan, host_plan_total_bytes=sum(plan.values()),
        host_budget_bytes=strategy.plan.storage.host_budget_bytes,
        prediction=strategy.prediction.as_dict(),
    )


def run_case(args, case: str, batch: int, context_len: int, work: Path) -> dict:
    cgroup = make_cgroup(int(args.memory_limit_gib * 2**30), "moe")
    out = work / f"{case}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--case", case, "--preset", args.preset,
           "--batch", str(batch), "--context-len", str(context_len), "--steps", str(args.steps), "--lr", str(args.lr),
           "--json-out", str(out)]
    env = {**os.environ, "TMPDIR": str(work), "PYTHONPATH": str(HERE.parent)}
    proc = subprocess.run(cmd, env=env, preexec_fn=enter_cgroup(cgroup))
    result = json.loads(out.read_text()) if out.exists() else {"case": case, "returncode": proc.returncode}
    result["cgroup_peak_bytes"] = cgroup_peak_bytes(cgroup)
    result["memory_limit_bytes"] = int(args.memory_limit_gib * 2**30)
    os.rmdir(cgroup)
    return result


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in report["cases"] if "median_bytes_per_step" in c]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    keys = [f"{tier}_{d}_bytes" for tier in TIERS for d in ("read", "write")]
    width = 0.8 / max(1, len(cases))
    for i, case in enumerate(cases):
        a.bar([k + i * width for k in range(len(keys))], [case["median_bytes_per_step"][k] / 1e9 for k in keys],
              width, label=f"{case['case']} ({case['tokens_per_step']} tokens)")
    a.set_xticks([k + width * (len(cases) - 1) / 2 for k in range(len(keys))],
                 [k.replace("_bytes", "").replace("_", " ") for k in keys], rotation=30, fontsize=8)
    a.set_ylabel("GB per step (median)")
    a.legend(fontsize=8)
    b.bar([x["case"] for x in cases], [statistics.median(x["optimizer_skipped_bytes"]) / 1e9 for x in cases])
    b.set_ylabel("optimizer bytes skipped per step (GB)")
    names = [x["case"] for x in cases]
    c.bar([n + "\npeak RSS" for n in names], [x["peak_rss_bytes"] / 2**30 for x in cases], label="peak RSS")
    c.bar([n + "\nhost plan" for n in names], [x["host_plan_total_bytes"] / 2**30 for x in cases], label="host plan")
    c.axhline(report["memory_limit_gib"], color="tab:red", linestyle="--", label="cgroup limit")
    c.set_ylabel("GiB")
    c.tick_params(axis="x", labelsize=7)
    c.legend(fontsize=8)
    fig.suptitle(f"{report['preset']}: s/step " + ", ".join(f"{x['case']} {x['s_per_step']:.1f}" for x in cases))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt_1b_moe", help="a GPT preset with experts, or tiny_moe")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--few-tokens", type=int, default=4, help="tokens per step of the few_tokens case (a multiple of 4)")
    p.add_argument("--memory-limit-gib", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", default="", help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        Path(args.json_out).write_text(json.dumps(child(args)))
        return 0
    work = Path(tempfile.mkdtemp(prefix="snake-moe-bench-"))
    try:
        cases = [run_case(args, "many_tokens", args.batch, args.context_len, work),
                 run_case(args, "few_tokens", 4, max(1, args.few_tokens // 4), work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the children's temporary directory and their JSON
    report = dict(preset=args.preset, memory_limit_gib=args.memory_limit_gib, steps=args.steps, cases=cases)
    out = Path(args.out or RESULTS / f"{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    _plot(report, out.with_suffix(".png"))
    for case in cases:
        print(json.dumps({k: case.get(k) for k in ("case", "returncode", "s_per_step", "tokens_per_step",
                                                    "median_bytes_per_step", "optimizer_skipped_bytes",
                                                    "peak_rss_bytes", "host_plan_total_bytes",
                                                    "cgroup_peak_bytes")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
