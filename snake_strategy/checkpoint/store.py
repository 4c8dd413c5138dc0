"""Saving a checkpoint directory from the engine's tiers, keeping a complete one under its name at every
instant, and loading it back (format.py has the layout).

Saving streams one unit at a time from its tiers (never the whole model in memory) into a temporary
sibling ``.<name>.tmp-<pid>`` that replaces ``<name>`` only when complete, so a failure (ENOSPC, EIO, a
kill) leaves the previous checkpoint intact. The replacement keeps a complete checkpoint under the name
at every instant: one atomic exchange of the two directories where the filesystem has it (Linux
``renameat2(RENAME_EXCHANGE)``), otherwise the old one is renamed aside to ``.<name>.old-<pid>`` first.
A kill between those two renames leaves the name missing and the old checkpoint aside: the next save or
load of that name moves it back (and removes the leftovers of dead runs), and ``read_manifest``,
``consolidate`` and the CLI read it too.

Loading verifies every file's size and CRC-32 before use, refuses a model whose frozen base weights
differ from the ones the checkpoint was trained on, and reads each unit's state through
``format.read_range`` whichever format wrote it (per-rank shards are re-sharded on another world size).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from snake_strategy.checkpoint import pins
from snake_strategy.checkpoint.pins import CHECKSUMS, ZERO_COPY_FORMAT
from snake_strategy.checkpoint.compatibility import check_frozen, check_optimizer_record, own_lengths
from snake_strategy.checkpoint.format import (DTYPES, FORMAT, fsync_file, fsync_parent, fsync_tree, read_meta,
                                              read_nonlayer, read_range, remove_path, save_torch, unit_pieces,
                                              verified_manifest, verify_file, without_nonlayer_copies, write_nonlayer,
                                              write_raw)
from snake_strategy.progress import Progress, format_bytes, or_quiet
from snake_strategy.storage.ssd_directory import pid_alive

if TYPE_CHECKING:
    from snake_strategy.engine.state.api import CheckpointedEngine

log = logging.getLogger(__name__)


def save(engine: CheckpointedEngine, checkpoint: dict[str, Any], path: str | os.PathLike,
         progress: Progress | None = None, zero_copy: bool = False,
         checksum_read_bytes_per_s: float | None = None) -> dict[str, Any]:
    """Write ``engine``'s state to the directory ``path`` (one process's format; a data-parallel run with
    partitioned optimizer state writes per-rank shards instead: shards.save).

    ``zero_copy``: pin the SSD files instead of copying them (pins.py; format /3: what the
    strategy does); False streams every unit state through memory into new files (format /1: a copy that
    shares nothing with the run, e.g. for an archive).
    Returns what was done: ``written_bytes``, ``seconds``, ``methods`` (how the SSD files got there),
    ``phases_s`` (seconds of the flush, the unit files, and the rest: non-layer state, meta, manifest).
    ``checksum_read_bytes_per_s``: the pace of the pinned files' background CRC-32s (pins.Checksums)."""
    start_s = time.perf_counter()
    final = Path(path)
    _recover(final, clean=True)
    tmp = sibling(final, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "units").mkdir(parents=True)
    try:
        engine.flush()  # pending deferred updates belong to the saved state
        phases_s = {"flush": time.perf_counter() - start_s}
        states = engine.state_names()
        unit_bytes = sum(engine.unit_state_numel(u, name) * t.elem_bytes
                         for u in range(engine.num_units) for name, t in engine.unit_tiers(u).items())
        # Bytes now in the checkpoint, linked or written (a zero-copy save writes only the non-SSD parts).
        tracker = or_quiet(progress).phase("checkpoint_save", len(states) * engine.num_units + 2, what="files",
                                           total_bytes=unit_bytes + engine.nonlayer_nbytes)
        files, unit_extra, methods = {}, None, None
        if zero_copy:
            files, unit_extra, methods = pins.pin_units(engine, tmp, tracker, write_raw)
        else:
            for u in range(engine.num_units):
                values = engine.unit_state(u)
                for state in states:
                    name = f"units/unit{u:05d}.{state}.bin"
                    files[name] = write_raw(tmp / name, values[state])
                    tracker.advance(1, files[name]["bytes"])
                del values  # one unit in memory at a time
        phases_s["units"] = time.perf_counter() - start_s - sum(phases_s.values())
        commit(engine, checkpoint, tmp, final, files, tracker, unit_extra=unit_extra)
        phases_s["commit"] = time.perf_counter() - start_s - sum(phases_s.values())
        pinned = [name for name, info in files.items() if info["crc32"] is None]
        # In the background, paced: reading them back at full speed is what zero-copy avoids.
        # The engine's SSD traffic goes first (no I/O engine: nothing of the state is on the SSD).
        CHECKSUMS.submit(final, pinned, checksum_read_bytes_per_s, engine.disk_idle)
        written = sum(info["bytes"] for name, info in files.items() if name not in pinned
                      or (methods and "copy" in methods))
        if methods is not None:
            log.info("checkpoint %s: %s", final, pins.describe_methods(methods))
        return {"written_bytes": written, "seconds": time.perf_counter() - start_s, "methods": dict(methods or {}),
                "phases_s": phases_s}
    except BaseException:
        # Before the replacement ``tmp`` holds the unfinished new checkpoint, after an exchange the old one:
        # garbage either way. The checkpoint under ``final`` (or set aside, see _replace) is untouched.
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit(engine: CheckpointedEngine, checkpoint: dict[str, Any], tmp: Path, final: Path, files: dict, tracker: Any,
           extra: dict | None = None, unit_extra: list[dict] | None = None) -> None:
    """Complete the checkpoint in ``tmp`` whose unit files ``files`` are written: the replicated parts
    (nonlayer.pt, meta.pt), the manifest last, then put it under ``final``'s name. Every file is fsynced
    before the rename (a power loss after it must not find a name over unwritten data)."""
    frozen = engine.frozen_checksums()
    units = [{"numel": engine.unit_numel(u), "slots": [list(slot) for slot in engine.unit_slots(u)],
              "frozen": {"names": [slot[0] for slot in engine.unit_slots(u, trainable=False)],
                         "crc32": frozen["units"][u]}, **own_lengths(engine, u), **(unit_extra[u] if unit_extra else {})}
             for u in range(engine.num_units)]
    nonlayer = engine.nonlayer_state()
    checkpoint, meta_record = without_nonlayer_copies(checkpoint, nonlayer)
    nonlayer_files, nonlayer_record = write_nonlayer(nonlayer, tmp)
    files.update(nonlayer_files)
    del nonlayer
    tracker.advance(1, sum(info["bytes"] for info in nonlayer_files.values()))
    files["meta.pt"] = save_torch(checkpoint, tmp / "meta.pt")
    tracker.advance(1, files["meta.pt"]["bytes"])
    manifest = {"format": ZERO_COPY_FORMAT if unit_extra is not None else FORMAT, "step_count": engine.step_count,
                "master_dtype": str(engine.master_dtype),
                "compute_dtype": str(engine.compute_dtype),  # the frozen CRC-32s are of these bytes
                "blocks_per_unit": engine.blocks_per_unit, "units": units, "files": files,
                "frozen_nonlayer": frozen["nonlayer"], "nonlayer": nonlayer_record, "optimizer": engine.optimizer_record(),
                **meta_record, **(extra or {})}
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    fsync_file(tmp / "manifest.json")
    fsync_tree(tmp)
    _replace(tmp, final)
    tracker.finish()


def _replace(new: Path, final: Path) -> None:
    """Put the complete directory ``new`` under ``final``'s name, a complete checkpoint there at every instant."""
    if not os.path.lexists(final):
        os.rename(new, final)  # nothing to displace: one atomic rename
        fsync_parent(final)
        return
    if _exchange(new, final):
        trash = new  # the old checkpoint now lies under the temporary name
    else:
        # Two renames: between them the name is missing and the old checkpoint lies aside, complete,
        # where _recover finds it if this process dies there.
        trash = sibling(final, "old")
        os.rename(final, trash)
        try:
            os.rename(new, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rename(trash, final)  # put the old one back; if even that fails, _recover will
            raise
    fsync_parent(final)
    remove_path(trash)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    platform, the C library or the filesystem does not offer it."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # e.g. NFS, some FUSE filesystems, old kernels
    raise OSError(code, f"exchanging {a} and {b} failed: {os.strerror(code)}")


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without it (glibc before 2.28)
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function


def sibling(final: Path, kind: str) -> Path:
    # The pid tells a later run whether the owner is still alive (a save in progress) or dead (garbage).
    return final.with_name(f".{final.name}.{kind}-{os.getpid()}")


def parse_sibling(name: str) -> tuple[str, str, int] | None:
    """``(checkpoint name, kind, pid)`` of a hidden sibling ``.<name>.<kind>-<pid>`` (``sibling``): a
    temporary (``tmp``), set-aside (``old``) or released (``del``, being removed: ``release``) copy; None
    for any other name."""
    if not name.startswith("."):
        return None
    stem, _, suffix = name[1:].rpartition(".")
    kind, _, pid = suffix.partition("-")
    if not stem or kind not in ("tmp", "old", "del") or not pid.isdigit():
        return None
    return stem, kind, int(pid)


def _leftovers(final: Path) -> list[tuple[Path, str, int]]:
    """``(path, kind, pid)`` of the siblings of ``final`` (``parse_sibling``)."""
    try:
        names = os.listdir(final.parent)
    except OSError:
        return []
    parsed = [(name, parse_sibling(name)) for name in names]
    return [(final.parent / name, p[1], p[2]) for name, p in parsed if p is not None and p[0] == final.name]


def _recover(final: Path, clean: bool, may_replace: bool = True) -> Path | None:
    """The directory that holds checkpoint ``final``: itself, or the old checkpoint a killed save set aside
    (moved back under its name; read where it lies if that is not allowed). None if there is neither.

    ``clean`` also removes what dead runs left: unfinished temporary directories and set-aside copies of
    a checkpoint that was replaced. A live process's siblings are its save in progress: never touched.

    Where the name is missing (a kill between the two renames of _replace: the old checkpoint aside, the
    new one complete under its temporary name), the newest complete copy (highest step in its manifest;
    on a tie the one set aside) goes back under the name, and a complete copy newer than the one under
    the name is never removed: it takes the name instead.

    ``may_replace`` False only fills a missing name (one rename, which several processes may race to do:
    the loser finds the name taken and uses it); it never displaces a checkpoint under the name.
    """
    mine_or_dead = [(p, kind) for p, kind, pid in _leftovers(final) if pid == os.getpid() or not pid_alive(pid)]
    found: Path | None = final if os.path.lexists(final) else None
    complete = [(_step_of(p), kind == "old", p) for p, kind in mine_or_dead if kind in ("old", "tmp")]
    complete = sorted((c for c in complete if c[0] is not None), key=lambda c: (c[0], c[1]))
    # Only where a complete copy competes (a stat per file of the checkpoint under the name).
    current = _step_of(final) if complete and found is not None and may_replace and found.is_dir() else None
    if complete and (found is None or (current is not None and complete[-1][0] > current)):
        newest = complete[-1][2]
        try:
            if found is not None:
                _replace(newest, final)  # the newer copy takes the name; the older one goes
            else:
                os.rename(newest, final)
                fsync_parent(final)
            found = final
        except OSError:
            if os.path.lexists(final):
                found = final  # another process (a data-parallel rank) adopted it first
            elif found is None:
                found = newest  # e.g. a read-only copy of the checkpoints: use it in place
    if clean:
        for leftover, _ in mine_or_dead:
            if leftover != found and os.path.lexists(leftover):
                remove_path(leftover)
    return found


def _step_of(root: Path) -> int | None:
    """The step of a complete checkpoint directory, None if incomplete. Complete: its manifest (written
    last, after every file was fsynced) parses and every file it lists is there with its recorded size
    (a stat each; the CRC-32s are checked by whoever loads it)."""
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        for name, info in manifest["files"].items():
            if os.stat(root / name).st_size != info["bytes"]:
                return None
        return int(manifest["step_count"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _held_bytes(path: Path) -> int:
    """Disk space the files under ``path`` hold (allocated blocks, each inode once: a zero-copy save's
    files are hard links)."""
    seen, total = set(), 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def sweep(directory: str | os.PathLike) -> list[str]:
    """For every checkpoint in ``directory`` that dead processes left siblings of (``.<name>.tmp-PID``:
    an unfinished or staged save, ``.old-PID``: one set aside, ``.del-PID``: one being released), put
    the newest complete copy under the name and remove the rest. A live process's siblings are its save
    in progress: left alone (a pid the system gave to another process since looks alive too: kept, never
    wrongly removed). Returns one line for the log (none when there was nothing): each path removed with
    the disk space it held, each checkpoint restored."""
    root = Path(directory)
    try:
        names = os.listdir(root)
    except OSError:
        return []
    finals, held = set(), {}
    for name in names:
        parsed = parse_sibling(name)
        if parsed is not None and not pid_alive(parsed[2]):
            finals.add(parsed[0])
            held[name] = _held_bytes(root / name)
    removed, restored = [], []
    for stem in sorted(finals):
        final = root / stem
        before = set(os.listdir(root))
        had = os.path.lexists(final)
        _recover(final, clean=True)
        removed += sorted(g for g in before - set(os.listdir(root)) if g != stem)
        if not had and os.path.lexists(final):
            restored.append(f"restored {final} (step {_step_of(final)}) from the copy a killed save left aside")
    if not removed and not restored:
        return []
    parts = []
    if removed:
        freed = sum(held.get(g, 0) for g in removed)
        each = ", ".join(f"{root / g} ({format_bytes(held.get(g, 0), binary=True)})" for g in removed)
        parts.append(f"removed {each}: what saves of dead processes left, {format_bytes(freed, binary=True)} in all")
    return ["; ".join(parts + restored)]


def sweep_and_log(directory: str | os.PathLike) -> None:
    """``sweep``, its line logged as a warning (the one message a run gives about what it cleaned)."""
    for line in sweep(directory):
        log.warning("checkpoint directory %s: %s", directory, line)


def adopt(path: str | os.PathLike) -> None:
    """Where the name ``path`` is missing and a killed save left a complete copy of it aside or staged,
    put the newest one under the name; nothing is removed and a checkpoint under the name is never
    displaced (safe in every data-parallel rank at once, before they agree on anything)."""
    _recover(Path(path), clean=False, may_replace=False)


def release(path: str | os.PathLike) -> None:
    """Remove a checkpoint directory (top-k rotation): renamed aside first (one atomic step), then its
    links unlinked; a kill during the unlinking leaves a hidden ``.del-PID`` that ``sweep`` removes."""
    final = Path(path)
    if not os.path.lexists(final):
        return
    aside = sibling(final, "del")
    os.rename(final, aside)
    fsync_parent(final)
    remove_path(aside)


def locate(path: str | os.PathLike) -> Path:
    """The checkpoint directory to read for ``path`` (see _recover); a ValueError that says what is there
    when it holds no checkpoint."""
    final = Path(path)
    found = _recover(final, clean=False)
    if found is None:
        busy = [pid for _, kind, pid in _leftovers(final) if kind == "old" and pid_alive(pid)]
        if busy:
            raise ValueError(f"{final} is being replaced by a running process (pid {busy[0]}) right now; retry "
                             "in a moment")
        partial = [p.name for p, kind, _ in _leftovers(final) if kind == "tmp"]
        raise ValueError(f"there is no checkpoint at {final}"
                         + (f" (only the unfinished save {partial[0]})" if partial else "")
                         + ": check the path (ckpt_path); ModelCheckpoint names them <dirpath>/<filename>.ckpt")
    if found.is_file():
        raise ValueError(f"{found} is a file, not a greedysnake checkpoint directory: an ordinary Lightning "
                         "checkpoint loads with strategy='auto', or as weights with "
                         "GreedySnakeStrategy(pretrained=path)")
    return found


def wrong_strategy_error(path: str | os.PathLike) -> ValueError:
    """What to tell someone who hands a greedysnake checkpoint directory to plain Lightning."""
    return ValueError(f"{path} is a greedysnake checkpoint directory; consolidate it with `python -m "
                      f"snake_strategy.checkpoint {path} out.ckpt` and load out.ckpt, or resume with "
                      "strategy='greedysnake'")


def read_manifest(path: str | os.PathLike, progress: Progress | None = None) -> dict:
    """The verified manifest of the checkpoint at ``path`` (every file's size and CRC-32 checked)."""
    return verified_manifest(locate(path), progress)


def recover(path: str | os.PathLike) -> None:
    """Adopt the checkpoint a killed save left aside under ``path``'s name, and drop what dead processes
    left in its directory (logged; what ``load`` does first; data-parallel ranks let rank 0 alone do it,
    then all load with ``recover=False``)."""
    _recover_directory(Path(path))


def _recover_directory(final: Path) -> None:
    sweep_and_log(final.parent)
    _recover(final, clean=True)  # this process's own leftovers of that name too


def load(engine: CheckpointedEngine, path: str | os.PathLike, progress: Progress | None = None,
         recover: bool = True) -> dict[str, Any]:
    """Stream a checkpoint into the engine's tiers; returns Lightning's checkpoint dict."""
    if recover:
        _recover_directory(Path(path))  # a resuming run owns the directory: adopt, drop dead runs' leftovers
    root = locate(path)
    # The shard files are verified by load_units, each rank those it reads.
    manifest = verified_manifest(root, progress, verify=lambda name: not name.startswith("shards/"))
    if len(manifest["units"]) != engine.num_units or manifest["blocks_per_unit"] != engine.blocks_per_unit:
        raise ValueError(f"{root} holds {len(manifest['units'])} units of {manifest['blocks_per_unit']} blocks; this "
                         f"run has {engine.num_units} of {engine.blocks_per_unit} (schedule.blocks_per_unit)")
    engine.flush()
    check_optimizer_record(root, manifest, engine)
    check_frozen(root, manifest, engine.frozen_checksums())
    load_units(engine, root, manifest, progress)
    engine.load_nonlayer_state(read_nonlayer(root, manifest))
    engine.step_count = manifest["step_count"]
    return read_meta(root, manifest)


def load_units(engine: CheckpointedEngine, root: Path, manifest: dict, progress: Progress | None = None) -> None:
    """Put the checkpoint's unit states (either format) into the engine's tiers: each rank reads the elements
    it keeps (its shard with partitioned state, else every unit whole), after verifying the files it reads.
    With several ranks the verification's outcome is agreed on first (one small gather), so a missing
    shard stops every rank with the same error before any collective."""
    dtype = DTYPES[manifest["master_dtype"]]
    ranges = []
    for u in range(engine.num_units):
        numel = engine.unit_numel(u)
        if manifest["units"][u]["numel"] != numel:
            raise ValueError(f"{root}: unit {u} has {manifest['units'][u]['numel']} parameters, the model {numel}")
        ranges.append(engine.unit_range(u))
    error = None
    try:
        _verify_shards(root, manifest, ranges)
    except ValueError as err:
        error = str(err)
    if engine.world_size > 1 and dist.is_available() and dist.is_initialized():
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, error)  # sync point: one small gather, before any other collective
        error = next((f"rank {r}: {e}" for r, e in enumerate(reports) if e is not None), None)
    if error is not None:
        raise ValueError(error)
    states = engine.state_names()
    tracker = or_quiet(progress).phase("checkpoint_load", engine.num_units, total_bytes=len(states)
                                       * dtype.itemsize * sum(hi - lo for lo, hi in ranges))
    for u, (lo, hi) in enumerate(ranges):
        tiers = engine.unit_tiers(u)
        own = manifest["units"][u].get("state_numel", {})
        state = {name: read_range(root, manifest, u, name, *((0, own[name]) if name in own else (lo, hi)),
                                  dtype if name == "master" else tiers[name].dtype) for name in states}
        engine.load_unit_state(u, state)  # partitioned: + the all-gather of the weights (a collective)
        tracker.advance(1, sum(t.numel() * t.element_size() for t in state.values()))
    tracker.finish()


def _verify_shards(root: Path, manifest: dict, ranges: list[tuple[int, int]]) -> None:
    """Every shard file must exist with its recorded size (a stat each: a checkpoint with a shard missing is
    incomplete, whoever reads it); the ones this rank reads are CRC-checked too."""
    shards = manifest.get("shards")
    if shards is None:
        return  # one process's format: checkpoint.load verified its files
    files = manifest["files"]
    listed = {name for name in files if name.startswith("shards/")}
    states = ("master", *manifest.get("optimizer", {"slots": {"exp_avg": 0, "exp_avg_sq": 0}})["slots"])
    for u in range(len(manifest["units"])):
        for _, _, pattern in unit_pieces(manifest, u):
            missing = [pattern.format(state=s) for s in states if pattern.format(state=s) not in listed]
            if missing:
                raise ValueError(f"{root / 'manifest.json'} does not list the shard file {missing[0]}: the manifest is "
                                 "corrupt; use another checkpoint")
    needed = {pattern.format(state=s) for u, (lo, hi) in enumerate(ranges)
              for a, b, pattern in unit_pieces(manifest, u) if max(a, lo) < min(b, hi) for s in states}
    hint = (f": {root} was saved by {shards['world_size']} ranks, each writing its own shard under shards/rank<r>/, "
            "and resuming needs all of them. Copy or move the whole checkpoint directory (a run on several machines "
            "must save its checkpoints to a filesystem every rank shares), or resume from another checkpoint")
    for name in sorted(listed):
        path = root / name
        try:
            if not path.exists():
                raise ValueError(f"checkpoint shard file {path} is missing")
            if name in needed:
                verify_file(path, files[name])  # size and CRC-32
            elif path.stat().st_size != files[name]["bytes"]:  # another rank's: the size only (no read)
                size, want = path.stat().st_size, files[name]["bytes"]
                raise ValueError(f"checkpoint file {path} is {'shorter' if size < want else 'longer'} than the "
                                 f"manifest says ({size}, not {want} bytes): truncated or overwritten")
        except ValueError as err:
            raise ValueError(f"{err}{hint}") from None
