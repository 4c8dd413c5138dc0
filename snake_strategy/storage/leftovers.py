"""What a killed run leaves in its ``ssd_dir``, found and reclaimed.

A run that dies by SIGKILL or the OOM killer cannot remove its state files; they can be tens of GB.
Each ``SsdDirectory`` therefore keeps, next to its lock (which holds its pid):

- a manifest (``MANIFEST_NAME``): one line per state file it created, relative to the directory. A later
  run that finds the lock stale (its pid is dead) removes exactly those files, nothing a user put there;
- an entry in a registry under the temporary directory (``REGISTRY_DIR``) naming the directory, so that a
  run refused for lack of space can name what dead runs left elsewhere on the same filesystem, and how
  much. Temporary ``snake-ssd-*`` directories with a stale lock are found there too.

Both are removed when the directory is closed normally. A temporary directory outlives a killed run (its
state files have no name and go with the process, but the directory, its lock and a named weights scratch
file stay), and no later run opens it again by name: a run that makes its own temporary directory first
removes the dead ones (``sweep_temporary``), and registry entries whose directory is gone.
"""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MANIFEST_NAME = ".snake-files"
REGISTRY_DIR = "snake-ssd-registry"
TEMP_PREFIX = "snake-ssd-"


@dataclass(frozen=True)
class Leftover:
    path: str  # the dead run's ssd_dir
    pid: int | None  # the dead run's pid (from its lock)
    size_bytes: int  # disk space its files hold (allocated blocks, not apparent size)

    def describe(self) -> str:
        return f"{self.path} (dead pid {self.pid}, {self.size_bytes / 2**30:.3g} GiB)"


def record_file(directory: str, relative_path: str) -> None:
    """Append a created state file to the directory's manifest (one short write per file)."""
    with open(os.path.join(directory, MANIFEST_NAME), "a") as f:
        f.write(relative_path + "\n")


def reclaim(directory: str, dead_pid: int | None) -> int:
    """Remove the files a dead run listed in its manifest (and the state directories they leave empty);
    the bytes given back. Paths that leave ``directory`` are ignored: the manifest is only ever trusted
    to name files inside it."""
    root = os.path.realpath(directory)
    freed_bytes, removed = 0, 0
    for relative in _manifest(directory):
        full = os.path.realpath(os.path.join(root, relative))
        if not full.startswith(root + os.sep):
            continue
        try:
            freed_bytes += _allocated_bytes(full)
            os.remove(full)
            removed += 1
        except FileNotFoundError:
            continue
        parent = os.path.dirname(full)
        while parent != root:
            try:
                os.rmdir(parent)  # only when empty
            except OSError:
                break
            parent = os.path.dirname(parent)
    forget(directory)
    if removed:
        log.warning("reclaimed %.3g GiB (%d files) that a dead run (pid %s) left in %s", freed_bytes / 2**30,
                    removed, dead_pid, directory)
    return freed_bytes


def register(directory: str) -> None:
    registry = os.path.join(tempfile.gettempdir(), REGISTRY_DIR)
    try:
        os.makedirs(registry, exist_ok=True)
        with open(_registry_entry(directory), "w") as f:
            f.write(os.path.abspath(directory))
    except OSError as err:  # a read-only temp directory: only the free-space message loses a hint
        log.debug("could not register %s (%s)", directory, err)


def forget(directory: str) -> None:
    """Drop the manifest and the registry entry (the directory was closed or reclaimed)."""
    for path in (os.path.join(directory, MANIFEST_NAME), _registry_entry(directory)):
        try:
            os.remove(path)
        except OSError:
            pass


def sweep_temporary(lock_name: str, is_alive: Callable[[str, int], bool]) -> int:
    """Remove the temporary ``snake-ssd-*`` directories whose lock names a dead pid (the files their manifest
    lists, then the lock and the directories left empty), and registry entries naming a directory that no
    longer exists. Returns the bytes given back. A directory holding a file nobody listed keeps it and its
    lock (a free-space refusal still names it); one without a lock is skipped: a starting run makes its
    directory before it takes the lock."""
    freed_bytes = 0
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), TEMP_PREFIX + "*")):
        lock_path = os.path.join(directory, lock_name)
        pid = lock_pid(lock_path)
        if pid is None or is_alive(lock_path, pid) or os.path.basename(directory) == REGISTRY_DIR:
            continue
        freed_bytes += reclaim(directory, pid)
        if any(os.path.join(d, n) != lock_path for d, _, names in os.walk(directory) for n in names):
            continue
        try:
            os.remove(lock_path)
        except OSError:
            continue
        for parent, _, _ in sorted(os.walk(directory), key=lambda entry: -len(entry[0])):
            try:
                os.rmdir(parent)  # only when empty
            except OSError:
                pass
        log.info("removed the temporary directory %s of a dead run (pid %s)", directory, pid)
    for entry in glob.glob(os.path.join(tempfile.gettempdir(), REGISTRY_DIR, "*")):
        try:
            with open(entry) as f:
                named = f.read().strip()
            if named and not os.path.isdir(named):
                os.remove(entry)
        except OSError:
            continue
    return freed_bytes


def dead_runs(near: str, lock_name: str, is_alive: Callable[[str, int], bool]) -> list[Leftover]:
    """Directories of dead runs on the same filesystem as ``near`` that still hold bytes: registered ones
    and temporary ``snake-ssd-*`` ones whose lock names a dead pid."""
    try:
        device = os.stat(near).st_dev
    except OSError:
        return []
    candidates = set(glob.glob(os.path.join(tempfile.gettempdir(), TEMP_PREFIX + "*")))
    for entry in glob.glob(os.path.join(tempfile.gettempdir(), REGISTRY_DIR, "*")):
        try:
            with open(entry) as f:
                candidates.add(f.read().strip())
        except OSError:
            continue
    found = []
    for directory in sorted(candidates):
        if os.path.realpath(directory) == os.path.realpath(near) or not os.path.isdir(directory):
            continue
        lock_path = os.path.join(directory, lock_name)
        pid = lock_pid(lock_path)
        if pid is None or is_alive(lock_path, pid):
            continue
        try:
            if os.stat(directory).st_dev != device:
                continue
        except OSError:
            continue
        listed = [os.path.join(directory, r) for r in _manifest(directory)]
        files = listed or [os.path.join(d, n) for d, _, names in os.walk(directory) for n in names]
        size = sum(_allocated_bytes(f) for f in files)
        if size:
            found.append(Leftover(directory, pid, size))
    return found


def _manifest(directory: str) -> list[str]:
    try:
        with open(os.path.join(directory, MANIFEST_NAME)) as f:
            return [line.strip() for line in f if line.strip()]
    except OSError:
        return []


def _registry_entry(directory: str) -> str:
    digest = hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()[:20]
    return os.path.join(tempfile.gettempdir(), REGISTRY_DIR, digest)


def _allocated_bytes(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512  # state files are sparse until written
    except OSError:
        return 0


def lock_pid(lock_path: str) -> int | None:
    """The pid a run's lock file holds (None: no file, or unreadable or torn: treated as stale)."""
    try:
        with open(lock_path) as f:
            return int(f.read().strip() or "0") or None
    except (OSError, ValueError):
        return None
