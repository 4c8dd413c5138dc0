"""The SSD tier's directory of state files: checked, locked, opened with O_DIRECT, versioned, and removed
at the end (the transfers: storage/io_engine.py)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile
import threading

import torch

import snake_strategy.storage.leftovers as leftovers
from snake_strategy.storage.aligned import PAGE_BYTES, aligned_empty, padded_bytes
from snake_strategy.storage.versions import VersionedFile

log = logging.getLogger(__name__)

LOCK_NAME = ".snake.lock"
ALT_SUFFIX = ".alt"  # a versioned state file's second name (storage/versions.py, "Spares")


def nearest_existing(path: str | os.PathLike) -> str:
    """``path`` (absolute), or its nearest existing parent: where a directory a run has not made yet will
    take its space from."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def ssd_location(ssd_dir: str | None) -> str:
    """The existing directory the SSD tier's files of ``storage.ssd_dir`` will live under (None: the
    temporary directory ``SsdDirectory`` makes its own in), for free-space checks before it exists."""
    return nearest_existing(ssd_dir or tempfile.gettempdir())


class SsdDirectory:
    """Owns the directory of state files: checks it, opens files (O_DIRECT when the filesystem allows
    it), and removes what it created on ``close()``: its files, the lock, and every directory it made
    (state sub-directories, and ``path`` itself with any missing parents). What was there before stays.

    In a temporary directory (``path=None``: the run made it) the state files have no name at all
    (``O_TMPFILE``): the kernel frees them when the last descriptor closes, also when the process is
    SIGKILLed or OOM-killed, so a killed run leaves no state behind. A checkpoint can still link them
    (``VersionedFile.pin``: ``linkat`` of ``/proc/self/fd/N``). Where the filesystem has no ``O_TMPFILE``
    (before Linux 3.11, some FUSE), each file is unlinked right after it is opened, which frees it the
    same way; such files cannot be linked, so a checkpoint copies them."""

    def __init__(self, path: str | None, use_o_direct: bool = True, keep_files: bool = False) -> None:
        self._owns_dir = path is None
        if self._owns_dir:
            leftovers.sweep_temporary(LOCK_NAME, owner_alive)  # no later run would ever open a dead one's again
        self.path = tempfile.mkdtemp(prefix="snake-ssd-") if path is None else os.path.abspath(path)
        self._keep_files = keep_files and not self._owns_dir
        self._fds: dict[str, int] = {}
        self._versioned: dict[str, VersionedFile] = {}
        self._created_dirs: list[str] = []
        self._lock = threading.Lock()
        self._lock_path = os.path.join(self.path, LOCK_NAME)
        self._holds_lock = False
        self._lock_fd: int | None = None
        self._closed = False
        self.anonymous = False
        try:
            self._check_writable()
            self._take_lock()
            self.o_direct = use_o_direct and self._probe_o_direct()
            self.anonymous = self._owns_dir  # nameless state files: see the class docstring
        except BaseException:
            try:
                self.close()  # e.g. a busy directory: leave no directory this attempt created
            except OSError:
                pass  # the error that stopped the start is the one to report
            raise

    def _check_writable(self) -> None:
        try:
            self._makedirs(self.path)
            probe = os.path.join(self.path, ".snake-write-probe")
            with open(probe, "wb") as f:
                f.write(b"\0" * PAGE_BYTES)
            os.remove(probe)
        except OSError as err:
            raise ValueError(
                f"storage.ssd_dir='{self.path}' is not a writable directory ({err.strerror}); "
                "point storage.ssd_dir at a directory on a local SSD you can write to, or leave it "
                "unset to use a temporary directory"
            ) from None

    def _take_lock(self) -> None:
        """Refuse a directory a live run is using; recover the lock of a run that was killed."""
        for _ in range(2):
            try:
                fd = os.open(self._lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                owner = leftovers.lock_pid(self._lock_path)
                if owner_alive(self._lock_path, owner):
                    raise ValueError(
                        f"storage.ssd_dir='{self.path}' is in use by a running process (pid {owner}, lock file "
                        f"{self._lock_path}); give this run its own storage.ssd_dir"
                    ) from None
                log.warning("removing the stale lock of a dead run (pid %s) in %s", owner, self.path)
                leftovers.reclaim(self.path, owner)  # the state files it listed: its state is lost anyway
                try:
                    os.remove(self._lock_path)
                except FileNotFoundError:
                    pass
                continue
            self._holds_lock = True
            # Held open under an flock until close: the kernel drops it when the process dies, however it
            # dies, and another PID namespace sharing this directory sees it where it cannot see our pid.
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a filesystem without flock (some FUSE), or a checker's brief test lock: the pid
                pass  # alone marks the owner, as before
            self._lock_fd = fd
            os.write(fd, str(os.getpid()).encode())
            leftovers.register(self.path)  # so a refused run elsewhere can name what a dead one left here
            return
        raise ValueError(f"could not take the lock {self._lock_path}; another run is starting in storage.ssd_dir")

    def _probe_o_direct(self) -> bool:
        if not hasattr(os, "O_DIRECT"):
            log.warning("O_DIRECT is not available on this platform; SSD files go through the page cache")
            return False
        probe = os.path.join(self.path, ".snake-odirect-probe")
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                os.pwritev(fd, [memoryview(padded_bytes(aligned_empty(PAGE_BYTES, torch.uint8)).numpy())], 0)
            finally:
                os.close(fd)
            return True
        except OSError as err:
            log.warning("filesystem at %s refuses O_DIRECT (%s); SSD files go through the page cache",
                        self.path, err.strerror)
            return False
        finally:
            if os.path.exists(probe):
                os.remove(probe)

    def check_free_space(self, needed_bytes: int, what: str) -> None:
        free_bytes = shutil.disk_usage(self.path).free
        if needed_bytes > free_bytes:
            dead = leftovers.dead_runs(self.path, LOCK_NAME, owner_alive)
            left = (f"; dead runs left {sum(d.size_bytes for d in dead) / 2**30:.3g} GiB on this filesystem: "
                    + ", ".join(d.describe() for d in dead) + " (remove them)") if dead else ""
            raise ValueError(
                f"storage.ssd_dir='{self.path}' has {free_bytes / 2**30:.3g} GiB free ({free_bytes} bytes) but "
                f"the plan puts {needed_bytes / 2**30:.3g} GiB ({needed_bytes} bytes) of {what} there; free space, point storage.ssd_dir "
                f"elsewhere, or move a share of the states to the host tier{left}"
            )

    def open(self, relative_path: str, size_bytes: int) -> int:
        """Create (truncate) a state file of ``size_bytes`` and return its descriptor."""
        full = os.path.join(self.path, relative_path)
        parent = os.path.dirname(full)
        with self._lock:
            self._makedirs(parent)
        if self.anonymous:
            fd, _ = self._open_version(full, size_bytes)  # nameless: freed by the kernel on any exit
        else:
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.o_direct else 0)
            fd = os.open(full, flags, 0o600)
            os.ftruncate(fd, size_bytes)
        with self._lock:
            self._fds[full] = fd
            leftovers.record_file(self.path, relative_path)
        return fd

    def open_versioned(self, relative_path: str, size_bytes: int) -> VersionedFile:
        """A state file of ``size_bytes`` whose versions a checkpoint can pin (storage/versions.py)."""
        full = os.path.join(self.path, relative_path)
        with self._lock:
            self._makedirs(os.path.dirname(full))
        names = (full, full + ALT_SUFFIX)  # a version's two names (storage/versions.py, "Spares")
        versioned = VersionedFile(lambda slot: self._open_version(names[slot], size_bytes), size_bytes,
                                  lambda slot, fd: _drop_name(names[slot], fd))
        with self._lock:
            self._versioned[full] = versioned
            if not self.anonymous:  # a dead run's files are reclaimed by name (leftovers.py)
                leftovers.record_file(self.path, relative_path)
                leftovers.record_file(self.path, relative_path + ALT_SUFFIX)
        return versioned

    def _open_version(self, full: str, size_bytes: int) -> tuple[int, int]:
        """A new, empty (sparse) file for ``full``: ``(fd, the links it has of its own)``."""
        direct = os.O_DIRECT if self.o_direct else 0
        if self.anonymous:
            try:
                fd = os.open(os.path.dirname(full), os.O_TMPFILE | os.O_RDWR | direct, 0o600)
                os.ftruncate(fd, size_bytes)
                return fd, 0
            except (OSError, AttributeError):
                # No O_TMPFILE here: a named file, unlinked at once (freed on any exit too; not linkable).
                fd = self._create(full, direct)
                os.unlink(full)
                os.ftruncate(fd, size_bytes)
                return fd, 0
        fd = self._create(full, direct)
        os.ftruncate(fd, size_bytes)
        return fd, 1

    @staticmethod
    def _create(full: str, direct: int) -> int:
        # Never O_TRUNC an existing name: its inode may be a version a checkpoint holds (a hard link).
        # Unlinking the name first leaves that version to the checkpoint.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(full)
        return os.open(full, os.O_RDWR | os.O_CREAT | os.O_EXCL | direct, 0o600)

    def file_sizes(self) -> dict[str, int]:
        """Each state file's size in bytes (``fstat`` of its descriptor: a nameless one has no path to
        stat), keyed as ``files()`` names them."""
        with self._lock:
            fds = list(self._fds.items()) + [(full, v.fd) for full, v in self._versioned.items()]
        return {(os.readlink(f"/proc/self/fd/{fd}") if self.anonymous else full): os.fstat(fd).st_size
                for full, fd in fds}

    def files(self) -> list[str]:
        """The state files by name; an anonymous one by what the kernel calls it (``/proc/self/fd/N``'s
        target: ``<dir>/#<inode> (deleted)``)."""
        with self._lock:
            if not self.anonymous:
                return sorted(list(self._fds) + list(self._versioned))
            fds = list(self._fds.values()) + [v.fd for v in self._versioned.values()]
        return sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in fds)

    def _makedirs(self, path: str) -> None:
        """``os.makedirs``, remembering every level it creates (close removes them, deepest first)."""
        missing = []
        while not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for level in reversed(missing):
            try:
                os.mkdir(level)
            except FileExistsError:
                if not os.path.isdir(level):  # a file in the way
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), level) from None
                continue  # a concurrent mkdir: not ours to remove
            self._created_dirs.append(level)

    def close(self) -> None:
        """Close every file, remove the files, the lock and the directories this run created, even when
        one of those steps fails; then raise the first failure. Safe to call again (a no-op)."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []

        def attempt(fn, *args) -> None:
            try:
                fn(*args)
            except BaseException as err:  # noqa: BLE001 - the rest must still be released; re-raised below
                errors.append(err)

        with self._lock:
            fds, self._fds = self._fds, {}
            versioned, self._versioned = self._versioned, {}
        for full, fd in fds.items():
            attempt(os.close, fd)
            if not self._keep_files:
                attempt(_remove_file, full)
        for full, state_file in versioned.items():
            attempt(state_file.close)
            if not self._keep_files and not self.anonymous:
                attempt(_remove_file, full)
                attempt(_remove_file, full + ALT_SUFFIX)
        if not self._keep_files:
            attempt(leftovers.forget, self.path)
        attempt(self._release_lock)
        if self._owns_dir:
            attempt(shutil.rmtree, self.path, True)
        elif not self._keep_files:
            attempt(self._remove_created_dirs)
        if errors:
            raise errors[0]

    def _release_lock(self) -> None:
        # Only the lock this object wrote: after a failed start, the file may be another run's.
        try:
            if self._holds_lock and leftovers.lock_pid(self._lock_path) == os.getpid():
                os.remove(self._lock_path)
        finally:
            self._holds_lock = False
            if self._lock_fd is not None:
                fd, self._lock_fd = self._lock_fd, None
                os.close(fd)

    def _remove_created_dirs(self) -> None:
        # Deepest first, and only when empty: a user's file put there during the run is never removed.
        for d in sorted(self._created_dirs, key=len, reverse=True):
            try:
                os.rmdir(d)
            except OSError:
                pass
        self._created_dirs = []


def _drop_name(path: str, fd: int) -> None:
    """Unlink ``path`` if it still names ``fd``'s file."""
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.remove(path)
    except FileNotFoundError:
        pass


def _remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def owner_alive(lock_path: str, pid: int | None) -> bool:
    """Whether the run that wrote this lock file still runs: it holds the file's flock, or its pid (from
    the file) exists here. Either alone keeps a directory: a lock written before the flock existed has the
    pid only, a run in another PID namespace the flock only."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return pid is not None and pid_alive(pid)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        pass  # a filesystem without flock: the pid decides
    finally:
        os.close(fd)  # releases the flock if this test took it
    return pid is not None and pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (a lock or a temporary file's owner is still running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
