"""Measurement of the machine: what it offers a run, measured at setup. Its rates (``probe_hardware``) and the
host memory a run may plan with (``host_budget``), each measured in one place.

**The rates**: a short probe, cached on disk for a few hours. Measures (about 3 s in all): SSD O_DIRECT write
and read GB/s through the package's own I/O engine (and the processor time per GB they take), host memory copy
GB/s, fp32 matmul FLOP/s at transformer-like shapes, and fused AdamW params/s. The cache expires after
``PROBE_MAX_AGE_S``: a shared machine's rates move by 1.5x from one day to the next, so a prediction takes the
rates of the day (and the steps' own measurements then correct it, planning/calibration.py).

**The host memory** a run may plan with (``host_budget``). Three bounds, the tightest wins, and the plan
records which one it was (``RunPlan.host_budget_source``):

- ``storage.host_budget_bytes`` when given (a hard cap: the engine refuses a plan over it);
- without it, ``AVAILABLE_MEMORY_SHARE`` of the memory the kernel reports available (MemAvailable), split
  among the processes of the node. A given budget replaces this estimate (the user knows what else
  will run; a warning says when it is above it) but not the cgroup's limit, which the kernel enforces;
- ``CGROUP_HEADROOM_SHARE`` of what the process's memory cgroup still allows: its limit minus its current usage
  (cgroup v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/``memory.usage_in_bytes``),
  over the process's cgroup and every ancestor (a parent's limit binds its children too). Inside a
  container MemAvailable reports the host's memory, not the container's limit: without this bound a run
  plans for memory it can never get and the kernel kills it.

The shares leave room for what the memory model does not see (allocator slack, Lightning, the data
pipeline). The cgroup's is larger: its limit is this run's alone and its usage already counts the
interpreter and the libraries, while MemAvailable is shared with every other process of the machine
(measured: with 0.6, or with 0.85 and the page cache counted as usage, gpt_4b in a 16 GiB cgroup could
not hold its 9.2 GiB working set). Usage excludes the inactive file cache (``memory.stat``),
which the kernel reclaims before it would kill anything: reading a corpus must not shrink the budget.
``SNAKE_CGROUP_ROOT`` (or the ``cgroup_root`` argument) points the cgroup lookup at another tree than
``/sys/fs/cgroup``: the tests use a fake one.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from snake_strategy.optimizers.adam import AdamHyperParams, adam_step
from snake_strategy.planning.time_model import HardwareProfile
from snake_strategy.storage import IOEngine, SsdDirectory, aligned_empty
from snake_strategy.storage.aligned import padded_bytes

log = logging.getLogger(__name__)

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


# Without storage.host_budget_bytes, auto placement plans within this share of the memory the process can
# still get at setup: the rest is for Python, Lightning, the data pipeline and what the memory model does
# not see.
AVAILABLE_MEMORY_SHARE = 0.6
# Of the cgroup's headroom (limit - usage at setup), the share the plan may fill.
CGROUP_HEADROOM_SHARE = 0.9
CGROUP_ROOT_ENV = "SNAKE_CGROUP_ROOT"
DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value; anything this large is none.
_UNLIMITED_BYTES = 2**60

SOURCE_GIVEN = "storage.host_budget_bytes"
SOURCE_CGROUP = "cgroup"
SOURCE_AVAILABLE = "MemAvailable"


@dataclass(frozen=True)
class HostBudget:
    budget_bytes: int  # what the plan may fill (per process)
    source: str  # which bound was the tightest: SOURCE_GIVEN, SOURCE_CGROUP or SOURCE_AVAILABLE
    detail: str  # the numbers behind it, for RunPlan.describe() and error messages
    hard: bool  # given explicitly: the engine refuses a plan over it


@dataclass(frozen=True)
class CgroupHeadroom:
    headroom_bytes: int  # limit minus usage at the tightest level
    limit_bytes: int
    usage_bytes: int
    path: str  # the cgroup directory whose limit binds


def _kib_field(path: str, field: str) -> int | None:
    """A ``Name:   123 kB`` field of a /proc file, in bytes; None when the file or the field is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory_bytes(meminfo_path: str = "/proc/meminfo") -> int:
    """MemAvailable (Linux), else the free physical pages: what a new allocation can get without swapping."""
    available = _kib_field(meminfo_path, "MemAvailable")
    return available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cgroup_headroom(cgroup_root: str | None = None, self_cgroup_path: str = "/proc/self/cgroup") -> CgroupHeadroom | None:
    """Limit minus usage of the tightest memory cgroup this process is in (its own or an ancestor's), or
    None when no level has a limit (or the tree cannot be read). ``self_cgroup_path``: the process's
    membership file (``/proc/self/cgroup``), one ``id:controllers:path`` line per hierarchy."""
    root = cgroup_root or os.environ.get(CGROUP_ROOT_ENV) or DEFAULT_CGROUP_ROOT
    try:
        with open(self_cgroup_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates: list[tuple[str, str, str]] = []  # (directory of the process's cgroup, limit file, usage file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":  # v2 (unified); in a hybrid layout its tree has no memory files and is skipped
            candidates.append((os.path.join(root, path), "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            candidates.append((os.path.join(root, "memory", path), "memory.limit_in_bytes", "memory.usage_in_bytes"))
    tightest: CgroupHeadroom | None = None
    for leaf, limit_file, usage_file in candidates:
        for directory in _self_and_ancestors(leaf, root):
            limit = _read_bytes(os.path.join(directory, limit_file))
            usage = _read_bytes(os.path.join(directory, usage_file))
            if limit is None or limit >= _UNLIMITED_BYTES or usage is None:
                continue
            usage = max(usage - _inactive_file_bytes(directory), 0)
            found = CgroupHeadroom(max(limit - usage, 0), limit, usage, directory)
            if tightest is None or found.headroom_bytes < tightest.headroom_bytes:
                tightest = found
    return tightest


def host_budget(given_bytes: int | None, processes_per_node: int = 1, cgroup_root: str | None = None,
                self_cgroup_path: str = "/proc/self/cgroup", meminfo_path: str = "/proc/meminfo") -> HostBudget:
    """The tightest of the given budget (else the MemAvailable share) and the cgroup share (module docstring)."""
    processes = max(processes_per_node, 1)
    available = available_memory_bytes(meminfo_path)
    estimate = HostBudget(int(AVAILABLE_MEMORY_SHARE * available / processes), SOURCE_AVAILABLE,
                          f"{AVAILABLE_MEMORY_SHARE:g} x MemAvailable {available / 2**30:.2f} GiB"
                          + (f" / {processes} processes" if processes > 1 else ""), False)
    options = [estimate] if given_bytes is None else []
    if given_bytes is not None and given_bytes > estimate.budget_bytes:
        log.warning("storage.host_budget_bytes=%d is above %s (%d bytes): the run plans for memory that other "
                    "processes may hold", given_bytes, estimate.detail, estimate.budget_bytes)
    cgroup = cgroup_headroom(cgroup_root, self_cgroup_path)
    if cgroup is not None:
        options.append(HostBudget(
            int(CGROUP_HEADROOM_SHARE * cgroup.headroom_bytes / processes), SOURCE_CGROUP,
            f"{CGROUP_HEADROOM_SHARE:g} x (cgroup {cgroup.path} limit {cgroup.limit_bytes / 2**30:.2f} GiB - "
            f"usage {cgroup.usage_bytes / 2**30:.2f} GiB)" + (f" / {processes} processes" if processes > 1 else ""),
            False))
    if given_bytes is not None:
        # Listed first: on a tie the explicit setting is the one named.
        options.insert(0, HostBudget(int(given_bytes), SOURCE_GIVEN, f"storage.host_budget_bytes={given_bytes}", True))
    tightest = min(options, key=lambda b: b.budget_bytes)
    # An explicit budget stays the hard cap the engine checks, even when a machine bound is tighter.
    return HostBudget(tightest.budget_bytes, tightest.source, tightest.detail, given_bytes is not None)


def resident_bytes(status_path: str = "/proc/self/status") -> int:
    """This process's resident set size now (``VmRSS``), 0 where the kernel does not say."""
    return _kib_field(status_path, "VmRSS") or 0


def process_baseline_bytes(tensors) -> int:
    """What this process holds at setup besides ``tensors`` (the module's parameters and buffers, which the
    engine takes into its tiers): the interpreter, torch, Lightning, the data pipeline. The budget is what the
    run may fill on top of it, so the process's peak is about the plan's host bytes plus this."""
    seen, held = set(), 0
    for t in tensors:
        if t.device.type != "cpu":
            continue  # meta tensors hold nothing; device tensors are not host memory
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held += storage.nbytes()
    return max(0, resident_bytes() - held)


def _self_and_ancestors(leaf: str, root: str) -> list[str]:
    out, directory = [], os.path.normpath(leaf)
    stop = os.path.normpath(root)
    while True:
        out.append(directory)
        if directory == stop or len(directory) <= len(stop):
            return out
        directory = os.path.dirname(directory)


def _inactive_file_bytes(directory: str) -> int:
    """Reclaimable page cache of a cgroup (v2 ``inactive_file``, v1 ``total_inactive_file``), 0 if unknown."""
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            stats = dict(line.split() for line in f if line.count(" ") == 1)
    except (OSError, ValueError):
        return 0
    for key in ("total_inactive_file", "inactive_file"):  # v1: the hierarchical total, as its usage is
        if key in stats and stats[key].isdigit():
            return int(stats[key])
    return 0


def _read_bytes(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED_BYTES
    try:
        return int(text)
    except ValueError:
        return None
