"""Llama-2-7B from an HF directory of bf16 safetensors on the defaults, inside memory cgroups on this machine.

    python benchmarks/llama7b.py                   # every phase below, ~1 h on 2 cores, ~80 GB of free disk
    python benchmarks/llama7b.py --phases lora     # one phase (the model directory is written when missing)

Phases, each a fresh process (its own peak RSS) inside a memory cgroup, the model the config of Llama-2-7B
(32 layers, hidden 4096, MLP 11008, vocab 32000) with random weights (norms 1, the rest N(0, 0.02)) written
once as bf16 safetensors shards under ``--root``, so nothing is downloaded:

- ``lora`` (8 GiB): ``HFCausalLM(dir)`` + ``peft.get_peft_model`` (rank 8 on q_proj/v_proj) and
  ``Trainer(strategy="greedysnake")``, the base streamed from the SSD tier: ``--steps-lora`` steps, then
  (inside fit, the engine reading its tiers) ``save_adapter`` and ``export_merged_hf`` (bf16).
- ``full_checkpoint`` (16 GiB): ``HFCausalLM(dir)`` whose ``configure_optimizers`` returns ``FastAdamW8bit``
  and ``Trainer(strategy="greedysnake")``, nothing else: 2 steps with a zero-copy directory checkpoint
  (``ModelCheckpoint``) after step 2, ``export_hf`` (bf16) inside fit after the last step. A kept checkpoint
  may come to hold one copy of the SSD state (36 GB here) once training moves past it, and the strategy
  checks that room at setup: on a disk with less free it is refused before step 1 (recorded as such).
- ``resume`` (16 GiB): the same module and ``fit(ckpt_path=<the checkpoint>)`` for 1 more step.
- ``full``: as ``full_checkpoint`` without the checkpoint.
- ``generate`` (16 GiB): ``HFCausalLM(<the export>)`` and ``trainer.predict`` under greedysnake with
  ``generate_in_predict`` (greedy decoding, the weights streamed from the SSD per token).

Each phase reports setup time, s/step, bytes per tier per step, the SSD space its state used (the disk's used
bytes before and at the end of fit), peak RSS against the plan, and the checkpoint's or export's size and
time; after each process exits, what it left in the temporary directory and in the SSD directory.
Writes ``benchmarks/results/llama7b/llama7b.json``. Not part of the test suite.
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

from common import (cgroup_peak_bytes, disk_used_bytes, enter_cgroup, make_cgroup, peak_rss_bytes, results_dir,
                    ssd_bytes, step_probe, write_random_hf)

HERE = Path(__file__).resolve().parent
RESULTS = results_dir("llama7b")
GIB = 2**30
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)
CGROUP_GIB = {"lora": 8, "full_checkpoint": 16, "full": 16, "resume": 16, "generate": 16}


def write_model(model_dir: Path, layers: int) -> dict:
    import torch
    from transformers import LlamaConfig
    config = LlamaConfig(**{**LLAMA2_7B, "num_hidden_layers": layers}, torch_dtype="bfloat16")
    start = time.perf_counter()
    params = write_random_hf(model_dir, config, dtype=torch.bfloat16, max_shard_bytes=2 * GIB)
    return dict(params=params, write_s=time.perf_counter() - start,
                bytes=sum(f.stat().st_size for f in model_dir.iterdir()))


def dir_bytes(path: Path) -> int:
    """Bytes of the distinct files under ``path`` (hard links once)."""
    seen, total = set(), 0
    for f in path.rglob("*"):
        if f.is_file():
            st = f.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def worker(args) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import snake_strategy  # noqa: F401  (registers "greedysnake")
    from snake_strategy.hf import HFCausalLM, export_hf, export_merged_hf, save_adapter
    from snake_strategy.optimizers import FastAdamW8bit

    root = Path(args.root)
    phase = args.worker
    out: dict = dict(phase=phase, cgroup_bytes=CGROUP_GIB[phase] * GIB)

    class Llama8bit(HFCausalLM):
        def configure_optimizers(self):
            return FastAdamW8bit(self.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)

    class Finish(L.Callback):
        """Inside fit, after the last step (the engine still holds the state): the saves the phase wants."""

        def on_train_end(self, trainer, pl_module):
            out["disk_used_at_end_of_fit_bytes"] = disk_used_bytes(str(root))
            start = time.perf_counter()
            if phase == "lora":
                save_adapter(peft_model, root / "adapter")
                out["save_adapter_s"] = time.perf_counter() - start
                out["adapter_bytes"] = dir_bytes(root / "adapter")
                start = time.perf_counter()
                export_merged_hf(peft_model, root / "merged", dtype=torch.bfloat16)
                out["export_s"], out["export_bytes"] = time.perf_counter() - start, dir_bytes(root / "merged")
                shutil.rmtree(root / "merged")  # disk: the full phase needs the room
            elif phase in ("full", "full_checkpoint", "resume") and args.export:
                export_hf(pl_module, root / "export", dtype=torch.bfloat16)
                out["export_s"], out["export_bytes"] = time.perf_counter() - start, dir_bytes(root / "export")

    probe = step_probe(label=f"{phase} ", rss_in_line=True)
    callbacks = [probe, Finish()]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (64, args.context), generator=g)
    loader = DataLoader([{"input_ids": row} for row in ids], batch_size=args.batch, shuffle=False)
    out["disk_used_before_bytes"] = disk_used_bytes(str(root))
    start = time.perf_counter()
    if phase == "generate":
        module = HFCausalLM(root / "export", generate_in_predict={"max_new_tokens": args.new_tokens})
        trainer = L.Trainer(strategy="greedysnake", accelerator="cpu", devices=1, logger=False)
        prompts = DataLoader([{"input_ids": ids[0, :16], "attention_mask": torch.ones(16, dtype=torch.long)}],
                             batch_size=1)
        tokens = trainer.predict(module, prompts)[0]
        out.update(generate_s=time.perf_counter() - start, new_tokens=int(tokens.shape[-1] - 16),
                   tokens=tokens.tolist(), peak_rss_bytes=peak_rss_bytes(),
                   eval_traffic=dict(trainer.strategy.eval_traffic or {}))
        return out
    if phase == "lora":
        import peft
        module = HFCausalLM(root / "model", learning_rate=1e-4)
        torch.manual_seed(0)
        peft_model = peft.get_peft_model(module, peft.LoraConfig(r=8, lora_alpha=16,
                                                                 target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        steps = args.steps_lora
    else:
        module = Llama8bit(root / "model", learning_rate=1e-5)
        steps = 3 if phase == "resume" else 2
    ckpt_path = None
    if phase == "full_checkpoint":
        class TimedCheckpoint(L.pytorch.callbacks.ModelCheckpoint):
            def _save_checkpoint(self, trainer, filepath):
                begin = time.perf_counter()
                super()._save_checkpoint(trainer, filepath)
                out["checkpoint_s"] = time.perf_counter() - begin
                out["disk_used_after_checkpoint_bytes"] = disk_used_bytes(str(root))

        callbacks.append(TimedCheckpoint(dirpath=root / "ckpt", filename="step{step}", every_n_train_steps=2,
                                         save_top_k=1))
    if phase == "resume":
        ckpt_path = str(next((root / "ckpt").glob("step*")))
    trainer = L.Trainer(strategy="greedysnake", accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=callbacks, enable_checkpointing=phase == "full_checkpoint")
    try:
        trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    except ValueError as err:  # a refusal at setup: record it with how long it took to come
        out.update(refused=str(err), refused_after_s=time.perf_counter() - start, step_s=probe.step_s)
        return out
    fit_s = time.perf_counter() - start
    plan = trainer.strategy.plan
    steady = probe.traffic[1:] or probe.traffic
    per_tier: dict[str, dict[str, int]] = {}
    for key, v in steady[-1].items():
        tier, _, direction = key.split("/")
        per_tier.setdefault(direction, {})
        per_tier[direction][tier] = per_tier[direction].get(tier, 0) + v
    out.update(
        params=sum(p.numel() for p in module.parameters()),
        trainable_params=sum(p.numel() for p in module.parameters() if p.requires_grad),
        setup_s=(probe.setup_done or start) - start, fit_s=fit_s, step_s=probe.step_s, losses=probe.losses,
        s_per_step=probe.steady_s_per_step(), tokens_per_step=args.batch * args.context,
        bytes_per_step_by_direction_and_tier=per_tier, traffic_per_step=steady[-1],
        ssd_read_bytes_per_step=ssd_bytes(steady[-1], "read"), ssd_write_bytes_per_step=ssd_bytes(steady[-1], "write"),
        ssd_state_bytes=out.get("disk_used_at_end_of_fit_bytes", 0) - out["disk_used_before_bytes"],
        peak_rss_in_training_bytes=probe.train_peak_rss_bytes, host_plan_bytes=sum(probe.host_plan_bytes.values()),
        host_plan_items=probe.host_plan_bytes, host_budget_bytes=plan.host_budget_bytes,
        process_baseline_bytes=plan.process_baseline_bytes, plan=plan.describe(),
        peak_rss_after_teardown_bytes=peak_rss_bytes())
    if phase == "full_checkpoint":
        ckpt = next((root / "ckpt").glob("step*"))
        out["checkpoint_bytes"] = dir_bytes(ckpt)
    return out


def run_phase(phase: str, args) -> dict:
    cgroup = make_cgroup(CGROUP_GIB[phase] * GIB, f"llama7b-{phase}")
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    cmd = [sys.executable, __file__, "--worker", phase, "--root", args.root, "--context", str(args.context),
           "--batch", str(args.batch), "--steps-lora", str(args.steps_lora), "--new-tokens", str(args.new_tokens)]
    cmd += ["--export"] if args.export else []
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=enter_cgroup(cgroup))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if not line.startswith(("RESULT ", "W1")) and ("step" in line or "rror" in line or "greedysnake" in line):
            sys.stdout.write(f"[{phase}] {line}")
            sys.stdout.flush()
    proc.wait()
    result = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
    if proc.returncode != 0 or result is None:
        result = dict(phase=phase, failed=True, returncode=proc.returncode, output_tail="".join(lines[-60:]))
    result["process_s"] = time.perf_counter() - start
    result["cgroup_peak_bytes"] = cgroup_peak_bytes(cgroup)
    left = sorted(set(os.listdir(tempfile.gettempdir())) - tmp_before)
    result["left_in_tmp_after_exit"] = left
    try:
        os.rmdir(cgroup)
    except OSError:
        pass
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="/var/tmp/snake-llama7b", help="model, checkpoint and exports (same disk as "
                   "the temporary directory, where the SSD tier goes on the defaults)")
    p.add_argument("--phases", default="lora,full_checkpoint,resume,full,generate")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per optimizer step (the default 4 micro-batches of 1)")
    p.add_argument("--steps-lora", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=2)
    p.add_argument("--export", action="store_true", help="export_hf at the end of the full/resume fit")
    p.add_argument("--keep", action="store_true", help="keep --root afterwards")
    p.add_argument("--out", default=str(RESULTS / "llama7b.json"))
    p.add_argument("--worker", choices=tuple(CGROUP_GIB), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args), default=str), flush=True)
        return 0
    root = Path(args.root)
    (root / "model").mkdir(parents=True, exist_ok=True)
    report: dict = dict(command=" ".join([sys.executable, "benchmarks/llama7b.py"] + (argv or sys.argv[1:])),
                        config=LLAMA2_7B, phases={})
    out = Path(args.out)
    if out.exists():
        report["phases"] = json.loads(out.read_text()).get("phases", {})
    if not (root / "model" / "config.json").exists():
        report["model"] = write_model(root / "model", args.layers)
        print(f"wrote the model: {report['model']}", flush=True)
    for phase in args.phases.split(","):
        if phase == "generate" and (root / "ckpt").exists():
            # the evaluation tier (the fp32 weights) needs the room the checkpoint holds
            shutil.rmtree(root / "ckpt")
        report["phases"][phase] = run_phase(phase, args)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str))
        r = report["phases"][phase]
        print(json.dumps({k: v for k, v in r.items() if k not in ("tokens", "output_tail", "traffic_per_step",
                                                                  "losses", "plan")}, default=str), flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
