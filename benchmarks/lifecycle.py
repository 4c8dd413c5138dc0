"""The whole life of a big run on the defaults, under a memory limit (a real cgroup; you must be root):
setup, N steps, a checkpoint, SIGKILL during the next step, resume, finish, validate, export_hf.

    python benchmarks/lifecycle.py --preset small --memory-limit-gib 4              # every phase, minutes
    python benchmarks/lifecycle.py --preset gpt_4b --memory-limit-gib 16 --host-budget-gib 15 --phases end_of_fit --steps 1

Phases (``--phases``, comma-separated):

- ``interrupted``: fit with a checkpoint after ``--steps`` steps, SIGKILLed halfway through the next step;
  reports the checkpoint's seconds and GB/s, and the bytes the dead run left on disk (its temporary
  ``ssd_dir``, outside the checkpoint);
- ``resume``: fit from that checkpoint to ``--total-steps``, then the end of fit (the weights given back
  to the module: in memory, or a mapped file when they exceed the budget), validate, export_hf;
- ``uninterrupted``: the same fit without the kill: its losses must equal the resumed run's;
- ``end_of_fit``: ``--steps`` steps without checkpoint, end of fit, validate, export_hf (the part that
  fits a small disk on gpt_4b: its checkpoint copies 49 GB).

Every run is a child process in its own cgroup (``memory.max`` / v1 ``memory.limit_in_bytes``), with
``GreedySnakeStrategy()`` on the defaults: the budget comes from the cgroup (machine.host_budget).
Per phase the child reports peak RSS (VmHWM, reset with /proc/self/clear_refs), the peak of its
anonymous and file-backed parts (sampled every 0.1 s: mapped weights are file-backed and reclaimable),
and the cgroup's peak. The parent samples the disk's used bytes for the high-water mark.
Writes ``benchmarks/results/lifecycle/<preset>.json`` and ``.png``. Not part of the test suite.
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
import threading
import time
from pathlib import Path

from common import disk_used_bytes, enter_cgroup, make_cgroup

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "lifecycle"
PHASES = ("interrupted", "resume", "uninterrupted", "end_of_fit")


# ---------------------------------------------------------------------- child: one fit, phase by phase
class PhaseMeter:
    """Peak memory per phase of this process (and of its cgroup), written as JSON lines to ``events``."""

    def __init__(self, events: Path, cgroup_dir: str | None) -> None:
        self.events, self.cgroup_dir = events, cgroup_dir
        self.phase: str | None = None
        self.start_s = 0.0
        self.peaks = {"anon": 0, "file": 0}
        self._lock = threading.Lock()
        threading.Thread(target=self._sample, daemon=True).start()

    def _status(self) -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def _sample(self) -> None:
        while True:
            status = self._status()
            with self._lock:
                self.peaks["anon"] = max(self.peaks["anon"], status.get("RssAnon", 0))
                self.peaks["file"] = max(self.peaks["file"], status.get("RssFile", 0))
            time.sleep(0.1)

    def _cgroup_file(self, name_v2: str, name_v1: str) -> str | None:
        if self.cgroup_dir is None:
            return None
        for name in (name_v2, name_v1):
            path = os.path.join(self.cgroup_dir, name)
            if os.path.exists(path):
                return path
        return None

    def emit(self, **record) -> None:
        with open(self.events, "a") as f:
            f.write(json.dumps(record) + "\n")

    def begin(self, phase: str) -> None:
        if self.phase is not None:
            self.end()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        peak = self._cgroup_file("memory.peak", "memory.max_usage_in_bytes")
        if peak is not None and peak.endswith("max_usage_in_bytes"):
            with open(peak, "w") as f:
                f.write("0")  # v1: resettable; v2's memory.peak is the cgroup's lifetime peak
        status = self._status()
        with self._lock:
            self.peaks = {"anon": status.get("RssAnon", 0), "file": status.get("RssFile", 0)}
        self.phase, self.start_s = phase, time.perf_counter()
        self.emit(event="start", phase=phase, t=time.time())

    def end(self, **extra) -> None:
        status = self._status()
        peak = self._cgroup_file("memory.peak", "memory.max_usage_in_bytes")
        cgroup_peak = int(open(peak).read()) if peak else None
        with self._lock:
            peaks = dict(self.peaks)
        self.emit(event="end", phase=self.phase, t=time.time(), seconds=time.perf_counter() - self.start_s,
                  peak_rss_bytes=status["VmHWM"], peak_anon_bytes=max(peaks["anon"], status.get("RssAnon", 0)),
                  peak_file_bytes=max(peaks["file"], status.get("RssFile", 0)), cgroup_peak_bytes=cgroup_peak, **extra)
        self.phase = None


def gpt_as_hf(module):
    """The GPT preset as the GPT-2 model it is (HF names; Conv1D weights are stored transposed): a
    GPT2Config and (name, tensor) pairs one tensor at a time, for ``export_hf``."""
    from transformers import GPT2Config

    cfg = module.config
    config = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.context_len, n_embd=cfg.d_model,
                        n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.mlp_ratio * cfg.d_model,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        layer_norm_epsilon=1e-5, tie_word_embeddings=cfg.tied_head)
    conv = {"qkv": "attn.c_attn", "attn_out": "attn.c_proj", "mlp_in": "mlp.c_fc", "mlp_out": "mlp.c_proj"}

    def pairs():
        for name, p in module.named_parameters():
            top, _, rest = name.partition(".")
            if top in ("wte", "wpe", "ln_f"):
                yield f"transformer.{name}", p.detach()
            elif top == "lm_head":
                yield name, p.detach()
            elif top == "blocks":
                index, layer, kind = rest.split(".")
                hf_layer = conv.get(layer, layer)
                value = p.detach().t() if layer in conv and kind == "weight" else p.detach()
                yield f"transformer.h.{index}.{hf_layer}.{kind}", value
    return config, pairs()


def child(args) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, Subset

    import snake_strategy
    from snake_strategy.engine.state.weights_file import mapped_parameters
    from snake_strategy.data import ByteWindows, load_corpus
    from snake_strategy.gpt import GPTModule, preset
    from snake_strategy.hf import export_hf
    from snake_strategy.progress import Progress

    meter = PhaseMeter(Path(args.events), args.cgroup_dir)
    meter.begin("setup")
    cfg = preset(args.preset)
    cfg.context_len = args.context_len
    torch.manual_seed(0)
    module = GPTModule(cfg, learning_rate=args.lr)
    windows = ByteWindows(load_corpus("stdlib"), args.context_len)
    # One batch per epoch, the same each step (as benchmarks/scale.py): a resumed run then sees exactly
    # the batches of an uninterrupted one, whatever Lightning does with a mid-epoch restart.
    loader = DataLoader(Subset(windows, range(args.batch)), batch_size=args.batch, shuffle=False)
    val_loader = DataLoader(Subset(windows, range(args.batch, 2 * args.batch)), batch_size=args.batch)
    export_times: dict[str, float] = {}

    def on_progress(event):  # the end-of-fit export's own seconds, from the strategy's progress events
        if event.phase == "export":
            export_times.setdefault("start", time.perf_counter())
            if event.stage == "end":
                export_times["end"] = time.perf_counter()

    # The defaults, except an explicit budget when asked (a shared machine whose MemAvailable share is
    # below the model's working set: the cgroup still bounds it).
    storage = None if args.host_budget_gib is None else {"placement": "auto",
                                                         "host_budget_bytes": int(args.host_budget_gib * 2**30)}
    strategy = snake_strategy.GreedySnakeStrategy(storage=storage,
                                                  progress=Progress(log=True, listeners=[on_progress]))
    losses: list[float] = []

    class Timed(ModelCheckpoint):
        def _save_checkpoint(self, trainer, filepath):
            meter.begin(f"checkpoint {trainer.global_step}")
            super()._save_checkpoint(trainer, filepath)
            size = sum(f.stat().st_size for f in Path(filepath).rglob("*") if f.is_file())
            meter.end(path=str(filepath), bytes=size)

    class Phases(L.Callback):
        def on_train_start(self, trainer, pl_module):
            meter.end(plan=strategy.plan.describe(), budget_bytes=strategy.plan.host_budget_bytes,
                      budget_source=strategy.plan.host_budget_source)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            meter.begin(f"step {trainer.global_step + 1}")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            meter.end(loss=losses[-1])

        def on_train_end(self, trainer, pl_module):
            meter.begin("end_of_fit")

    callbacks: list = [Phases()]
    if args.checkpoint_every:
        callbacks.insert(0, Timed(dirpath=args.ckpt_dir, every_n_train_steps=args.checkpoint_every, save_top_k=-1,
                                  filename="{step}"))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.max_steps, max_epochs=-1,
                        logger=False, enable_checkpointing=bool(args.checkpoint_every), enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        default_root_dir=args.work_dir, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=args.resume)
    weights_file = strategy.weights_file
    # The file's name is gone once mapped (unless storage.export_dir keeps it): count the bytes the module maps.
    mapped = mapped_parameters(module) if weights_file else {}
    mapped_bytes = sum(p.numel() * p.element_size() for n, p in module.named_parameters() if n in mapped)
    meter.end(weights_file=weights_file, weights_file_bytes=mapped_bytes,
              export_s=export_times.get("end", 0.0) - export_times.get("start", 0.0), losses=losses)
    if args.validate:
        meter.begin("validate")
        result = L.Trainer(strategy=snake_strategy.GreedySnakeStrategy(), accelerator="cpu", devices=1, logger=False,
                           enable_progress_bar=False, enable_model_summary=False,
                           limit_val_batches=1).validate(module, val_loader, verbose=False)
        meter.end(val_loss=result[0]["val_loss"])
    if args.export_hf:
        meter.begin("export_hf")
        config, pairs = gpt_as_hf(module)
        dtype = getattr(torch, args.hf_dtype)
        files = export_hf(pairs, args.export_hf, config=config, dtype=dtype)
        size = sum((Path(args.export_hf) / f).stat().st_size for f in files)
        meter.end(bytes=size, dtype=args.hf_dtype)
        if args.check_hf:  # the mapping is the model: HF's logits equal the module's (small presets only)
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(args.export_hf, dtype=torch.float32)
            tokens = next(iter(val_loader))[0][:2]
            with torch.no_grad():
                hidden = module.pre_stage((tokens,))
                for block in module.blocks:
                    hidden = block(hidden)
                ours, theirs = module.post_stage(hidden), hf(input_ids=tokens).logits
            meter.emit(event="hf_check", max_abs_diff=float((ours - theirs).abs().max()))
        shutil.rmtree(args.export_hf, ignore_errors=True)  # its size is recorded; the disk is shared


# ---------------------------------------------------------------------- parent: cgroup, kill, disk
def tree_bytes(path: Path) -> int:
    """Allocated bytes under ``path`` (sparse state files count what they hold, not their length)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def run_child(args, name: str, work: Path, cgroup: str, kill_at_step: int | None = None, **options) -> dict:
    events = work / f"{name}.events.jsonl"
    tmp = work / f"{name}.tmp"  # the child's TMPDIR: its temporary ssd_dir lands here, so leftovers are found
    tmp.mkdir()
    root_dir = work / name  # the child's working directory and default_root_dir, empty at its start
    root_dir.mkdir()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--preset", args.preset, "--context-len", str(args.context_len),
           "--batch", str(args.batch), "--lr", str(args.lr), "--events", str(events), "--cgroup-dir", cgroup,
           "--work-dir", str(root_dir), "--hf-dtype", args.hf_dtype]
    if args.host_budget_gib is not None:
        cmd += ["--host-budget-gib", str(args.host_budget_gib)]
    for key, value in options.items():
        if value is True:
            cmd.append(f"--{key.replace('_', '-')}")
        elif value not in (None, False):
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(HERE.parent)}
    disk_start = disk_used_bytes(str(work))
    high_water = [disk_start]
    proc = subprocess.Popen(cmd, env=env, preexec_fn=enter_cgroup(cgroup), cwd=root_dir)
    killed_at = None
    step_s = None
    while proc.poll() is None:
        high_water[0] = max(high_water[0], disk_used_bytes(str(work)))
        records = _records(events)
        if kill_at_step is not None and killed_at is None:
            started = [r for r in records if r.get("event") == "start" and r["phase"] == f"step {kill_at_step}"]
            done = [r for r in records if r.get("event") == "end" and r["phase"].startswith("step ")]
            if started and done:
                step_s = step_s or max(r["seconds"] for r in done)
                if time.time() - started[0]["t"] >= 0.5 * step_s:  # halfway through the step
                    proc.send_signal(signal.SIGKILL)
                    killed_at = time.time()
        time.sleep(0.2)
    records = _records(events)
    out = {"name": name, "returncode": proc.returncode, "phases": [r for r in records if r.get("event") == "end"],
           "disk_high_water_bytes": high_water[0] - disk_start,
           "oom_killed": proc.returncode == -signal.SIGKILL and killed_at is None}
    out.update({k: v for r in records if r.get("event") == "hf_check" for k, v in r.items() if k != "event"})
    # What the process left behind, beyond what it was asked to write (checkpoints, the HF export live
    # elsewhere): a run that ended must leave no multi-GB scratch (the weights file) in its directories.
    out["left_in_root_dir_bytes"] = tree_bytes(root_dir)
    out["files_over_100mb_left"] = [str(f) for d in (root_dir, tmp) for f in d.rglob("*")
                                    if f.is_file() and f.stat().st_size > 100 * 2**20]
    if killed_at is None:
        out["left_in_tmpdir_bytes"] = tree_bytes(tmp)
    if killed_at is not None:
        out["killed_during_step"] = kill_at_step
        out["left_on_disk_after_kill_bytes"] = tree_bytes(tmp)  # outside the checkpoint directory
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _records(events: Path) -> list[dict]:
    if not events.exists():
        return []
    out = []
    for line in events.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def _losses(run: dict) -> list[float]:
    return [p["loss"] for p in run["phases"] if p["phase"].startswith("step ") and "loss" in p]


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{run['name']}: {p['phase']}", p) for run in report["runs"] for p in run["phases"]]
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(rows) + 1.5))
    labels = [r[0] for r in rows]
    ax.barh(labels, [p["peak_anon_bytes"] / 2**30 for _, p in rows], label="peak anonymous RSS")
    ax.barh(labels, [p["peak_file_bytes"] / 2**30 for _, p in rows],
            left=[p["peak_anon_bytes"] / 2**30 for _, p in rows], label="peak file-backed RSS (reclaimable)")
    ax.axvline(report["memory_limit_bytes"] / 2**30, color="tab:red", linestyle="--", label="cgroup limit")
    ax.invert_yaxis()
    ax.set_xlabel("GiB")
    ax.set_title(f"{report['preset']} ({report['params'] / 1e9:.2f}B params): peak memory per phase")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt_4b")
    p.add_argument("--phases", default="interrupted,resume,uninterrupted")
    p.add_argument("--steps", type=int, default=3, help="steps before the checkpoint (end_of_fit: all steps)")
    p.add_argument("--total-steps", type=int, default=5)
    p.add_argument("--memory-limit-gib", type=float, default=16.0)
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--hf-dtype", default="float32")
    p.add_argument("--host-budget-gib", type=float, default=None,
                   help="storage.host_budget_bytes (default: none, the defaults' automatic budget)")
    p.add_argument("--check-hf", action="store_true", help="compare HF logits with the module's (small presets)")
    p.add_argument("--work-root", default=None, help="where checkpoints and temporary ssd_dirs go")
    p.add_argument("--out", default=None)
    # child-only options
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("events", "cgroup-dir", "work-dir", "ckpt-dir", "resume", "export-hf"):
        p.add_argument(f"--{name}", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint-every", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--validate", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    phases = [x for x in args.phases.split(",") if x]
    unknown = set(phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
    if "resume" in phases and "interrupted" not in phases:
        p.error("resume needs the interrupted phase's checkpoint: --phases interrupted,resume")
    from snake_strategy.gpt import preset

    work = Path(tempfile.mkdtemp(prefix="snake-lifecycle-", dir=args.work_root))
    limit_bytes = int(args.memory_limit_gib * 2**30)
    cgroup = make_cgroup(limit_bytes, "lifecycle")
    runs: list[dict] = []
    ckpt_dir = work / "checkpoints"
    try:
        if "interrupted" in phases:
            runs.append(run_child(args, "interrupted", work, cgroup, kill_at_step=args.steps + 1,
                                  max_steps=args.total_steps, ckpt_dir=ckpt_dir, checkpoint_every=args.steps))
        if "resume" in phases:
            saved = sorted(ckpt_dir.glob("step=*.ckpt"), key=lambda f: int(f.stem.split("=")[1]))
            if not saved:
                raise SystemExit(f"the interrupted run saved no checkpoint in {ckpt_dir}")
            runs.append(run_child(args, "resume", work, cgroup, max_steps=args.total_steps, resume=saved[-1],
                                  validate=True, export_hf=work / "hf", check_hf=args.check_hf))
        if "uninterrupted" in phases:
            runs.append(run_child(args, "uninterrupted", work, cgroup, max_steps=args.total_steps))
        if "end_of_fit" in phases:
            runs.append(run_child(args, "end_of_fit", work, cgroup, max_steps=args.steps, validate=True,
                                  export_hf=work / "hf", check_hf=args.check_hf))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.rmdir(cgroup)
    by_name = {run["name"]: run for run in runs}
    report = {"preset": args.preset, "params": preset(args.preset).num_params(), "memory_limit_bytes": limit_bytes,
              "context_len": args.context_len, "batch": args.batch, "phases": phases, "runs": runs}
    if "resume" in by_name and "uninterrupted" in by_name:
        killed = _losses(by_name["interrupted"])  # steps 1..N, before the checkpoint
        resumed = killed[:args.steps] + _losses(by_name["resume"])
        report["resumed_losses"], report["uninterrupted_losses"] = resumed, _losses(by_name["uninterrupted"])
        report["resumed_losses_equal"] = resumed == report["uninterrupted_losses"]
    checkpoints = [p for run in runs for p in run["phases"] if p["phase"].startswith("checkpoint")]
    report["checkpoints"] = [{"seconds": c["seconds"], "bytes": c["bytes"], "gb_per_s": c["bytes"] / c["seconds"] / 1e9}
                             for c in checkpoints]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / f"{args.preset}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out.with_suffix(".png"))
    for run in runs:
        print(f"{run['name']}: rc {run['returncode']}, disk high-water {run['disk_high_water_bytes'] / 2**30:.2f} GiB"
              + (f", left after kill {run['left_on_disk_after_kill_bytes'] / 2**30:.3f} GiB"
                 if "left_on_disk_after_kill_bytes" in run else ""))
        for phase in run["phases"]:
            print(f"  {phase['phase']:>14}: {phase['seconds']:8.1f} s, peak RSS {phase['peak_rss_bytes'] / 2**30:6.2f} GiB"
                  f" (anon {phase['peak_anon_bytes'] / 2**30:.2f}, file {phase['peak_file_bytes'] / 2**30:.2f}), cgroup "
                  f"{(phase['cgroup_peak_bytes'] or 0) / 2**30:.2f} GiB")
    if "resumed_losses_equal" in report:
        print("resumed losses == uninterrupted:", report["resumed_losses_equal"])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
