"""Tune the settings the planner chooses: a sweep one setting at a time around the planner's own choice.

    python -m snake_strategy.tune --preset io_bound --context-len 32 --num-micro 8
    python -m snake_strategy.tune --preset gpt_1b --context-len 128 --num-micro 8 --ssd-dir /nvme/tune \\
        --host-budget-bytes 12884901888 --json-out tune_gpt_1b.json
    python -m snake_strategy.tune --preset r1 --grid alpha,prefetch_depth

The default configuration is ``GreedySnakeStrategy()`` given only the micro-batch count, the SSD directory
and the host budget: every other setting is the planner's. Each other configuration changes ONE setting of
it (``--grid`` picks which: alpha, prefetch depth, kept activations, batched passes, blocks per unit, a
state moved wholly to the SSD); values the default already runs are not run twice. Every configuration
trains ``--steps`` steps of the preset's GPT on the standard library's bytes in its own child process (a
clean peak RSS, nothing shared), and reports the measured s/step (median of steps 2..N), the plan's
predicted s/step and bound, the prediction's error, the peak RSS through the steps and the planned host
bytes. A configuration the strategy refuses (a ``ValueError``, e.g. one that does not fit the host
budget) is recorded with its message.

Step times on a shared or thermally throttled machine drift by more than the settings differ, so the
configurations run in rounds (``--rounds``), every other round in reverse order, and each is ranked by the
median of its runs. With one round the default runs first and again last and is ranked by the mean of the
two. The table ranks the runs by s/step and says how far the default is from the best; ``--json-out`` keeps
every run's concrete plan (``strategy.plan.as_dict()``).

``run_in_child`` is the runner ``benchmarks/throughput_curve.py`` uses as well.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Each axis and the values the sweep tries on it; the planner's choice is the default run's.
AXES: dict[str, tuple[Any, ...]] = {
    "alpha": (0.0, 0.25, 0.5),
    "prefetch_depth": (1, 2, 3),
    "keep_activations": (0, "auto"),
    "batching": ("batched", "unbatched"),
    "blocks_per_unit": (1, 2),
    "host_shares": ("weights", "optimizer"),  # that state all on the SSD, the planner placing the rest
}
DEFAULT_NAME = "default"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration: the settings it gives; every setting it leaves out is the planner's."""

    name: str
    schedule: dict[str, Any] = dataclasses.field(default_factory=dict)  # ScheduleConfig fields
    storage: dict[str, Any] = dataclasses.field(default_factory=dict)  # StorageConfig state shares


def variant(axis: str, value: Any) -> Variant:
    """The default with ``axis`` set to ``value``."""
    if axis == "batching":
        batched = value == "batched"  # both passes alike: a kept graph and dropout replay need that
        return Variant(f"batching={value}", {"batched_forward": batched, "batched_backward": batched})
    if axis == "host_shares":
        return Variant(f"{value}=ssd", storage={value: {"ssd": 1.0}})
    return Variant(f"{axis}={value}", {axis: value})


def planner_runs(axis: str, value: Any, plan: dict[str, Any]) -> bool:
    """Whether the default's concrete plan (``RunPlan.as_dict()``) already runs ``value`` on ``axis``."""
    schedule, storage = plan["schedule"], plan["storage"]
    if axis == "batching":
        batched = value == "batched"
        return (schedule["batched_forward"] == schedule["batched_backward"] == batched
                and not schedule["split_backward"])
    if axis == "host_shares":
        return storage[value]["ssd"] == 1.0
    if axis == "keep_activations" and value == 0 and plan.get("kept_units") is not None:
        return not plan["kept_units"]  # "auto" that kept no graph at the first step runs what 0 runs
    return schedule[axis] == value


def build_grid(axes: list[str], default_plan: dict[str, Any] | None = None) -> list[Variant]:
    """The configurations besides the default: one per value of each axis in ``axes``, minus the values the
    default's plan already runs (all of them when the default has no plan: it was refused or failed)."""
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"--grid names unknown axes {unknown}; known: {', '.join(AXES)}")
    return [variant(axis, value) for axis in axes for value in AXES[axis]
            if default_plan is None or not planner_runs(axis, value, default_plan)]


# ---------------------------------------------------------------------- one run (the child process)
def _ssd_bytes(traffic: dict[str, int], direction: str) -> int:
    """Bytes to or from the SSD tier in one step's engine traffic (keys ``tier/state/direction``)."""
    return sum(v for k, v in traffic.items() if k.startswith("ssd/") and k.endswith("/" + direction))


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def train_once(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["steps"]`` steps of a GPT preset with greedysnake under ``spec``'s settings and measure
    them. A ``ValueError`` (a refused setting) comes back as ``{"status": "refused", "error": ...}``."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, Subset

    from snake_strategy import GreedySnakeStrategy, ScheduleConfig
    from snake_strategy.planning.time_model import HardwareProfile
    from snake_strategy.data import ByteWindows, load_corpus
    from snake_strategy.gpt import GPTModule, preset

    steps, micro, num_micro = spec["steps"], spec["micro_batch_size"], spec["num_micro"]
    marks: list[float] = []
    losses: list[float] = []
    traffic: list[dict[str, int]] = []
    peak: list[int] = []

    class Measure(L.Callback):
        def on_train_start(self, trainer, pl_module):
            marks.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks.append(time.perf_counter())  # one batch is one optimizer step
            losses.append(float(outputs["loss"]))
            traffic.append(trainer.strategy.engine.last_step.step_traffic())

        def on_train_end(self, trainer, pl_module):
            trainer.strategy.engine.flush()  # the deferred optimizer work belongs to the steps
            peak.append(_peak_rss_bytes())  # before teardown hands the trained weights back

    try:
        cfg = preset(spec["preset"])
        cfg.context_len = spec["context_len"]
        schedule = ScheduleConfig(num_micro_batches=num_micro, **spec["schedule"])
        storage = {"placement": "auto", "ssd_dir": spec["ssd_dir"], "host_budget_bytes": spec["host_budget_bytes"],
                   **spec["storage"]}
        # nominal: the profile's stated figures (``HardwareProfile()``), not this machine's
        hardware = "probe" if spec["hardware"] == "probe" else HardwareProfile()
        strategy = GreedySnakeStrategy(storage=storage, schedule=schedule, hardware=hardware)
        trainer = L.Trainer(strategy=strategy, accelerator=spec["accelerator"], devices=1, max_steps=steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                            callbacks=[Measure()])
        torch.manual_seed(0)
        with trainer.init_module():  # on the meta device: the engine materialises one unit at a time
            module = GPTModule(cfg, learning_rate=spec["learning_rate"])
        windows = ByteWindows(load_corpus("stdlib"), cfg.context_len)
        batch = micro * num_micro
        if len(windows) < batch * steps:
            raise ValueError(f"the stdlib corpus holds {len(windows)} windows of {cfg.context_len + 1} bytes, fewer "
                             f"than {steps} steps x {batch} samples; lower --steps, --num-micro or --context-len")
        loader = DataLoader(Subset(windows, range(batch * steps)), batch_size=batch, shuffle=False)
        trainer.fit(module, train_dataloaders=loader)
    except ValueError as err:
        return dict(status="refused", error=str(err))
    step_s = [b - a for a, b in zip(marks, marks[1:])]
    timed = slice(1, None) if len(step_s) > 1 else slice(None)  # the first step also warms up
    s_per_step = statistics.median(step_s[timed])
    plan = strategy.plan
    prediction = plan.prediction
    tokens = batch * cfg.context_len
    return dict(
        status="ok", s_per_step=s_per_step, step_s=step_s, losses=losses, tokens_per_step=tokens,
        tokens_per_s=tokens / s_per_step, peak_rss_bytes=peak[0] if peak else _peak_rss_bytes(),
        planned_host_bytes=plan.host_bytes,
        ssd_read_bytes_per_step=int(statistics.median(_ssd_bytes(t, "read") for t in traffic[timed])),
        ssd_write_bytes_per_step=int(statistics.median(_ssd_bytes(t, "write") for t in traffic[timed])),
        predicted_s_per_step=prediction.roofline_s if prediction else None,
        bound=prediction.bound if prediction else None,
        prediction_error=prediction.roofline_s / s_per_step - 1 if prediction else None,
        prediction=prediction.as_dict() if prediction else None,
        plan=plan.as_dict(), describe=plan.describe(),
        hardware=dataclasses.asdict(strategy.hardware_profile) if strategy.hardware_profile else None)


# ---------------------------------------------------------------------- the parent side
def run_in_child(spec: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
    """``train_once(spec)`` in a fresh Python process (its own peak RSS, nothing shared), with a fresh SSD
    directory under ``spec["ssd_dir"]`` (None: the temp dir) removed afterwards. A crash or a timeout
    comes back as ``{"status": "failed", "error": <the last line of its output>}``."""
    package_root = str(Path(__file__).resolve().parent.parent)  # the child imports this very copy
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    ssd_dir = tempfile.mkdtemp(prefix="snake-tune-", dir=spec.get("ssd_dir"))
    out = Path(ssd_dir) / "result.json"
    cmd = [sys.executable, "-m", "snake_strategy.tune", "--child", json.dumps({**spec, "ssd_dir": ssd_dir}),
           "--json-out", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode != 0 or not out.exists():
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return dict(status="failed", error=lines[-1] if lines else f"exit status {proc.returncode}",
                        output_tail=(proc.stderr or proc.stdout)[-3000:])
        return json.loads(out.read_text())
    except subprocess.TimeoutExpired:
        return dict(status="failed", error=f"timed out after {timeout_s} s")
    finally:
        shutil.rmtree(ssd_dir, ignore_errors=True)


def merge_runs(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's record from its repeated runs: s/step and the prediction are the medians over the
    runs that measured (the median of two is their mean), every run's s/step kept in ``s_per_step_runs``; with
    none measured, the first run's record (refused or failed)."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return records[0]
    merged = dict(ok[0], s_per_step_runs=[r["s_per_step"] for r in ok],
                  s_per_step=statistics.median(r["s_per_step"] for r in ok))
    if "tokens_per_step" in merged:
        merged["tokens_per_s"] = merged["tokens_per_step"] / merged["s_per_step"]
    if all(r.get("predicted_s_per_step") for r in ok):
        merged["prediction_error"] = statistics.median(r["prediction_error"] for r in ok)
        merged["predicted_s_per_step"] = statistics.median(r["predicted_s_per_step"] for r in ok)
    return merged


def run_order(names: list[str], rounds: int) -> list[str]:
    """The order the runs go in: round by round, every other round reversed, so that a machine drifting
    during the sweep weighs on every configuration alike."""
    return [n for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]


def rank(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measured runs fastest first, then the refused and failed ones in their order."""
    measured = sorted((r for r in runs if r["status"] == "ok"), key=lambda r: r["s_per_step"])
    return measured + [r for r in runs if r["status"] != "ok"]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The best configuration, the default's rank among the measured ones and its s/step over the best's."""
    ranked = [r for r in rank(runs) if r["status"] == "ok"]
    summary: dict[str, Any] = dict(measured=len(ranked), refused=sum(r["status"] == "refused" for r in runs),
                                   failed=sum(r["status"] == "failed" for r in runs))
    if not ranked:
        return summary
    best = ranked[0]
    summary.update(best=best["name"], best_s_per_step=best["s_per_step"])
    errors = [abs(r["prediction_error"]) for r in ranked if r.get("prediction_error") is not None]
    if errors:
        summary["median_abs_prediction_error"] = statistics.median(errors)
    names = [r["name"] for r in ranked]
    if DEFAULT_NAME in names:
        default = ranked[names.index(DEFAULT_NAME)]
        summary.update(default_rank=names.index(DEFAULT_NAME) + 1,
                       default_over_best=default["s_per_step"] / best["s_per_step"])
    return summary


def summary_line(summary: dict[str, Any]) -> str:
    if "default_rank" not in summary:
        return f"the default was not measured; best: {summary.get('best', 'none')}"
    return (f"default ranks {summary['default_rank']} of {summary['measured']}: within "
            f"{100 * (summary['default_over_best'] - 1):.1f}% of the best ({summary['best']}, "
            f"{summary['best_s_per_step']:.3f} s/step)")


def table(runs: list[dict[str, Any]]) -> str:
    rows = [f"{'rank':>4}  {'configuration':<26} {'s/step':>8} {'predicted':>9} {'error':>7} {'bound':<9} "
            f"{'peak RSS':>9} {'planned':>9}"]
    for i, r in enumerate(rank(runs), 1):
        if r["status"] != "ok":
            rows.append(f"{'-':>4}  {r['name']:<26} {r['status']}: {r['error'][:160]}")
            continue
        predicted = "" if r["predicted_s_per_step"] is None else f"{r['predicted_s_per_step']:9.3f}"
        error = "" if r["prediction_error"] is None else f"{100 * r['prediction_error']:+6.0f}%"
        rows.append(f"{i:>4}{'*' if r['name'] == DEFAULT_NAME else ' '} {r['name']:<26} {r['s_per_step']:8.3f} "
                    f"{predicted:>9} {error:>7} {r['bound'] or '':<9} {r['peak_rss_bytes'] / 2**30:7.2f}Gi "
                    f"{r['planned_host_bytes'] / 2**30:7.2f}Gi")
    return "\n".join(rows + ["(* the default: the planner's choices; error = predicted / measured - 1)",
                             summary_line(summarize(runs))])


def base_spec(args: argparse.Namespace) -> dict[str, Any]:
    """What every run of a sweep shares (``train_once``'s spec less the variant's settings)."""
    return dict(preset=args.preset, context_len=args.context_len, micro_batch_size=args.micro_batch_size,
                num_micro=args.num_micro, steps=args.steps, host_budget_bytes=args.host_budget_bytes,
                ssd_dir=args.ssd_dir, hardware=args.hardware, accelerator=args.accelerator,
                learning_rate=args.learning_rate, schedule={}, storage={})


def run_variant(spec: dict[str, Any], v: Variant, label: str, timeout_s: float | None) -> dict[str, Any]:
    start = time.perf_counter()
    result = run_in_child({**spec, "schedule": v.schedule, "storage": v.storage}, timeout_s)
    wall = time.perf_counter() - start
    if result["status"] == "ok":
        err = "" if result["prediction_error"] is None else f", prediction error {100 * result['prediction_error']:+.0f}%"
        what = f"{result['s_per_step']:.3f} s/step{err}"
    else:
        what = f"{result['status']}: {result['error'][:200]}"
    print(f"[{label}] {v.name}: {what} ({wall:.0f} s)", file=sys.stderr, flush=True)
    return {"name": v.name, "schedule_given": v.schedule, "storage_given": v.storage, "wall_s": wall, **result}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    axes = [a for a in args.grid.split(",") if a]
    spec = base_spec(args)
    if args.hardware == "probe":
        # Probed once here (cached on disk per filesystem), so that no run's peak RSS holds the probe's buffers.
        from snake_strategy.planning.machine import probe_hardware
        probe_hardware(args.ssd_dir)
    first = run_variant(spec, Variant(DEFAULT_NAME), "1", args.timeout_s)  # the grid depends on its plan
    variants = {v.name: v for v in [Variant(DEFAULT_NAME), *build_grid(axes, first.get("plan"))]}
    order = run_order(list(variants), args.rounds)  # begins with the default's run above
    if args.rounds == 1:
        order.append(DEFAULT_NAME)  # measured at both ends of the sweep all the same
    records: dict[str, list[dict[str, Any]]] = {DEFAULT_NAME: [first]}
    for i, name in enumerate(order[1:], 2):
        records.setdefault(name, []).append(run_variant(spec, variants[name], f"{i}/{len(order)}", args.timeout_s))
    runs = [merge_runs(records[name]) for name in variants]
    return dict(settings={k: v for k, v in spec.items() if k not in ("schedule", "storage")}, axes=axes,
                rounds=args.rounds, summary=summarize(runs), runs=rank(runs))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m snake_strategy.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="io_bound", help="a GPT preset of snake_strategy.gpt (tiny, io_bound, r1, "
                                                          "gpt_1b, gpt_4b, ...)")
    p.add_argument("--context-len", type=int, default=None, help="tokens per sample (default: the preset's)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-micro", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run; s/step is the median of 2..N")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every configuration, in alternating order; each is ranked by the median of its "
                        "runs (1: the default alone runs twice, first and last)")
    p.add_argument("--host-budget-bytes", type=int, default=None,
                   help="storage.host_budget_bytes of every run (default: the planner's from the machine)")
    p.add_argument("--ssd-dir", default=None, help="directory for the SSD tier (each run gets a fresh folder in it)")
    p.add_argument("--grid", default=",".join(AXES), help=f"comma-separated axes to vary (of {', '.join(AXES)})")
    p.add_argument("--hardware", default="probe", choices=("probe", "nominal"),
                   help="the planner's rates: probed on this machine (cached) or nominal figures")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--learning-rate", type=float, default=3e-4)
    p.add_argument("--timeout-s", type=float, default=None, help="give up on a run after this long")
    p.add_argument("--json-out", default=None, help="write every run (settings, plan, measurements) here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a train_once spec, as JSON
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.child is not None:
        Path(args.json_out).write_text(json.dumps(train_once(json.loads(args.child))))
        return 0
    if args.context_len is None:
        from snake_strategy.gpt import preset
        args.context_len = preset(args.preset).context_len
    for name in ("context_len", "micro_batch_size", "num_micro", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        build_grid([a for a in args.grid.split(",") if a])
    except ValueError as err:
        p.error(str(err))
    report = dict(preset=args.preset, **sweep(args))
    print(table(report["runs"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
