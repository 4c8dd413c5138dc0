"""The host memory a run may plan with: the one place that decides it (``host_budget``).

Three bounds, the tightest wins, and the plan records which one it was (``RunPlan.host_budget_source``):

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

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

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
