"""Versioned SSD state files: a checkpoint pins a file's current version, the next update writes a new one.

The versioning API (used by checkpoints, open to any caller that needs a stable copy of a state):

    ``VersionedFile.pin(dest)``   make ``dest`` a hard link to the current version (after waiting for every
                                  submitted write to it); while any such link exists, the version is *held*
    ``fd_for_write(off, n)``      where a write goes: the current version in place while nobody holds it
                                  (no extra space, no extra write); the first write after it was pinned
                                  starts a new version (a new, empty file) and switches to it
    ``read_pieces(off, n)``       where a read comes from: while a new version is only partly written, the
                                  ranges not yet written come from the previous (held) version
    ``release``                   is unlinking the links (removing the checkpoint directory): the kernel
                                  frees the held version once nothing references it
    ``hold(off, n)``              keep bytes [off, off+n) readable as they are now (``held_pieces``) while
                                  writes go on, without a link: the speculative optimizer step's pre-step
                                  state (engine/optimizer/rollback.py). Like a pin, the next write starts a new version
    ``release_hold()``            the held bytes are not needed any more

"Held" is the inode's link count, read with one ``fstat`` per write while no new version is open (a
syscall beside each multi-MiB write): a file with more names than its own (one in a named ``ssd_dir``,
none for an anonymous ``O_TMPFILE``) is held.

Spares. A file under rollback holds starts a version every step, and one under checkpoints a version per
save. A new file costs the filesystem a block allocation per write and a free per closed version
(benchmarks/new_blocks.py measures it), so a version is kept as the *spare* when it is closed, and the next
new version overwrites it: two files per state, alternating, their blocks allocated once. A spare that a
checkpoint still links when the next version starts is closed instead (the checkpoint owns it; a
rotating ``last`` or top-k has released it by then). In a named directory the two are ``<name>`` and
``<name>.alt``; an anonymous version that a pin linked is never a spare (the kernel gives an O_TMPFILE
file a name only while it never had one, and a later pin must link it).

A new version receives every write of the state from then on; the previous version stays open for the
reads of what was not yet rewritten. An optimizer step rewrites every trainable element of a unit, so
after one step the previous version is read no more. The next ``pin`` closes it, copying first the
ranges never rewritten (e.g. the frozen part of a fine-tuned unit's weights: a cost of that layout)
with ``copy_file_range`` (a reflink on filesystems that have them).

Across filesystems a hard link is impossible (EXDEV): ``pin`` then tries a reflink (``FICLONE``, e.g. two
mounts of one btrfs/XFS volume) and otherwise copies with a pipelined, bounded-buffer copy (``copy_file``).
``pin`` returns which of "link", "reflink" or "copy" it used.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from typing import Callable

PAGE_BYTES = 4096
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
COPY_CHUNK_BYTES = 16 * 2**20
COPY_THREADS = 8  # x COPY_CHUNK_BYTES = 128 MiB of buffers at most


class VersionedFile:
    """One state's SSD file and its versions. ``open_version(slot)`` returns ``(fd, own_links)`` of a new,
    empty file of ``size_bytes`` in slot 0 or 1 (the directory's job: ``<name>`` or ``<name>.alt`` in a named
    directory, an anonymous file otherwise); ``drop_name(slot, fd)`` unlinks the slot's name if it still
    names ``fd``'s file (a held version closed: the checkpoint keeps the only link)."""

    def __init__(self, open_version: Callable[[int], tuple[int, int]], size_bytes: int,
                 drop_name: Callable[[int, int], None] | None = None) -> None:
        self._open_version = open_version
        self._drop_name = drop_name
        self.size_bytes = size_bytes
        self._slot = 0
        self.fd, self._own_links = open_version(0)
        self._previous: int | None = None  # the held version a new one is replacing
        self._previous_own_links = 0
        self._spare: tuple[int, int] | None = None  # (fd, own_links) of a version to overwrite (see above)
        self._reuse = False  # under rollback holds: keep closed versions as spares
        self._linked: set[int] = set()  # descriptors of anonymous versions a pin has linked
        self._held: tuple[int, int] | None = None  # bytes a rollback hold keeps (hold/release_hold)
        self._written: list[tuple[int, int]] = []  # byte ranges of the new version written so far
        self._tickets: list = []  # submitted transfers (anything with done()/wait()) that pin waits for
        self._lock = threading.Lock()
        self.versions = 1  # versions started so far (tests and telemetry)

    # ---------------------------------------------------------------------- the I/O path
    def fd_for_write(self, offset: int, num_bytes: int) -> int:
        with self._lock:
            if self._previous is None and (self._held is not None or os.fstat(self.fd).st_nlink > self._own_links):
                # Held by a checkpoint or a rollback: never write it again. The new file starts empty
                # (sparse); the ranges not yet written are read from the held version (read_pieces).
                self._previous, self._previous_own_links = self.fd, self._own_links
                self._slot = 1 - self._slot
                spare = self._take_spare()
                if spare is not None:  # allocated blocks: overwritten, nothing to allocate
                    self.fd, self._own_links = spare
                else:
                    self.fd, self._own_links = self._open_version(self._slot)
                self._written = []
                self.versions += 1
            if self._previous is not None:
                self._written = _merged(self._written + [(offset, offset + num_bytes)])
            return self.fd

    def read_pieces(self, offset: int, num_bytes: int) -> list[tuple[int, int, int, int]]:
        """``(fd, file offset, offset in the buffer, bytes)`` that together read ``[offset, offset+num_bytes)``."""
        with self._lock:
            if self._previous is None:
                return [(self.fd, offset, 0, num_bytes)]
            pieces, at, end = [], offset, offset + num_bytes
            for a, b in self._written + [(end, end)]:
                if b <= at:
                    continue
                if a > at:  # not rewritten yet: the held version has it
                    stop = min(a, end)
                    pieces.append((self._previous, at, at - offset, stop - at))
                    at = stop
                if at >= end:
                    break
                stop = min(b, end)
                if stop > at:
                    pieces.append((self.fd, at, at - offset, stop - at))
                    at = stop
            return pieces

    def track(self, ticket) -> None:
        """Remember a submitted transfer: ``pin`` and ``close`` wait for it."""
        with self._lock:
            self._tickets = [t for t in self._tickets if not t.done()] + [ticket]

    # ---------------------------------------------------------------------- rollback holds
    def hold(self, offset: int, num_bytes: int) -> None:
        """Keep bytes [offset, offset+num_bytes) readable as they are now (``held_pieces``) until
        ``release_hold``; writes go on into a new version. No copy: either the next write starts a new
        version (the current one then holds everything), or a new version already exists and has not
        rewritten the range yet (the previous one holds it). Only when it has (a pin's new version, partly
        rewritten) is the previous version settled first, at the cost of copying its other ranges."""
        self._wait_tickets()
        with self._lock:
            assert self._held is None, "one rollback hold at a time"
            rewritten = self._previous is not None and any(a < offset + num_bytes and offset < b
                                                           for a, b in self._written)
        if rewritten:
            self.settle()
        with self._lock:
            self._held = (offset, offset + num_bytes)
            self._reuse = True

    def held_pieces(self, offset: int, num_bytes: int) -> list[tuple[int, int, int, int]]:
        """``read_pieces`` of the held bytes, as they were at ``hold``."""
        with self._lock:
            assert self._held is not None and self._held[0] <= offset and offset + num_bytes <= self._held[1], \
                f"bytes [{offset}, {offset + num_bytes}) are not held"
            return [(self._previous if self._previous is not None else self.fd, offset, 0, num_bytes)]

    def release_hold(self) -> None:
        """Forget the hold (the previous version stays until the next ``hold`` or ``pin`` closes it)."""
        self._wait_tickets()  # the held bytes' reads are done
        with self._lock:
            self._held = None

    @property
    def holding(self) -> bool:
        return self._held is not None

    def allocated_bytes(self) -> int:
        """Disk blocks this state takes now, every open version together (``fstat``): telemetry and tests
        of what holds and pins cost."""
        with self._lock:
            fds = [fd for fd in (self.fd, self._previous, self._spare and self._spare[0]) if fd is not None]
            return sum(os.fstat(fd).st_blocks * 512 for fd in fds)

    # ---------------------------------------------------------------------- versions
    def _wait_tickets(self) -> None:
        with self._lock:
            tickets, self._tickets = self._tickets, []
        for ticket in tickets:
            ticket.wait()

    def settle(self, keep: bool = True) -> None:
        """Wait for the submitted transfers; then close the previous version, copying first what the new one
        never received (one ``copy_file_range`` per gap, in the kernel; not when ``keep`` is False: the
        file is being closed for good)."""
        self._wait_tickets()
        with self._lock:
            assert self._held is None or not keep, "a held version is settled only when the file closes"
            previous, self._previous = self._previous, None
            if previous is None:
                return
            gaps, at = [], 0
            for a, b in self._written + [(self.size_bytes, self.size_bytes)]:
                if a > at:
                    gaps.append((at, min(a, self.size_bytes)))
                at = max(at, b)
            self._written = []
        try:
            if gaps and keep:
                src, dst = _buffered(previous), _buffered(self.fd)
                try:
                    for a, b in gaps:
                        _copy_range(src, dst, a, b)
                    os.fsync(dst)
                finally:
                    os.close(src)
                    os.close(dst)
        finally:
            self._retire(previous, keep)

    def _retire(self, previous: int, keep: bool) -> None:
        """The previous version is read no more: kept as the spare (under rollback holds; or when a
        checkpoint holds it, in case that checkpoint is released before the next version starts, as a
        rotating ``last`` or top-k is: its blocks are then overwritten instead of freed and allocated again),
        else closed, which frees it once its checkpoints are released too."""
        pinned = os.fstat(previous).st_nlink > self._previous_own_links
        if keep and (self._reuse or pinned) and self._spare is None and self._linkable_again(previous,
                                                                                           self._previous_own_links):
            self._spare = (previous, self._previous_own_links)
            return
        self._close_version(previous, self._previous_own_links, pinned, 1 - self._slot)

    def _linkable_again(self, fd: int, own_links: int) -> bool:
        """Whether a later pin can link this version: a named one always; an anonymous one only if it was
        never linked (the kernel lets an O_TMPFILE file get a name while it never had one)."""
        return own_links > 0 or fd not in self._linked

    def _take_spare(self) -> tuple[int, int] | None:
        """The spare, if no checkpoint holds it any more; one still held is closed (the checkpoint's now)."""
        if self._spare is None:
            return None
        (fd, own_links), self._spare = self._spare, None
        if os.fstat(fd).st_nlink > own_links:
            self._close_version(fd, own_links, True, self._slot)
            return None
        return fd, own_links

    def _close_version(self, fd: int, own_links: int, pinned: bool, slot: int) -> None:
        if pinned and own_links and self._drop_name is not None:
            self._drop_name(slot, fd)  # the checkpoint keeps the only link
        self._linked.discard(fd)
        os.close(fd)

    def pin(self, dest: str | os.PathLike) -> str:
        """Make ``dest`` hold the current version (durable: fsynced); returns "link", "reflink" or "copy"."""
        self.settle()
        os.fsync(self.fd)
        try:
            link_open_file(self.fd, dest)
            self._linked.add(self.fd)
            return "link"
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOENT):
                # ENOENT: an unlinked (not O_TMPFILE) file cannot get a name again
                raise
        return place_copy(self.fd, dest, self.size_bytes)

    def close(self) -> None:
        try:
            self.settle(keep=False)
        finally:
            if self._spare is not None:
                os.close(self._spare[0])
                self._spare = None
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            self._linked.clear()


def link_open_file(fd: int, dest: str | os.PathLike) -> None:
    """A new name ``dest`` for the open file ``fd`` (also an anonymous O_TMPFILE one): ``linkat`` of
    ``/proc/self/fd/N`` with AT_SYMLINK_FOLLOW, which resolves the magic link to the file itself. (CPython
    calls plain ``link()``, which does not follow it, unless a directory descriptor is passed: the
    descriptor of "/" is ignored for absolute paths and only selects ``linkat``.)"""
    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.abspath(dest), src_dir_fd=root, follow_symlinks=True)
    finally:
        os.close(root)


def place_copy(src_fd: int, dest: str | os.PathLike, size_bytes: int) -> str:
    """Put a copy of ``src_fd``'s first ``size_bytes`` at ``dest`` (fsynced): a reflink where the filesystem
    shares blocks across the two paths, else the pipelined copy. Returns "reflink" or "copy"."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            fcntl.ioctl(fd, FICLONE, src_fd)
            method = "reflink"
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY, errno.ENOSYS):
                raise
            src = _buffered(src_fd)
            try:
                copy_file(src, fd, size_bytes)
            finally:
                os.close(src)
            method = "copy"
        os.ftruncate(fd, size_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return method


def copy_file(src: int, dst: int, size_bytes: int, chunk_bytes: int = COPY_CHUNK_BYTES,
              num_threads: int = COPY_THREADS) -> None:
    """Copy ``size_bytes`` from ``src`` to ``dst`` with ``num_threads`` threads, each one page-aligned buffer
    of ``chunk_bytes`` (memory bound: threads x chunk). pread/pwrite release the GIL, so one thread's read
    overlaps another's write: the copy runs at the slower of the two disks, not at their sum.

    Both sides go through O_DIRECT descriptors where the filesystems allow it (not tmpfs): buffered writes
    would leave the data to an fsync that, on a journaling filesystem, also waits for every other
    process's dirty pages (measured: 0.1 GB/s on a disk that probes at 1.2). Unaligned tails go through
    the buffered descriptors."""
    errors: list[BaseException] = []
    chunks = list(range(0, size_bytes, chunk_bytes))
    direct_src, direct_dst = direct_descriptor(src, os.O_RDONLY), direct_descriptor(dst, os.O_WRONLY)

    def work(k: int) -> None:
        buffer = mmap.mmap(-1, chunk_bytes)  # anonymous: page-aligned, as O_DIRECT needs
        view = memoryview(buffer)
        try:
            for start in chunks[k::num_threads]:
                length = min(chunk_bytes, size_bytes - start)
                aligned = length % PAGE_BYTES == 0
                reader = direct_src if aligned and direct_src is not None else src
                got = os.preadv(reader, [view[:length]], start)
                if got < length:  # a sparse tail the source never wrote: zeros, as the file reads
                    view[got:length] = bytes(length - got)
                writer = direct_dst if aligned and direct_dst is not None else dst
                done = 0
                while done < length:
                    done += os.pwritev(writer, [view[done:length]], start + done)
            view.release()
            buffer.close()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(err)

    try:
        threads = [threading.Thread(target=work, args=(k,), name=f"snake-copy_{k}") for k in range(num_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for fd in (direct_src, direct_dst):
            if fd is not None:
                os.close(fd)
    if errors:
        raise errors[0]


def direct_descriptor(fd: int, flags: int) -> int | None:
    """A second, O_DIRECT descriptor on ``fd``'s file; None where the filesystem refuses O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", flags | os.O_DIRECT)
    except OSError:
        return None


def _buffered(fd: int) -> int:
    # A second descriptor on the same file without O_DIRECT: copies of arbitrary ranges and sizes.
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR)


def _copy_range(src: int, dst: int, a: int, b: int) -> None:
    at = a
    while at < b:
        try:
            done = os.copy_file_range(src, dst, b - at, at, at)
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            data = os.pread(src, min(b - at, COPY_CHUNK_BYTES), at)
            done = os.pwrite(dst, data, at) if data else 0
        if done == 0:
            break  # past the end of the source: the new version's sparse zeros are the same bytes
        at += done


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
