"""The on-disk format of a checkpoint directory, at the bottom of the checkpoint package: constants, raw tensor
files, the verified manifest, and the reader every unit file goes through.

Layout of ``<name>.ckpt/`` (a directory):

    meta.pt          Lightning's checkpoint dict (loops, callbacks, LR schedulers, hparams); its
                     ``state_dict`` holds the non-layer entries only, less those nonlayer.pt reproduces
                     (``without_nonlayer_copies``; ``read_meta`` puts them back)
    nonlayer.pt      the non-layer parameters' names, shapes, the loss scaler and the step counter;
    nonlayer.{master,exp_avg,exp_avg_sq}.bin   their master weights and Adam moments, raw, concatenated
                     in name order (``write_nonlayer`` / ``read_nonlayer``; a checkpoint without these files
                     holds them inside nonlayer.pt, which ``read_nonlayer`` reads too)
    units/unitNNNNN.{master,exp_avg,exp_avg_sq}.bin   raw little-endian tensors, one unit per file
                     (data parallel with partitioned optimizer state: shards/rank{r}/..., see shards.py)
    manifest.json    written last: format, step, layouts (names, shapes, offsets), sizes and CRC-32s

A zero-copy save (format /3, pins.py) links the SSD-tier part of each unit state as ``<state>.bin`` and
writes the rest as ``<state>.head.bin``; the unit's manifest entry then names the ``pieces``
(``[lo, hi, file, byte offset]``) per state, and ``read_range`` follows them.

Frozen parameters (``requires_grad=False``: a fine-tuning run's base weights) are not copied: the unit
files hold the trainable part only, and the manifest records each unit's frozen parameter names and
the CRC-32 of their stored bytes (``frozen``), and those of the frozen non-layer parameters
(``frozen_nonlayer``). Every file's size and CRC-32 is verified before use, naming the file that fails.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from snake_strategy.checkpoint.pins import CHECKSUMS, ZERO_COPY_FORMAT
from snake_strategy.progress import Progress, or_quiet
from snake_strategy.storage.file_writer import write_tensors

FORMAT = "greedysnake-checkpoint/1"
SHARDED_FORMAT = "greedysnake-checkpoint/2"  # per-rank shards instead of units/ (shards.py)
STATES = ("master", "exp_avg", "exp_avg_sq")
DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.uint8, torch.int8,
                                torch.int32, torch.int64)}


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """True for a greedysnake checkpoint directory (complete or not), which plain Lightning cannot read."""
    root = Path(path)
    return root.is_dir() and ((root / "manifest.json").exists() or (root / "meta.pt").exists()
                              or (root / "units").is_dir() or (root / "shards").is_dir())


def verified_manifest(root: Path, progress: Progress | None = None,
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
        verify_file(root / name, info)
        tracker.advance(1, info["bytes"])
    tracker.finish()
    return manifest


def write_raw(path: Path, value: torch.Tensor) -> dict:
    """One tensor's raw bytes into a new file, fsynced (O_DIRECT where it can: storage/file_writer.py)."""
    return _write_concatenated(path, [value])


class _Checksummed:
    """A file object that CRC-32s and counts what ``torch.save`` writes through it: no read-back (the
    non-layer state of a large vocabulary is GBs; reading it back cost as much as writing it)."""

    def __init__(self, f) -> None:
        self.f, self.crc32, self.bytes = f, 0, 0

    def write(self, data) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.bytes += len(memoryview(data).cast("B"))
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_torch(obj, path: Path) -> dict:
    """``torch.save(obj, path)``, fsynced (durable before a commit rename names it); its size and CRC-32."""
    with open(path, "wb") as f:
        out = _Checksummed(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": out.bytes, "crc32": out.crc32}


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_file(path: Path, info: dict) -> None:
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
        return  # a pinned file whose checksum the saving run did not complete (pins.Checksums)
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            crc = zlib.crc32(chunk, crc)
    if crc != info["crc32"]:
        raise ValueError(f"checkpoint file {path} is corrupt (CRC-32 {crc:#010x}, manifest {info['crc32']:#010x})")


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        with CHECKSUMS.remove_lock:  # not while the checksum thread rewrites a manifest in it
            shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def fsync_parent(path: Path) -> None:
    # A rename is durable only once the directory that holds the names is on disk.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for root, _, names in os.walk(path):
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def unit_pieces(manifest: dict, u: int) -> list[tuple[int, int, str]]:
    """``(lo, hi, file name pattern with {state})`` of the files that hold unit ``u``'s trainable state."""
    shards = manifest.get("shards")
    if shards is None:  # one process's format: one file per unit and state
        return [(0, manifest["units"][u]["numel"], f"units/unit{u:05d}.{{state}}.bin")]
    return [(lo, hi, f"shards/rank{r}/unit{u:05d}.{{state}}.bin")
            for r, (lo, hi) in enumerate(shards["ranges"][u]) if hi > lo]


def read_range(root: Path, manifest: dict, u: int, state: str, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[lo, hi)`` of unit ``u``'s ``state`` (the master weights or an optimizer slot), read from the
    parts of the files that hold them (seek + read: a rank reads its own range only, whatever the files' cut).
    A slot kept per tensor has its own length (``state_numel``) and one file."""
    out = torch.empty(hi - lo, dtype=dtype)
    raw = out.view(torch.uint8).numpy()
    size = dtype.itemsize
    covered = 0
    # A zero-copy checkpoint (format /3) names each state's pieces: [lo, hi, file, byte offset].
    pieces = manifest["units"][u].get("pieces", {}).get(state)
    own = manifest["units"][u].get("state_numel", {}).get(state)
    files = [(0, own, f"units/unit{u:05d}.{{state}}.bin")] if own is not None else unit_pieces(manifest, u)
    for a, b, pattern, base in ([(a, b, name, at) for a, b, name, at in pieces] if pieces
                                else [(a, b, pattern, 0) for a, b, pattern in files]):
        start, end = max(a, lo), min(b, hi)
        if start >= end:
            continue
        path = root / pattern.format(state=state)
        with open(path, "rb") as f:
            f.seek(base + (start - a) * size)
            got = f.readinto(memoryview(raw[(start - lo) * size:(end - lo) * size]))
        if got != (end - start) * size:
            raise ValueError(f"checkpoint file {path} is shorter than the manifest says: truncated after it was "
                             "written; use another checkpoint")
        covered += end - start
    if covered != hi - lo:
        raise ValueError(f"{root}: the files of unit {u} do not cover elements [{lo}, {hi}) (the manifest's shard "
                         "ranges are inconsistent): the checkpoint is corrupt; use another one")
    return out


# ---------------------------------------------------------------------- meta.pt and nonlayer.pt
def without_nonlayer_copies(checkpoint: dict, nonlayer: dict) -> tuple[dict, dict]:
    """Lightning's ``state_dict`` repeats the trainable non-layer parameters (embedding, head, final norm)
    whose master values nonlayer.pt holds. Returns the checkpoint without each entry that its master value,
    cast to the entry's dtype, reproduces bitwise (checked here: a cost of one comparison of the non-layer
    weights in memory), and the manifest's record for ``read_meta``: the entries' dtypes, the tied entries
    that alias them, and the order of every key. gpt_1b: 0.41 of the 1.65 GB a save writes."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        return checkpoint, {}
    masters = dict(zip(nonlayer.get("names", []), nonlayer.get("master", [])))
    shared = {}
    for name, value in state.items():
        master = masters.get(name)
        if (isinstance(value, torch.Tensor) and isinstance(master, torch.Tensor) and master.shape == value.shape
                and torch.equal(master.to(value.device, value.dtype), value)):
            shared[name] = str(value.dtype)
    if not shared:
        return checkpoint, {}
    # A tied weight (a head sharing the embedding's tensor) is an alias of a left-out entry: torch.save
    # would still write the shared storage for it.
    views = {_view_key(state[name]): name for name in shared}
    aliases = {name: views[_view_key(value)] for name, value in state.items()
               if name not in shared and isinstance(value, torch.Tensor) and _view_key(value) in views}
    kept = {name: value for name, value in state.items() if name not in shared and name not in aliases}
    return {**checkpoint, "state_dict": kept}, {"state_dict_from_nonlayer": shared, "state_dict_aliases": aliases,
                                                "state_dict_keys": list(state)}


def _view_key(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())


def read_meta(root: Path, manifest: dict) -> dict:
    """Lightning's checkpoint dict of the checkpoint at ``root``, its ``state_dict`` whole again: the
    entries ``without_nonlayer_copies`` left out are the master values from nonlayer.pt, cast back."""
    checkpoint = torch.load(root / "meta.pt", map_location="cpu", weights_only=False)
    shared = manifest.get("state_dict_from_nonlayer")
    if shared:
        nonlayer = read_nonlayer(root, manifest, ("master",))
        masters = dict(zip(nonlayer["names"], nonlayer["master"]))
        state = checkpoint["state_dict"]
        for name, dtype in shared.items():
            state[name] = masters[name].to(DTYPES[dtype], copy=True)  # a copy: not a view of the mapped file
        for name, target in manifest.get("state_dict_aliases", {}).items():
            state[name] = state[target]  # tied again, as the module's state_dict had them
        checkpoint["state_dict"] = {name: state[name] for name in manifest["state_dict_keys"]}
    return checkpoint


# ---------------------------------------------------------------------- the non-layer state


def write_nonlayer(state: dict, root: Path) -> tuple[dict[str, dict], dict]:
    """Write the non-layer state (``engine.nonlayer_state()``): each of its three vectors as one raw file,
    the three written at once by three threads (file writes and CRC-32s release the GIL: the disk's rate,
    not one core's; gpt_1b's 1.24 GB took 3.5 s through one ``torch.save``), the rest in nonlayer.pt.
    Returns the files for the manifest and its ``nonlayer`` record (names, shapes, dtype)."""
    # Adam's moments are vectors like the master weights; another optimizer's state is in nonlayer.pt.
    vectors = [name for name in STATES if name in state]
    tensors = {name: [t.detach().reshape(-1) for t in state[name]] for name in vectors}
    dtypes = {t.dtype for values in tensors.values() for t in values}
    assert len(dtypes) <= 1, f"one master dtype for the non-layer state, not {dtypes}"
    record = {"names": list(state["names"]), "shapes": [list(t.shape) for t in state["master"]],
              "dtype": str(dtypes.pop()) if dtypes else "torch.float32", "vectors": vectors}
    names = [f"nonlayer.{name}.bin" for name in vectors]
    with ThreadPoolExecutor(len(names), thread_name_prefix="snake-nonlayer") as pool:  # re-raises a failure
        written = list(pool.map(lambda name, values: _write_concatenated(root / name, values), names,
                                [tensors[name] for name in vectors]))
    files = dict(zip(names, written))
    rest = {k: v for k, v in state.items() if k not in vectors}
    files["nonlayer.pt"] = save_torch(rest, root / "nonlayer.pt")
    return files, record


def _write_concatenated(path: Path, values: list[torch.Tensor]) -> dict:
    written = write_tensors(path, values)
    return {"bytes": written.bytes, "crc32": written.crc32}


def read_nonlayer(root: Path, manifest: dict, states: tuple[str, ...] = STATES) -> dict:
    """The non-layer state as ``engine.nonlayer_state()`` gave it (only ``states`` of the three vectors),
    the tensors mapped from the files (``mmap``: nothing read until used)."""
    record = manifest.get("nonlayer")
    if record is None:  # before format /3.1: everything inside nonlayer.pt
        state = torch.load(root / "nonlayer.pt", map_location="cpu", mmap=True, weights_only=True)
        return {k: v for k, v in state.items() if k not in STATES or k in states}
    state = torch.load(root / "nonlayer.pt", map_location="cpu", weights_only=True)
    dtype = DTYPES[record["dtype"]]
    sizes = [math.prod(shape) for shape in record["shapes"]]
    for name in (name for name in states if name in record.get("vectors", STATES)):
        flat = torch.from_file(str(root / f"nonlayer.{name}.bin"), shared=False, size=sum(sizes), dtype=dtype)
        state[name] = [part.view(shape) for part, shape in zip(flat.split(sizes), record["shapes"])]
    state["names"] = list(record["names"])
    return state
