"""A short probe of this machine's rates for the planner, cached on disk for a few hours.

Measures (about 3 s in all): SSD O_DIRECT write and read GB/s through the package's own I/O engine (and the
processor time per GB they take),
host memory copy GB/s, fp32 matmul FLOP/s at transformer-like shapes, and fused AdamW params/s. The
cache expires after ``PROBE_MAX_AGE_S``: a shared machine's rates move by 1.5x from one day to the next,
so a prediction takes the rates of the day (and the steps' own measurements then correct it,
planning/calibration.py).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import tempfile
import time
from dataclasses import asdict

import torch

from snake_strategy.optimizers.adam import AdamHyperParams, adam_step
from snake_strategy.planning.time_model import HardwareProfile
from snake_strategy.storage import IOEngine, SsdDirectory, aligned_empty
from snake_strategy.storage.aligned import padded_bytes

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "snake_strategy", "hardware.json")
PROBE_MAX_AGE_S = 6 * 3600.0
PROBE_VERSION = 2  # in the cache key: a profile probed by an older version (without a field) is probed again


def probe_hardware(ssd_dir: str | None = None, device: torch.device | None = None, probe_bytes: int = 256 * 2**20,
                   cache_path: str | None = DEFAULT_CACHE, refresh: bool = False) -> HardwareProfile:
    device = device or torch.device("cpu")
    # Keyed by the filesystem's device number: every directory on the same disk shares one probe.
    fs_device = os.stat(ssd_dir if ssd_dir and os.path.isdir(ssd_dir) else tempfile.gettempdir()).st_dev
    key = f"{socket.gethostname()}|fs{fs_device}|{device}|{torch.get_num_threads()}|v{PROBE_VERSION}"
    cache = _load(cache_path)
    entry = cache.get(key, {})
    if not refresh and time.time() - entry.get("probed_at", 0.0) < PROBE_MAX_AGE_S:
        return HardwareProfile(**entry["profile"])
    read_gbps, write_gbps, ssd_cpu_s_per_gb = _probe_ssd(ssd_dir, probe_bytes)
    profile = HardwareProfile(
        ssd_read_gb_per_s=read_gbps, ssd_write_gb_per_s=write_gbps, ssd_cpu_s_per_gb=ssd_cpu_s_per_gb,
        host_copy_gb_per_s=_probe_copy(),
        flops_per_s=_probe_matmul(device), optimizer_params_per_s=_probe_adam(),
        device_is_cpu=device.type == "cpu",
    )
    if cache_path:
        cache[key] = {"probed_at": time.time(), "profile": asdict(profile)}
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
        with open(cache_path, "w") as f:
            json.dump(cache, f, indent=1)
    return profile


def _load(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            cache = json.load(f)
        return {k: v for k, v in cache.items() if isinstance(v, dict) and "profile" in v}
    except (OSError, ValueError, AttributeError):
        return {}  # a corrupt cache is only a cache: probe again


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _probe_ssd(ssd_dir: str | None, num_bytes: int) -> tuple[float, float, float]:
    """(read GB/s, write GB/s, CPU seconds per GB moved): the transfers through the package's I/O engine, and
    the processor time they take from the process (O_DIRECT's system calls, the I/O threads' chunking): on a
    CPU-only machine that time is taken from the compute."""
    # A private sub-directory: the run's own directory is locked by its engine.
    scratch = tempfile.mkdtemp(prefix="snake-probe-", dir=ssd_dir if ssd_dir and os.path.isdir(ssd_dir) else None)
    ssd, io = SsdDirectory(scratch), IOEngine(num_threads=4)
    try:
        buffer = aligned_empty(num_bytes, torch.uint8)
        buffer.fill_(7)
        fd = ssd.open("probe/probe.bin", num_bytes)
        cpu_start_s = _process_cpu_s()
        start = time.perf_counter()
        io.submit_write(fd, 0, padded_bytes(buffer)).wait()
        os.fsync(fd)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        io.submit_read(fd, 0, padded_bytes(buffer)).wait()
        read_s = time.perf_counter() - start
        cpu_s = _process_cpu_s() - cpu_start_s
        return num_bytes / read_s / 1e9, num_bytes / write_s / 1e9, cpu_s / (2 * num_bytes / 1e9)
    finally:
        io.close()
        ssd.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _probe_copy(num_bytes: int = 256 * 2**20) -> float:
    src, dst = torch.ones(num_bytes // 4), torch.empty(num_bytes // 4)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * num_bytes / (time.perf_counter() - start) / 1e9


def _probe_matmul(device: torch.device) -> float:
    return matmul_flops_per_s(1024, 1024, 4096, device)


def matmul_flops_per_s(m: int, k: int, n: int, device: torch.device | None = None, min_time_s: float = 0.2) -> float:
    """Achieved fp32 FLOP/s of an (m x k) @ (k x n) product: the compute roof at a model's own shapes
    (small micro-batches run far below the large-matrix rate on a CPU)."""
    device = device or torch.device("cpu")
    a = torch.randn(m, k, device=device)
    b = torch.randn(k, n, device=device)
    a @ b
    reps, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < min_time_s:
        a @ b
        reps += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # sync point: only to time the kernels
        elapsed = time.perf_counter() - start
    return reps * 2 * m * k * n / elapsed


def _probe_adam(numel: int = 8 * 2**20) -> float:
    p, g = torch.zeros(numel), torch.ones(numel)
    m, v = torch.zeros(numel), torch.zeros(numel)
    hp = AdamHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.0, True)
    adam_step([p], [g], [m], [v], [0], hp)
    start = time.perf_counter()
    for step in range(3):
        adam_step([p], [g], [m], [v], [step + 1], hp)
    return 3 * numel / (time.perf_counter() - start)


_OPTIMIZER_RATES: dict[tuple, float] = {}


def optimizer_params_per_s(optimizer: torch.optim.Optimizer, shape: tuple[int, ...], dtype: torch.dtype,
                           min_time_s: float = 0.3) -> float:
    """Parameters per second the user's optimizer class steps (its own ``step``, optimizers/stepping.py) on
    a stand-in of ``shape`` (the largest block matrix), after a first step that creates its state. Measured
    once per class, shape and dtype in a process: the planner's optimizer term for optimizers that do not
    take the fused Adam kernel, whose rates range from ~8 M/s (Muon) to ~800 M/s (SGD) on one CPU core."""
    key = (type(optimizer), tuple(shape), dtype)
    if key not in _OPTIMIZER_RATES:
        from snake_strategy.optimizers.stepping import ShadowOptimizer, hyper_params
        shadow, group = ShadowOptimizer(optimizer), hyper_params(optimizer)[0]
        p = torch.randn(shape, dtype=dtype) * 0.02
        g = torch.randn(shape, dtype=dtype) * 1e-3
        state = shadow.step(group, [p], [g], [None])[0]
        steps, start = 0, time.perf_counter()
        while steps == 0 or time.perf_counter() - start < min_time_s:
            state = shadow.step(group, [p], [g], [state])[0]
            steps += 1
        _OPTIMIZER_RATES[key] = steps * p.numel() / (time.perf_counter() - start)
    return _OPTIMIZER_RATES[key]
