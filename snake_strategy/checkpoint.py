"""Directory checkpoints of the tiered state, their verification, and consolidation to one file.
(Over 500 lines: save, recovery and the CLI share the atomic-replacement helpers; issue 24 splits it.)

Layout of ``<name>.ckpt/`` (a directory):

    meta.pt          Lightning's checkpoint dict (loops, callbacks, LR schedulers, hparams); its
                     ``state_dict`` holds the non-layer parameters only
    nonlayer.pt      the non-layer parameters' master weights and Adam moments
    units/unitNNNNN.{master,exp_avg,exp_avg_sq}.bin   raw little-endian tensors, one unit per file
                     (data parallel with partitioned optimizer state: shards/rank{r}/..., see checkpoint_shards.py)
    manifest.json    written last: format, step, layouts (names, shapes, offsets), sizes and CRC-32s

Frozen parameters (``requires_grad=False``: a fine-tuning run's base weights) are not copied: the unit
files hold the trainable part only, and the manifest records each unit's frozen parameter names and
the CRC-32 of their stored bytes (``frozen``), and those of the frozen non-layer parameters
(``frozen_nonlayer``). Loading refuses a model whose base weights differ from the ones the checkpoint
was trained on; consolidation writes the trained parameters only.

Saving streams one unit at a time from its tiers (never the whole model in memory) into a temporary
sibling ``.<name>.tmp-<pid>`` that replaces ``<name>`` only when complete, so a failure (ENOSPC, EIO, a
kill) leaves the previous checkpoint intact. The replacement keeps a complete checkpoint under the name
at every instant: one atomic exchange of the two directories where the filesystem has it (Linux
``renameat2(RENAME_EXCHANGE)``), otherwise the old one is renamed aside to ``.<name>.old-<pid>`` first.
A kill between those two renames leaves the name missing and the old checkpoint aside: the next save or
load of that name moves it back (and removes the leftovers of dead runs), and ``read_manifest``,
``consolidate`` and the CLI read it too. Loading verifies every file's size and CRC-32 before use and
names the file that fails.
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
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from snake_strategy import checkpoint_pins
from snake_strategy.checkpoint_pins import CHECKSUMS, ZERO_COPY_FORMAT
from snake_strategy.progress import Progress, or_quiet
from snake_strategy.storage.io_engine import pid_alive

if TYPE_CHECKING:
    from snake_strategy.engine import SnakeEngine

log = logging.getLogger(__name__)

FORMAT = "greedysnake-checkpoint/1"
SHARDED_FORMAT = "greedysnake-checkpoint/2"  # per-rank shards instead of units/ (checkpoint_shards.py)
STATES = ("master", "exp_avg", "exp_avg_sq")
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}


def save(engine: SnakeEngine, checkpoint: dict[str, Any], path: str | os.PathLike,
         progress: Progress | None = None, zero_copy: bool = False) -> dict[str, Any]:
    """Write ``engine``'s state to the directory ``path`` (one process's format; a data-parallel run with
    partitioned optimizer state writes per-rank shards instead: checkpoint_shards.save).

    ``zero_copy``: pin the SSD files instead of copying them (checkpoint_pins.py; format /3: what the
    strategy does); False streams every unit state through memory into new files (format /1: a copy that
    shares nothing with the run, e.g. for an archive).
    Returns what was done: ``written_bytes``, ``seconds``, ``methods`` (how the SSD files got there)."""
    start_s = time.perf_counter()
    final = Path(path)
    _recover(final, clean=True)
    tmp = _sibling(final, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "units").mkdir(parents=True)
    try:
        engine.flush()  # pending deferred updates belong to the saved state
        unit_bytes = sum(engine.unit_numel(u) for u in range(engine.num_units)) * engine.dtypes.bytes_per("master")
        tracker = or_quiet(progress).phase("checkpoint_save", len(STATES) * engine.num_units + 2, what="files",
                                           total_bytes=len(STATES) * unit_bytes)
        files, unit_extra, methods = {}, None, None
        if zero_copy:
            files, unit_extra, methods = checkpoint_pins.pin_units(engine, tmp, tracker, _write_raw)
        else:
            for u in range(engine.num_units):
                values = engine.unit_state(u)
                for state in STATES:
                    name = f"units/unit{u:05d}.{state}.bin"
                    files[name] = _write_raw(tmp / name, values[state])
                    tracker.advance(1, files[name]["bytes"])
                del values  # one unit in memory at a time
        commit(engine, checkpoint, tmp, final, files, tracker, unit_extra=unit_extra)
        pinned = [name for name, info in files.items() if info["crc32"] is None]
        CHECKSUMS.submit(final, pinned)  # in the background: reading them back is what zero-copy avoids
        written = sum(info["bytes"] for name, info in files.items() if name not in pinned
                      or (methods and "copy" in methods))
        if methods is not None:
            log.info("checkpoint %s: %s", final, checkpoint_pins.describe_methods(methods))
        return {"written_bytes": written, "seconds": time.perf_counter() - start_s, "methods": dict(methods or {})}
    except BaseException:
        # Before the replacement ``tmp`` holds the unfinished new checkpoint, after an exchange the old one:
        # garbage either way. The checkpoint under ``final`` (or set aside, see _replace) is untouched.
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit(engine: SnakeEngine, checkpoint: dict[str, Any], tmp: Path, final: Path, files: dict, tracker: Any,
           extra: dict | None = None, unit_extra: list[dict] | None = None) -> None:
    """Complete the checkpoint in ``tmp`` whose unit files ``files`` are written: the replicated parts
    (nonlayer.pt, meta.pt), the manifest last, then put it under ``final``'s name. Every file is fsynced
    before the rename (a power loss after it must not find a name over unwritten data)."""
    frozen = engine.frozen_checksums()
    units = [{"numel": engine.unit_numel(u), "slots": [list(slot) for slot in engine.unit_slots(u)],
              "frozen": {"names": [slot[0] for slot in engine.unit_slots(u, trainable=False)],
                         "crc32": frozen["units"][u]}, **(unit_extra[u] if unit_extra else {})}
             for u in range(engine.num_units)]
    files["nonlayer.pt"] = _save_torch(engine.nonlayer_state(), tmp / "nonlayer.pt")
    tracker.advance(1, files["nonlayer.pt"]["bytes"])
    files["meta.pt"] = _save_torch(checkpoint, tmp / "meta.pt")
    tracker.advance(1, files["meta.pt"]["bytes"])
    manifest = {"format": ZERO_COPY_FORMAT if unit_extra is not None else FORMAT, "step_count": engine.step_count,
                "master_dtype": str(engine.dtypes.master),
                "compute_dtype": str(engine.dtypes.compute),  # the frozen CRC-32s are of these bytes
                "blocks_per_unit": engine.schedule.blocks_per_unit, "units": units, "files": files,
                "frozen_nonlayer": frozen["nonlayer"], **(extra or {})}
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    _fsync_file(tmp / "manifest.json")
    _fsync_dir(tmp)
    _replace(tmp, final)
    tracker.finish()


def _replace(new: Path, final: Path) -> None:
    """Put the complete directory ``new`` under ``final``'s name, a complete checkpoint there at every instant."""
    if not os.path.lexists(final):
        os.rename(new, final)  # nothing to displace: one atomic rename
        _fsync_parent(final)
        return
    if _exchange(new, final):
        trash = new  # the old checkpoint now lies under the temporary name
    else:
        # Two renames: between them the name is missing and the old checkpoint lies aside, complete,
        # where _recover finds it if this process dies there.
        trash = _sibling(final, "old")
        os.rename(final, trash)
        try:
            os.rename(new, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rename(trash, final)  # put the old one back; if even that fails, _recover will
            raise
    _fsync_parent(final)
    _remove(trash)


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


def _sibling(final: Path, kind: str) -> Path:
    # The pid tells a later run whether the owner is still alive (a save in progress) or dead (garbage).
    return final.with_name(f".{final.name}.{kind}-{os.getpid()}")


def _leftovers(final: Path) -> list[tuple[Path, str, int]]:
    """``(path, kind, pid)`` of the temporary (``tmp``), set-aside (``old``) and released (``del``, being
    removed: checkpoint_pins.release) siblings of ``final``."""
    prefix = f".{final.name}."
    try:
        names = os.listdir(final.parent)
    except OSError:
        return []
    found = []
    for name in names:
        if not name.startswith(prefix):
            continue
        kind, _, pid = name[len(prefix):].partition("-")
        if kind in ("tmp", "old", "del") and pid.isdigit():
            found.append((final.parent / name, kind, int(pid)))
    return found


def _recover(final: Path, clean: bool) -> Path | None:
    """The directory that holds checkpoint ``final``: itself, or the old checkpoint a killed save set aside
    (moved back under its name; read where it lies if that is not allowed). None if there is neither.

    ``clean`` also removes what dead runs left: unfinished temporary directories and set-aside copies of
    a checkpoint that was replaced. A live process's siblings are its save in progress: never touched.

    Where the name is missing (a kill between the two renames of _replace: the old checkpoint aside, the
    new one complete under its temporary name), the newest complete copy (highest step in its manifest;
    on a tie the one set aside) goes back under the name, and a complete copy newer than the one under
    the name is never removed: it takes the name instead.
    """
    mine_or_dead = [(p, kind) for p, kind, pid in _leftovers(final) if pid == os.getpid() or not pid_alive(pid)]
    found: Path | None = final if os.path.lexists(final) else None
    complete = [(_step_of(p), kind == "old", p) for p, kind in mine_or_dead if kind in ("old", "tmp")]
    complete = sorted((c for c in complete if c[0] is not None), key=lambda c: (c[0], c[1]))
    current = _step_of(final) if found is not None and found.is_dir() else None
    if complete and (found is None or (current is not None and complete[-1][0] > current)):
        newest = complete[-1][2]
        try:
            if found is not None:
                _replace(newest, final)  # the newer copy takes the name; the older one goes
            else:
                os.rename(newest, final)
            found = final
        except OSError:
            if found is None:
                found = newest  # e.g. a read-only copy of the checkpoints: use it in place
    if clean:
        for leftover, _ in mine_or_dead:
            if leftover != found and os.path.lexists(leftover):
                _remove(leftover)
    return found


def _step_of(root: Path) -> int | None:
    """The step of a complete checkpoint directory (its manifest is written last), None if incomplete."""
    try:
        return int(json.loads((root / "manifest.json").read_text())["step_count"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sweep(directory: str | os.PathLike) -> list[str]:
    """At the start of a run: for every checkpoint in ``directory`` that dead runs left siblings of
    (``.<name>.tmp-PID``, ``.old-PID``, ``.del-PID``), put the newest complete copy under the name and
    remove the rest. Returns what was removed or restored (for the log)."""
    root = Path(directory)
    try:
        names = os.listdir(root)
    except OSError:
        return []
    finals = set()
    for name in names:
        if name.startswith(".") and ("." in name[1:]):
            stem, _, suffix = name[1:].rpartition(".")
            kind, _, pid = suffix.partition("-")
            if kind in ("tmp", "old", "del") and pid.isdigit() and not pid_alive(int(pid)):
                finals.add(stem)
    done = []
    for stem in sorted(finals):
        final = root / stem
        before = set(os.listdir(root))
        had = os.path.lexists(final)
        _recover(final, clean=True)
        gone = sorted(before - set(os.listdir(root)))
        done += [f"removed {root / g}" for g in gone if g != stem]
        if not had and os.path.lexists(final):
            done.append(f"restored {final} (step {_step_of(final)}) from the copy a killed save left aside")
    return done


def release(path: str | os.PathLike) -> None:
    """Remove a checkpoint directory (top-k rotation): renamed aside first (one atomic step), then its
    links unlinked; a kill during the unlinking leaves a hidden ``.del-PID`` that ``sweep`` removes."""
    final = Path(path)
    if not os.path.lexists(final):
        return
    aside = _sibling(final, "del")
    os.rename(final, aside)
    _fsync_parent(final)
    _remove(aside)


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


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """True for a greedysnake checkpoint directory (complete or not), which plain Lightning cannot read."""
    root = Path(path)
    return root.is_dir() and ((root / "manifest.json").exists() or (root / "meta.pt").exists()
                              or (root / "units").is_dir() or (root / "shards").is_dir())


def wrong_strategy_error(path: str | os.PathLike) -> ValueError:
    """What to tell someone who hands a greedysnake checkpoint directory to plain Lightning."""
    return ValueError(f"{path} is a greedysnake checkpoint directory; consolidate it with `python -m "
                      f"snake_strategy.checkpoint {path} out.ckpt` and load out.ckpt, or resume with "
                      "strategy='greedysnake'")


def read_manifest(path: str | os.PathLike, progress: Progress | None = None) -> dict:
    """The verified manifest of the checkpoint at ``path`` (every file's size and CRC-32 checked)."""
    return _read_manifest(locate(path), progress)


def _read_manifest(root: Path, progress: Progress | None = None,
                   verify: Callable[[str], bool] | None = None) -> dict:
    """The manifest, after checking the size and CRC-32 of every file (of those ``verify`` accepts)."""
    manifest_path = root / "manifest.json"
    if not manifest_path.exists():
        raise ValueError(f"{root} is not a complete greedysnake checkpoint (no manifest.json): an interrupted save "
                         "or another format")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as err:
        raise ValueError(f"{manifest_path} is corrupt: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, SHARDED_FORMAT, ZERO_COPY_FORMAT):
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ValueError(f"{manifest_path} has format {found!r}, expected {FORMAT!r}")
    missing = [k for k in ("step_count", "master_dtype", "blocks_per_unit", "units", "files") if k not in manifest]
    if missing:
        raise ValueError(f"{manifest_path} is corrupt: it lacks {missing}")
    files = {name: info for name, info in manifest["files"].items() if verify is None or verify(name)}
    tracker = or_quiet(progress).phase("checkpoint_verify", len(files), what="files",
                                       total_bytes=sum(info["bytes"] for info in files.values()))
    for name, info in files.items():
        _verify(root / name, info)
        tracker.advance(1, info["bytes"])
    tracker.finish()
    return manifest


def recover(path: str | os.PathLike) -> None:
    """Adopt the checkpoint a killed save left aside under ``path``'s name, drop dead runs' leftovers (what
    ``load`` does first; data-parallel ranks let rank 0 alone do it, then all load with ``recover=False``)."""
    _recover(Path(path), clean=True)


def load(engine: SnakeEngine, path: str | os.PathLike, progress: Progress | None = None,
         recover: bool = True) -> dict[str, Any]:
    """Stream a checkpoint into the engine's tiers; returns Lightning's checkpoint dict."""
    if recover:
        _recover(Path(path), clean=True)  # a resuming run owns the name: adopt, and drop dead runs' leftovers
    from snake_strategy import checkpoint_shards  # it imports this module

    root = locate(path)
    # The shard files are verified by load_units, each rank those it reads.
    manifest = _read_manifest(root, progress, verify=lambda name: not name.startswith("shards/"))
    if len(manifest["units"]) != engine.num_units or manifest["blocks_per_unit"] != engine.schedule.blocks_per_unit:
        raise ValueError(f"{root} holds {len(manifest['units'])} units of {manifest['blocks_per_unit']} blocks; this "
                         f"run has {engine.num_units} of {engine.schedule.blocks_per_unit} (schedule.blocks_per_unit)")
    engine.flush()
    _check_frozen(root, manifest, engine.frozen_checksums())
    checkpoint_shards.load_units(engine, root, manifest, progress)
    engine.load_nonlayer_state(torch.load(root / "nonlayer.pt", map_location="cpu", weights_only=True))
    engine.step_count = manifest["step_count"]
    return torch.load(root / "meta.pt", map_location="cpu", weights_only=False)


def _check_frozen(root: Path, manifest: dict, current: dict) -> None:
    """Refuse to resume a fine-tuning checkpoint on top of other base weights than it was trained on."""
    saved_nonlayer = manifest.get("frozen_nonlayer", {})
    if set(saved_nonlayer) != set(current["nonlayer"]):
        raise ValueError(f"{root} was saved with frozen non-layer parameters {sorted(saved_nonlayer)}, this model "
                         f"freezes {sorted(current['nonlayer'])}; freeze the same parameters to resume it")
    changed = [name for name, crc in saved_nonlayer.items() if current["nonlayer"][name] != crc]
    for u, unit in enumerate(manifest["units"]):
        saved = unit.get("frozen", {"names": [], "crc32": zlib.crc32(b"")})
        if saved["crc32"] != current["units"][u]:
            changed += saved["names"] or [f"unit {u}"]
    if changed:
        raise ValueError(f"{root} does not hold the frozen (base) weights, and those of this model differ from the "
                         f"ones it was trained on ({changed[:3]}{' ...' if len(changed) > 3 else ''} have another "
                         "CRC-32): resume with the same base model (the same pretrained weights, seed and init)")


def consolidate(path: str | os.PathLike, out_path: str | os.PathLike,
                progress: Progress | None = None, base: Any = None) -> dict[str, Any]:
    """Write one ordinary Lightning checkpoint file with every parameter (master values).

    ``LightningModule.load_from_checkpoint(out_path)`` and ``torch.load(out_path)`` read it.
    Holds the whole model in memory once: that is what a single-file state dict is. A fine-tuning
    checkpoint holds no frozen base weights: ``base`` (checkpoint_weights.open_base) supplies them.
    """
    out = Path(out_path)
    if out.is_dir():
        raise ValueError(f"the output {out} is a directory; name the file to write, e.g. {out / 'model.ckpt'}")
    if not out.parent.is_dir():
        raise ValueError(f"the output directory {out.parent} does not exist; create it or write elsewhere")
    progress = or_quiet(progress)
    if base is not None:
        from snake_strategy.checkpoint_weights import load_consolidated_with_base  # it imports this module

        checkpoint = load_consolidated_with_base(path, base, progress)
    else:
        checkpoint = load_consolidated(path, progress)
    # One torch.save of the whole model: no progress inside it, but its size and rate when it ends.
    tensor_bytes = sum(v.numel() * v.element_size() for v in checkpoint["state_dict"].values()
                       if isinstance(v, torch.Tensor))
    with progress.phase("consolidate_write", 1, what="files", total_bytes=tensor_bytes) as tracker:
        torch.save(checkpoint, out)
        tracker.advance(1, out.stat().st_size)
    return checkpoint


def load_consolidated(path: str | os.PathLike, progress: Progress | None = None) -> dict[str, Any]:
    """The checkpoint at ``path`` as the dict of one ordinary Lightning checkpoint file (every parameter
    in ``state_dict``, no optimizer state), in memory: what ``consolidate`` writes, and what
    ``load_from_checkpoint`` can read from a buffer without a file on disk. A sharded checkpoint's
    shards are merged (each unit's master weights read from the shards that hold them)."""
    from snake_strategy.checkpoint_shards import read_range  # it imports this module

    root = locate(path)
    manifest = _read_manifest(root, progress)
    checkpoint = torch.load(root / "meta.pt", map_location="cpu", weights_only=False)
    dtype = _DTYPES[manifest["master_dtype"]]
    state = dict(checkpoint.get("state_dict", {}))
    tracker = or_quiet(progress).phase("consolidate", len(manifest["units"]),
                                       total_bytes=dtype.itemsize * sum(unit["numel"] for unit in manifest["units"]))
    for u, unit in enumerate(manifest["units"]):
        flat = read_range(root, manifest, u, "master", 0, unit["numel"], dtype)
        for name, shape, offset, numel in unit["slots"]:
            state[name] = flat[offset:offset + numel].view(shape).clone()
        tracker.advance(1, flat.numel() * flat.element_size())
    tracker.finish()
    checkpoint["state_dict"] = state
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def _write_raw(path: Path, value: torch.Tensor) -> dict:
    data = value.contiguous().view(torch.uint8).numpy()
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": data.nbytes, "crc32": zlib.crc32(memoryview(data))}


def _read_raw(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    value = torch.empty(numel, dtype=dtype)
    raw = value.view(torch.uint8).numpy()
    with open(path, "rb") as f:
        got = f.readinto(memoryview(raw))
    if got != raw.nbytes:
        raise ValueError(f"checkpoint file {path} is shorter than the manifest says ({got} of {raw.nbytes} "
                         "bytes): truncated after it was written")
    return value


class _Checksummed:
    """A file object that CRC-32s and counts what ``torch.save`` writes through it: no read-back (the
    non-layer state of a large vocabulary is GBs; reading it back cost as much as writing it)."""

    def __init__(self, f: Any) -> None:
        self.f, self.crc32, self.bytes = f, 0, 0

    def write(self, data: Any) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.bytes += len(memoryview(data).cast("B"))
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _save_torch(obj: Any, path: Path) -> dict:
    with open(path, "wb") as f:
        out = _Checksummed(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())  # durable before the commit rename names it
    return {"bytes": out.bytes, "crc32": out.crc32}


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _verify(path: Path, info: dict) -> None:
    if not path.exists():
        raise ValueError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if size < info["bytes"]:
        raise ValueError(f"checkpoint file {path} is shorter than the manifest says ({size} of {info['bytes']} "
                         "bytes): truncated, e.g. an interrupted copy or a full disk; use another checkpoint")
    if size != info["bytes"]:
        raise ValueError(f"checkpoint file {path} is longer than the manifest says ({size}, not {info['bytes']} "
                         "bytes): overwritten or appended to; use another checkpoint")
    if info["crc32"] is None:
        return  # a pinned file whose checksum the saving run did not complete (checkpoint_pins.Checksums)
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            crc = zlib.crc32(chunk, crc)
    if crc != info["crc32"]:
        raise ValueError(f"checkpoint file {path} is corrupt (CRC-32 {crc:#010x}, manifest {info['crc32']:#010x})")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        with CHECKSUMS.remove_lock:  # not while the checksum thread rewrites a manifest in it
            shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _fsync_parent(path: Path) -> None:
    # A rename is durable only once the directory that holds the names is on disk.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    for root, _, names in os.walk(path):
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m snake_strategy.checkpoint",
                                     description="Consolidate a greedysnake checkpoint directory into one file "
                                                 "that LightningModule.load_from_checkpoint reads (--format ckpt), "
                                                 "or export an HFCausalLM's weights to a HuggingFace model "
                                                 "directory, streamed one unit at a time (--format hf).")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output", help="the file to write (ckpt) or the directory to write (hf)")
    parser.add_argument("--format", choices=("ckpt", "hf"), default="ckpt")
    parser.add_argument("--config", default=None,
                        help="hf only: a HF model directory or config.json (default: the config saved with the module)")
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default=None,
                        help="hf only: dtype of the safetensors files (default: the checkpoint's master dtype)")
    parser.add_argument("--base", default=None, metavar="PATH",
                        help="a fine-tuning checkpoint's frozen base weights: the base model's HF directory, "
                             "state-dict or .ckpt file (checked against the checkpoint's CRC-32s)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines (on stderr)")
    parser.add_argument("--progress-every-s", type=float, default=5.0, metavar="SECONDS",
                        help="at most one progress line per phase every this many seconds (default 5)")
    args = parser.parse_args(argv)
    if args.format == "ckpt" and (args.config or args.dtype):
        parser.error("--config and --dtype apply to --format hf only")
    try:
        progress = Progress(log=not args.quiet, every_s=args.progress_every_s)
        if args.format == "hf":
            from snake_strategy.checkpoint_weights import export_hf_checkpoint

            dtype = getattr(torch, args.dtype) if args.dtype else None
            files = export_hf_checkpoint(args.checkpoint_dir, args.output, config=args.config, dtype=dtype,
                                         progress=progress, base=args.base)
            print(f"wrote {args.output}: config.json + {len(files)} safetensors file(s)")
            return 0
        base_note = _base_note(args.checkpoint_dir, args.base)
        checkpoint = consolidate(args.checkpoint_dir, args.output, progress, base=args.base)
    except (ValueError, OSError, ImportError) as err:
        # A user's mistake, a damaged checkpoint or a missing [hf] extra: one line that names it, as
        # argparse does for bad usage.
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {len(checkpoint['state_dict'])} tensors" + base_note)
    return 0


def _base_note(path: str, base: str | None) -> str:
    """What the CLI adds when a fine-tuning checkpoint is consolidated without its base weights."""
    if base is not None:
        return ""
    manifest = _read_manifest(locate(path), verify=lambda name: False)  # consolidate verifies the files
    frozen = sum(len(u.get("frozen", {}).get("names", [])) for u in manifest["units"])
    return (f" (the trained ones only: the {frozen} frozen block parameters are the base model's; pass --base PATH "
            "to include them)") if frozen else ""


if __name__ == "__main__":
    raise SystemExit(main())
