"""benchmarks/gpu_check.py on a machine without CUDA: it exits 0 saying so, and its workers' code runs
(on the CPU accelerator) so the GPU session does not spend device time on a script error."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
@pytest.mark.parametrize("flags", [["--dry-run"], []])
def test_exits_cleanly_without_cuda(flags):
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout


def test_worker_code_runs_on_cpu(tmp_path):
    gpu_check = _load()
    tiny = dict(d_model=32, num_layers=2, num_heads=2, context_len=16, vocab_size=64)
    exact = gpu_check.worker_exactness(str(tmp_path), accelerator="cpu", shape=tiny, steps=2)
    assert exact["fp32_pass"] and exact["fp32_max_abs_diff"] < 1e-5
    assert exact["bf16_measured_tolerance"] > 0 and set(exact) >= {"bf16_pass", "passed"}
    run = ["t", "r1", "snake", gpu_check.SSD, "32-true", 1, 2, 3]
    out = gpu_check.run_worker(dict(kind="train", run=run, ssd_dir=str(tmp_path), accelerator="cpu",
                                    shape_override=tiny))
    assert out["tokens_per_s"] > 0 and out["pcie_bytes_per_step"] > 0 and 0 <= out["exposed_io_engine"] <= 1
    runs = {"r1_snake_ssd": out, "r1_snake_device": dict(out, s_per_step=out["s_per_step"] / 2)}
    summary = gpu_check._summarize(runs, {"h2d_GBps": 50.0, "d2h_GBps": 50.0})
    assert summary["r1_exposed_io_vs_device"] == pytest.approx(0.5)
