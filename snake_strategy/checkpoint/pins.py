"""Zero-copy unit files of a checkpoint (format ``greedysnake-checkpoint/3``), their checksums, and release.

A unit state (master weights, one Adam moment) lives on up to three tiers: elements ``[0, host_end)`` on
the device and in host memory, ``[host_end, numel)`` in an SSD file (storage/tiered.py). A zero-copy save
writes the first part (``units/unitNNNNN.<state>.head.bin``; or the whole state as ``<state>.bin`` when
nothing of it is on the SSD) and *pins* the SSD file (storage/versions.py): ``units/unitNNNNN.<state>.bin``
becomes a hard link to the current version, which the engine never writes again. The manifest's
``pieces`` say which file holds which elements: ``[lo, hi, file, byte offset in the file]``.

Cost model: a save writes the host-tier and device-tier parts, the non-layer state and the manifest; no
byte of the SSD tier. A kept checkpoint costs no space until training updates its units; from then on it
holds the versions it pinned, up to one more copy of the SSD state, until it is released.

Checksums. Reading the pinned files back to checksum them would cost what the copy cost, so the save
records their sizes only, and a background thread (``Checksums``) reads them afterwards, only while the
engine's I/O is idle and at most at a small share of the SSD's read rate, and rewrites the manifest
atomically with their CRC-32s (working through a descriptor of the checkpoint directory, which
follows it through the renames of ``last``). Loading verifies a file's CRC-32 when the manifest has it,
its size always. A process killed before its checksums are done leaves sizes only.

Release (``release``): a checkpoint directory is first renamed aside (``.<name>.del-<pid>``, atomic), then
unlinked; a kill in between leaves a hidden directory that the next start sweeps (store.sweep). The
space of a pinned version comes back when the engine has moved past it and no checkpoint links it.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import queue
import shutil
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from snake_strategy.planning.memory_model import MemoryInputs, ssd_plan
from snake_strategy.storage.ssd_directory import nearest_existing, ssd_location
from snake_strategy.storage.tiered import tier_bounds, tier_bytes

if TYPE_CHECKING:
    from snake_strategy.engine.state.api import CheckpointedEngine
    from snake_strategy.planning.run_plan import RunPlan

log = logging.getLogger(__name__)

ZERO_COPY_FORMAT = "greedysnake-checkpoint/3"
_METHOD_WORDS = {"link": "hard links, 0 bytes of unit state written",
                 "reflink": "reflinks (FICLONE: another mount of the same filesystem), 0 bytes copied",
                 "copy": "a pipelined copy (the checkpoint directory is on another filesystem)"}


def pin_units(engine: CheckpointedEngine, tmp: Path, tracker: Any, write_raw: Callable[[Path, Any], dict]
              ) -> tuple[dict[str, dict], list[dict], Counter]:
    """Write the non-SSD parts of every unit state into ``tmp/units`` and pin the SSD parts there.
    Returns (files for the manifest, per-unit manifest additions, how many files each method placed)."""
    files: dict[str, dict] = {}
    extra: list[dict] = []
    methods: Counter = Counter()
    for u in range(engine.num_units):
        pieces = {}
        for state, tier in engine.unit_tiers(u).items():
            numel = engine.unit_state_numel(u, state)
            head_end = min(tier.host_end, numel)
            name = f"units/unit{u:05d}.{state}.bin"
            if numel <= tier.host_end:  # nothing of it on the SSD: one written file, as a copy save
                files[name] = write_raw(tmp / name, tier.read_copy(0, numel))
                tracker.advance(1, files[name]["bytes"])
                continue
            parts = []
            if head_end:
                head = f"units/unit{u:05d}.{state}.head.bin"
                files[head] = write_raw(tmp / head, tier.read_copy(0, head_end))
                parts.append([0, head_end, head, 0])
            methods[tier.ssd_file.pin(tmp / name)] += 1
            files[name] = {"bytes": tier.ssd_bytes, "crc32": None}  # Checksums fills it in
            parts.append([tier.host_end, numel, name, 0])
            pieces[state] = parts
            tracker.advance(1, numel * tier.elem_bytes)  # the state's bytes now in the checkpoint (linked or written)
        extra.append({"pieces": pieces} if pieces else {})
    return files, extra, methods


def describe_methods(methods: Counter) -> str:
    """What the log says about how the SSD files got into a checkpoint."""
    if not methods:
        return "no unit state on the SSD tier: every unit file written"
    return "; ".join(f"{n} unit file(s) by {_METHOD_WORDS[m]}" for m, n in sorted(methods.items()))


class Checksums:
    """One background thread that CRC-32s the pinned files of saved checkpoints and completes their
    manifests (see the module docstring). ``wait()`` blocks until every queued job is done."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._full_speed = threading.Event()  # set by wait(): no pacing
        self.remove_lock = threading.Lock()  # held around a manifest rewrite and around a removal

    def submit(self, root: Path, names: list[str], read_bytes_per_s: float | None = None,
               disk_idle: Callable[[], bool] | None = None) -> None:
        """Queue the CRC-32s of ``names`` in ``root``; their reads are paced to ``read_bytes_per_s`` (None:
        ``DEFAULT_CHECKSUM_READ_BYTES_PER_S``; ``checksum_read_rate`` derives it from the SSD's rate), and
        each waits until ``disk_idle()`` (the engine's ``IOEngine.idle``) says training's I/O leaves the
        disk free."""
        if not names:
            return
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # follows the directory through renames
        self._jobs.put((dir_fd, names, read_bytes_per_s or DEFAULT_CHECKSUM_READ_BYTES_PER_S, disk_idle))
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="snake-checksums", daemon=True)
                self._thread.start()

    def wait(self) -> None:
        """Finish every queued job at full speed (training is over: end of fit) and return."""
        self._full_speed.set()
        try:
            self._jobs.join()
        finally:
            self._full_speed.clear()

    def _work(self) -> None:
        # Training comes first: this thread runs on the cores training leaves idle (nice 19: the kernel
        # gives it ~1.5% of what a busy nice-0 thread gets), so the step after a save is not slowed by
        # reading the pinned state back. A kill before it is done leaves sizes only (see above).
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        while True:
            dir_fd, names, rate, disk_idle = self._jobs.get()
            try:
                self._complete(dir_fd, names, rate, disk_idle)
            except OSError as err:  # the checkpoint was released meanwhile: nothing to complete
                log.debug("checksums of a released checkpoint dropped: %s", err)
            finally:
                os.close(dir_fd)
                self._jobs.task_done()

    def _complete(self, dir_fd: int, names: list[str], read_bytes_per_s: float,
                  disk_idle: Callable[[], bool] | None) -> None:
        pace = _Pace(read_bytes_per_s, self._full_speed, disk_idle)
        crcs = {name: _crc_file(name, dir_fd, pace) for name in names}  # the long part, outside the lock
        with self.remove_lock:
            with open(os.open("manifest.json", os.O_RDONLY, dir_fd=dir_fd)) as f:
                manifest = json.load(f)
            for name, crc in crcs.items():
                manifest["files"][name]["crc32"] = crc
            fd = os.open(".manifest.json.crc", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, dir_fd=dir_fd)
            with open(fd, "w") as f:
                f.write(json.dumps(manifest))
                f.flush()
                os.fsync(f.fileno())
            os.rename(".manifest.json.crc", "manifest.json", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)


CRC_CHUNK_BYTES = 4 * 2**20  # the engine's chunk: a read of training's waits for at most one of these
# The checksums read the pinned state back once, and that read competes with the next step for the disk.
# Measured on gpt_1b with every state on the SSD: unpaced, the step after a save ran 1.54x slower; paced
# to 5% of the SSD's read rate, and each read waiting until the engine's I/O is idle (``_Pace``), the
# steps after the saves ran 1.07-1.14x a step before any save; at 1% 0.95-1.03x, as with no checksums
# (1.01-1.02x). The cost of 1%: gpt_1b's 14.5 GB take ~10 minutes to check, so with frequent saves a
# checkpoint may be released (or the run killed) before its sums are in; the end of fit finishes them at
# full speed, and loading checks sizes where no sum is.
CHECKSUM_READ_SHARE = 0.01
DEFAULT_CHECKSUM_READ_BYTES_PER_S = 16 * 2**20


def checksum_read_rate(ssd_read_gb_per_s: float | None) -> float:
    """Bytes per second the checksums read: ``CHECKSUM_READ_SHARE`` of the SSD's probed read rate."""
    if not ssd_read_gb_per_s:
        return DEFAULT_CHECKSUM_READ_BYTES_PER_S
    return CHECKSUM_READ_SHARE * ssd_read_gb_per_s * 1e9


IDLE_POLL_S = 0.01  # how often a checksum read looks again whether training's I/O left the disk


class _Pace:
    """Before each read: waits until ``disk_idle()`` and sleeps so that the bytes read so far take at least
    ``bytes / rate`` seconds; neither once ``full_speed`` is set (training is over)."""

    def __init__(self, bytes_per_s: float, full_speed: threading.Event,
                 disk_idle: Callable[[], bool] | None = None) -> None:
        self.bytes_per_s, self.start_s, self.done_bytes = bytes_per_s, time.monotonic(), 0
        self.full_speed, self.disk_idle = full_speed, disk_idle

    def before_read(self) -> None:
        while self.disk_idle is not None and not self.full_speed.is_set() and not self.disk_idle():
            self.full_speed.wait(IDLE_POLL_S)

    def read(self, num_bytes: int) -> None:
        self.done_bytes += num_bytes
        if self.full_speed.is_set():
            return
        ahead_s = self.done_bytes / self.bytes_per_s - (time.monotonic() - self.start_s)
        if ahead_s > 0:
            time.sleep(ahead_s)


def _crc_file(name: str, dir_fd: int, pace: _Pace | None = None) -> int:
    """CRC-32 of a file, read with O_DIRECT where the filesystem allows it: reading gigabytes of pinned
    state through the page cache would evict what training reads (and count against a cgroup's memory)."""
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0), dir_fd=dir_fd)
    except OSError:  # no O_DIRECT here (tmpfs): the page cache it is
        fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    crc, at = 0, 0
    buffer = mmap.mmap(-1, CRC_CHUNK_BYTES)  # anonymous: page-aligned, as O_DIRECT needs
    view = memoryview(buffer)
    try:
        while True:
            if pace is not None:
                pace.before_read()
            try:
                got = os.preadv(fd, [view], at)
            except OSError:  # an unaligned tail under O_DIRECT: read it through a buffered descriptor
                with open(os.open(name, os.O_RDONLY, dir_fd=dir_fd), "rb") as f:
                    f.seek(at)
                    while chunk := f.read(CRC_CHUNK_BYTES):
                        crc = zlib.crc32(chunk, crc)
                break
            crc = zlib.crc32(view[:got], crc)
            at += got
            if pace is not None:
                pace.read(got)
            if got < CRC_CHUNK_BYTES:  # the end of the file
                break
    finally:
        view.release()
        buffer.close()
        os.close(fd)
    return crc


CHECKSUMS = Checksums()


# ---------------------------------------------------------------------- space
def state_bytes(engine: CheckpointedEngine) -> tuple[int, int]:
    """(bytes of the checkpointed state on the SSD tier, bytes elsewhere) of ``engine``'s units."""
    ssd = other = 0
    for u in range(engine.num_units):
        for state, tier in engine.unit_tiers(u).items():
            numel = engine.unit_state_numel(u, state)
            head = min(getattr(tier, "host_end", numel), numel)
            other += head * tier.elem_bytes
            if numel > head:
                ssd += tier.ssd_bytes
    return ssd, other


def planned_state_bytes(inputs: MemoryInputs) -> tuple[int, int]:
    """``state_bytes`` of the engine a plan builds, from the plan's memory inputs before any file exists:
    the same tensors at the same tier bounds (storage/tiered.py) as engine/state/build.py lays them out."""
    ssd = other = 0
    for numel, held, split, elem_bytes in _checkpointed_tensors(inputs):
        _, host_end = tier_bounds(numel, split)
        head = min(host_end, held)
        other += head * elem_bytes
        if held > head:
            ssd += tier_bytes(numel, split, elem_bytes)["ssd"]
    return ssd, other


def _checkpointed_tensors(inputs: MemoryInputs):
    """(elements, elements a checkpoint holds, tier shares, bytes per element) of every unit tensor a
    checkpoint holds: the master copy (fp32 training: the weights' vector, of which the trainable head) and
    each optimizer slot."""
    s = inputs.storage
    for numel, trained in zip(inputs.unit_params, inputs.trainable):
        if inputs.separate_master:
            yield trained, trained, s.master, inputs.master_bytes
        else:
            yield numel, trained, s.weights, inputs.master_bytes
    for elem_bytes, numels, _ in inputs.slots():
        for numel in numels:
            yield numel, numel, s.optimizer, elem_bytes


def check_space(state: tuple[int, int], ssd_path: str | None, directory: str | os.PathLike, kept: int, what: str,
                ssd_tier_to_write: int = 0) -> None:
    """Refuse, before the first byte, a checkpoint plan that will not fit: each of ``kept`` retained
    checkpoints of distinct steps may come to hold one copy of the SSD state (on the SSD's filesystem when
    the checkpoints share it: pinned versions; on the checkpoint directory's otherwise: copies), plus the
    parts it writes. ``state``: (SSD bytes, other bytes) of the checkpointed state (``state_bytes`` of an
    engine, ``planned_state_bytes`` of a plan); ``ssd_tier_to_write``: the SSD tier's own files when they do
    not exist yet (at setup), which take the same filesystem's space first. ValueError with the numbers and
    the ways out."""
    ssd_bytes, other_bytes = state
    target = nearest_existing(directory)
    same_fs = ssd_path is not None and os.stat(nearest_existing(ssd_path)).st_dev == os.stat(target).st_dev
    needed = kept * (ssd_bytes + other_bytes)
    free = shutil.disk_usage(target).free
    if same_fs:
        if ssd_tier_to_write > free:
            return  # the SSD tier itself does not fit: the engine's own check refuses that, naming it
        free -= ssd_tier_to_write
    if needed <= free:
        return
    where = ("pinned versions on the SSD tier's filesystem (the checkpoints share it)" if same_fs
             else "copies on the checkpoint directory's filesystem")
    after = f" once the SSD tier's {ssd_tier_to_write} bytes are written" if same_fs and ssd_tier_to_write else ""
    raise ValueError(
        f"{what}: {kept} kept checkpoint(s) of this run need up to {needed} bytes ({needed / 2**30:.3g} GiB: "
        f"{ssd_bytes} bytes of SSD-tier state each, as {where}, plus {other_bytes} bytes written), but {target} "
        f"has {free} bytes ({free / 2**30:.3g} GiB) free{after}. Put the checkpoints on another disk "
        "(ModelCheckpoint(dirpath=...)), keep fewer of them (save_top_k, save_last), or place a share of the "
        "state on the host tier (storage.master / storage.optimizer host fraction)")


def kept_checkpoints(callback: Any) -> int:
    """How many checkpoints of distinct steps a ModelCheckpoint keeps at once (keep-all: the next one)."""
    top_k = getattr(callback, "save_top_k", 1)
    kept = max(top_k, 1) if top_k != 0 else 0
    return kept + (1 if getattr(callback, "save_last", False) else 0)


def prepare_checkpoint_dirs(plan: RunPlan, callbacks: list, is_global_zero: bool,
                            sweep: Callable[[str], None]) -> None:
    """At setup, before the engine writes anything: sweep each ModelCheckpoint directory of what killed saves
    left (``sweep``: store.sweep_and_log, rank 0 only; restores a ``last`` set aside: a directory resolved
    only now, from the logger's; the launcher swept those named up front), and check from the plan that its
    kept checkpoints fit their disk beside the SSD tier (a 7B model's streamed load takes minutes: the
    refusal comes before it)."""
    inputs = plan.memory_inputs()
    state, ssd_tier = planned_state_bytes(inputs), sum(ssd_plan(inputs).values())
    for callback in callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if not dirpath:
            continue
        if is_global_zero:
            sweep(dirpath)
        kept = kept_checkpoints(callback)
        # per-rank shards of partitioned state are written, not pinned: not counted here
        if kept and inputs.shard_world_size == 1:
            check_space(state, ssd_location(plan.storage.ssd_dir), dirpath, kept,
                        f"ModelCheckpoint(dirpath={dirpath!r}, save_top_k={callback.save_top_k}, "
                        f"save_last={callback.save_last})", ssd_tier)
