"""Checkpoint cost, zero-copy vs copy: bytes written per save, save seconds, the step time
after a save against a step with no pinned checkpoint, the pipelined copy's rate against the probed SSD
bandwidth, and (``--sigterm``) the seconds from SIGTERM to exit of a training process.

    python benchmarks/checkpoint.py --preset r1
    flock /tmp/snake-bench.lock python benchmarks/checkpoint.py --preset gpt_1b --micro-batch-size 1
    flock /tmp/snake-bench.lock python benchmarks/checkpoint.py --preset gpt_1b --micro-batch-size 1 --only-sigterm
    flock /tmp/snake-bench.lock python benchmarks/checkpoint.py --preset gpt_4b

One fit, every state on the SSD tier (as benchmarks/scale.py): step 1 warms up; ``--clean-steps`` steps
run before any checkpoint exists (the baseline: nothing pinned, no checksum reading state back); then
``--rounds`` rounds of a step, a zero-copy save after it, and the first step after the save (every
unit's update goes to a new version). Each save releases the one before it once it is written, as
Lightning's rotating ``last`` and top-k do. In a named ``ssd_dir`` the version a released checkpoint
held is then the spare the next update overwrites, so round 1 is the first save's case (new files) and
the later rounds a rotation's (overwritten spares); both are reported, with medians. After the rounds, the pipelined copy's rate and a copy save (what saves did before); a last
step again has nothing pinned. Each step's busy seconds per resource come from the run's timeline
(``timeline.step_breakdown``). Bytes written are the process's own (``/proc/self/io`` write_bytes:
what reached the block layer, page cache included), and the save's own account.

Writes ``benchmarks/results/checkpoint/<preset>.json`` and ``.png``. Not part of the
test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "checkpoint"


def _written_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def _model_and_strategy(preset_name: str, context_len: int, ssd_dir: str, num_micro: int,
                        trace_path: str | None = None):
    import torch

    import snake_strategy
    from snake_strategy.gpt import GPTModule, preset

    cfg = preset(preset_name)
    cfg.context_len = context_len
    torch.manual_seed(0)
    module = GPTModule(cfg, learning_rate=1e-4)
    storage = snake_strategy.StorageConfig(
        ssd_dir=ssd_dir, weights={"ssd": 1.0}, optimizer={"ssd": 1.0}, gradients={"host": 1.0},
        checkpoints={"ssd": 1.0}, checkpoint_host_ends=0)
    schedule = snake_strategy.ScheduleConfig(kind="vertical", num_micro_batches=num_micro, alpha=0.0)
    strategy = snake_strategy.GreedySnakeStrategy(storage=storage, schedule=schedule, hardware="probe",
                                                  trace_path=trace_path)
    return cfg, module, strategy


def _loader(cfg, steps: int, micro_batch_size: int, num_micro: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    n = steps * micro_batch_size * num_micro
    x = torch.randint(0, cfg.vocab_size, (n, cfg.context_len))
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=micro_batch_size * num_micro)


def run(preset_name: str, context_len: int, micro_batch_size: int, num_micro: int, root: str,
        rounds: int = 3, timeline: str | None = None, clean_steps: int = 2) -> dict:
    import statistics

    import lightning as L

    from snake_strategy import checkpoint as snake_checkpoint
    from snake_strategy.planning.machine import _probe_ssd
    from snake_strategy.storage import versions
    from snake_strategy.timeline import STEPS, lanes, read_trace, step_breakdown

    work = Path(tempfile.mkdtemp(prefix="snake-ckpt-bench-", dir=root))
    trace_path = work / "timeline.json"
    cfg, module, strategy = _model_and_strategy(preset_name, context_len, str(work / "ssd"), num_micro,
                                                str(trace_path))
    out: dict = {"preset": preset_name, "params": cfg.num_params(), "context_len": context_len, "rounds": []}
    step_s: dict[int, float] = {}
    ssd_traffic: dict[int, dict[str, int]] = {}  # per step, the engine's SSD bytes per state and direction
    # Step 1 warms up; steps 2 .. 1 + clean_steps never had a checkpoint (nothing pinned, no checksum
    # reading the state back): the baseline. Then the rounds.
    base = 1 + clean_steps
    saves = {base + 2 * r + 1 for r in range(rounds)}  # a zero-copy save after these steps
    last = base + 2 * rounds  # the step after the last save: then the copy measurements

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.strategy.engine.trace.keep = last + 1  # every step of the run stays in the timeline

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start_s = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            step_s[step] = time.perf_counter() - self.start_s
            engine = trainer.strategy.engine
            ssd_traffic[step] = {k: v for k, v in engine.last_step.step_traffic().items() if k.startswith("ssd/") and v}
            if step in saves:
                engine.flush()
                before = _written_bytes()
                current = work / f"zero_copy_{len(out['rounds'])}.ckpt"
                trainer.save_checkpoint(str(current))
                save = trainer.strategy.last_save
                out["rounds"].append({"seconds": save["seconds"], "written_bytes_own": save["written_bytes"],
                                      "written_bytes_process": _written_bytes() - before,
                                      "methods": save["methods"], "phases_s": save["phases_s"]})
                ssd_bytes = sum(t.ssd_bytes for u in range(engine.num_units) for t in engine.unit_tiers(u).values())
                out["ssd_state_bytes"] = ssd_bytes
                if out["rounds"][1:]:  # a rotation: the version the older checkpoint held becomes a spare
                    snake_checkpoint.release(work / f"zero_copy_{len(out['rounds']) - 2}.ckpt")
            if step == last:
                # The pipelined copy (the cross-filesystem fallback) of the pinned files, to another
                # directory: its rate against the probed SSD bandwidth (the target: >= 0.5x).
                newest = work / f"zero_copy_{len(out['rounds']) - 1}.ckpt"
                pinned = sorted((newest / "units").glob("*.bin"))
                copy_dir = work / "copied"
                copy_dir.mkdir()
                copied = 0
                start = time.perf_counter()
                budget = 4 * 2**30  # enough for a rate; a full copy of gpt_4b's state would not fit the disk
                for path in pinned:
                    if copied >= budget:
                        break
                    src = os.open(path, os.O_RDONLY)
                    try:
                        size = os.fstat(src).st_size
                        dst = os.open(copy_dir / path.name, os.O_WRONLY | os.O_CREAT, 0o600)
                        try:
                            versions.copy_file(src, dst, size)
                            os.fsync(dst)
                        finally:
                            os.close(dst)
                    finally:
                        os.close(src)
                    copied += size
                copy_s = time.perf_counter() - start
                # The project's SSD probe, now (the disk is shared: the cached profile may be stale).
                read_gbps, write_gbps = _probe_ssd(str(work), 256 * 2**20)
                out["pipelined_copy"] = {"bytes": copied, "seconds": copy_s, "gb_per_s": copied / copy_s / 1e9,
                                         "probed_ssd_read_gb_per_s": read_gbps, "probed_ssd_write_gb_per_s": write_gbps,
                                         "ratio_to_slower_probe": copied / copy_s / 1e9 / min(read_gbps, write_gbps)}
                for path in copy_dir.iterdir():
                    path.unlink()
                snake_checkpoint.release(newest)
                engine.flush()
                before = _written_bytes()
                start = time.perf_counter()
                save = snake_checkpoint.save(engine, trainer._checkpoint_connector.dump_checkpoint(False),
                                             work / "copy.ckpt", zero_copy=False)
                out["copy"] = {"seconds": time.perf_counter() - start, "written_bytes_own": save["written_bytes"],
                               "written_bytes_process": _written_bytes() - before}

    steps = last + 1
    trainer = L.Trainer(strategy=strategy, precision="32-true", max_steps=steps, callbacks=[Probe()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=_loader(cfg, steps, micro_batch_size, num_micro))
    out["step_s"] = step_s
    out["ssd_bytes"] = ssd_traffic
    events = read_trace(trace_path)
    if timeline:
        shutil.copy(trace_path, timeline)
    out["breakdown_s"] = {e["args"]["step"]: step_breakdown(events, e["args"]["step"]) for e in lanes(events)[STEPS]}
    # The baseline: the steps before any save. A round's step before its save is not one of them: the
    # previous round's checkpoint is still pinned and its checksums may still be reading it back.
    clean = [step_s[s] for s in range(2, base + 1)] or [step_s[s] for s in saves]
    out["step_s_no_checkpoint"] = statistics.median(clean)
    for r, row in enumerate(out["rounds"]):
        before, after = step_s[base + 2 * r + 1], step_s[base + 2 * r + 2]
        row.update(step_s_before_save=before, step_s_after_save=after, step_after_save_ratio=after / before,
                   step_after_save_vs_no_checkpoint=after / out["step_s_no_checkpoint"])
    out["zero_copy"] = out["rounds"][0]  # the first save: what every save costs
    after = [step_s[s + 1] for s in sorted(saves)]
    out["step_s_after_zero_copy_save"] = statistics.median(after)
    out["step_after_save_ratio"] = out["step_s_after_zero_copy_save"] / out["step_s_no_checkpoint"]
    out["step_after_first_save_ratio"] = out["rounds"][0]["step_after_save_vs_no_checkpoint"]
    out["step_after_rotating_save_ratio"] = (statistics.median(step_s[s + 1] for s in sorted(saves)[1:])
                                             / out["step_s_no_checkpoint"]) if rounds > 1 else None
    out["probe"] = {k: v for k, v in vars(trainer.strategy.hardware_profile or {}).items()
                    if isinstance(v, (int, float))} if trainer.strategy.hardware_profile else {}
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return out


SIGTERM_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import lightning as L
from benchmarks.checkpoint import _model_and_strategy, _loader
cfg, module, strategy = _model_and_strategy(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[6]))

class Mark(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1:
            open(sys.argv[7], "w").write(str(time.time()))

ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=sys.argv[5], save_top_k=0)
trainer = L.Trainer(strategy=strategy, precision="32-true", max_steps=50, callbacks=[Mark(), ckpt], logger=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
trainer.fit(module, train_dataloaders=_loader(cfg, 50, int(sys.argv[8]), int(sys.argv[6])))
"""


def sigterm_to_exit(preset_name: str, context_len: int, micro_batch_size: int, num_micro: int, root: str) -> dict:
    """A child trains; SIGTERM lands 1 s into its second step; seconds until it exits (the rest of the
    step, the zero-copy save of last.ckpt, teardown)."""
    work = Path(tempfile.mkdtemp(prefix="snake-sigterm-bench-", dir=root))
    marker = work / "step2"
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, str(HERE.parent), preset_name, str(context_len),
                             str(work / "ssd"), str(work / "ckpts"), str(num_micro), str(marker),
                             str(micro_batch_size)], stderr=subprocess.PIPE, text=True)
    while not marker.exists() and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(1.0)
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate()
    exit_s = time.perf_counter() - start
    saved = [line for line in err.splitlines() if "SIGTERM: saved" in line]
    out = {"exit_code": proc.returncode, "sigterm_to_exit_s": exit_s, "log": saved[-1] if saved else err[-2000:]}
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12, 3.6))
    kinds = ["zero_copy", "copy"]
    a.bar(kinds, [result[k]["written_bytes_process"] / 1e9 for k in kinds], color=["tab:green", "tab:gray"])
    a.set_ylabel("GB written per save")
    b.bar(kinds, [result[k]["seconds"] for k in kinds], color=["tab:green", "tab:gray"])
    b.set_ylabel("save seconds")
    rounds = result["rounds"]
    x = range(1, len(rounds) + 1)
    c.axhline(result["step_s_no_checkpoint"], color="tab:gray", ls="--", label="no checkpoint yet (median)")
    c.plot(x, [r["step_s_before_save"] for r in rounds], "o-", label="before the save")
    c.plot(x, [r["step_s_after_save"] for r in rounds], "o-", label="first step after the save")
    c.set_xlabel("round (1: the first save; then a rotation)")
    c.set_ylabel("step seconds")
    c.legend(fontsize=7)
    fig.suptitle(f"checkpoint cost, {result['preset']} ({result['params'] / 1e6:.0f}M params)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="r1")
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--num-micro", type=int, default=2)
    parser.add_argument("--root", default=None, help="directory for the SSD tier and checkpoints (default: $TMPDIR)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (step, save, step after)")
    parser.add_argument("--clean-steps", type=int, default=2,
                        help="steps before any save, after the warm-up step: the baseline")
    parser.add_argument("--timeline", default=None, help="keep the run's timeline (a Perfetto trace) at this path")
    parser.add_argument("--sigterm", action="store_true", help="also measure SIGTERM -> exit in a child")
    parser.add_argument("--only-sigterm", action="store_true", help="only the SIGTERM -> exit measurement "
                        "(merged into an existing result file)")
    args = parser.parse_args()
    out = RESULTS / f"{args.preset}.json"
    if args.only_sigterm:
        result = json.loads(out.read_text()) if out.exists() else {"preset": args.preset}
    else:
        result = run(args.preset, args.context_len, args.micro_batch_size, args.num_micro, args.root, args.rounds, args.timeline,
                     args.clean_steps)
    if args.sigterm or args.only_sigterm:
        result["sigterm"] = sigterm_to_exit(args.preset, args.context_len, args.micro_batch_size, args.num_micro,
                                            args.root)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    if "copy" in result:
        plot(result, RESULTS / f"{args.preset}.png")
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
