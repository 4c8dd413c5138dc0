"""Per-rank shards of a directory checkpoint (data parallelism with partitioned optimizer state), and the
reader every checkpoint's unit files go through (re-sharding at load, merging at consolidation).

A run with partitioned optimizer state (engine/partition.py: rank ``r`` steps elements ``[lo_r, hi_r)``
of every unit) writes format ``greedysnake-checkpoint/2``: checkpoint.py's layout with ``shards/``
instead of ``units/``:

    shards/rank{r}/unitNNNNN.{master,exp_avg,exp_avg_sq}.bin   elements [lo_r, hi_r) of the unit's trainable
                     master weights and Adam moments, written by rank r alone (no file where its range is empty)
    manifest.json    one process's manifest, plus ``shards``: ``world_size``, each unit's per-rank
                     ``[lo, hi)`` (``ranges``), and who wrote each shard (``writers``: rank, host, pid);
                     ``files`` lists every shard file with its size and CRC-32

Saving (every rank calls ``save``; a collective): rank 0 prepares the temporary directory and broadcasts
its name; each rank writes and fsyncs its own shard (3 P / N bytes of a P-element model, instead of
rank 0 gathering and writing 3 P); the ranks gather their files' sizes and CRC-32s to rank 0 (one small
gather: the barrier that says every shard is complete); rank 0 then writes nonlayer.pt, meta.pt and the
manifest LAST and puts the directory under its name with checkpoint.py's atomic replacement, so the
newest complete checkpoint is the one under the name at every instant; a last broadcast tells every rank
the outcome. A failure on any rank is raised on every rank (none is left waiting in a collective), and
the previous checkpoint is untouched. The directory must be one every rank writes and reads (on several
machines: a shared filesystem), as for any sharded checkpoint; rank 0 checks that it sees every shard.

Loading (``load_units``): each rank reads exactly the elements it keeps. Resuming on the same world size,
a rank reads its own shard only (and all-gathers the master weights of the others', the collective
training uses after each step); on another world size, or in one process, ``read_range`` reads the
overlapping parts of the shards that cover the new range (re-sharding at load). A missing, short or
corrupt shard file is refused before any step, on every rank, naming the file.
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from snake_strategy import checkpoint as ckpt
from snake_strategy.engine.partition import shard_bounds
from snake_strategy.progress import Progress, or_quiet

if TYPE_CHECKING:
    from snake_strategy.engine import SnakeEngine


def unit_pieces(manifest: dict, u: int) -> list[tuple[int, int, str]]:
    """``(lo, hi, file name pattern with {state})`` of the files that hold unit ``u``'s trainable state."""
    shards = manifest.get("shards")
    if shards is None:  # one process's format: one file per unit and state
        return [(0, manifest["units"][u]["numel"], f"units/unit{u:05d}.{{state}}.bin")]
    return [(lo, hi, f"shards/rank{r}/unit{u:05d}.{{state}}.bin")
            for r, (lo, hi) in enumerate(shards["ranges"][u]) if hi > lo]


def read_range(root: Path, manifest: dict, u: int, state: str, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[lo, hi)`` of unit ``u``'s ``state`` (master, exp_avg, exp_avg_sq), read from the parts of
    the files that hold them (seek + read: a rank reads its own range only, whatever the files' cut)."""
    out = torch.empty(hi - lo, dtype=dtype)
    raw = out.view(torch.uint8).numpy()
    size = dtype.itemsize
    covered = 0
    # A zero-copy checkpoint (format /3) names each state's pieces: [lo, hi, file, byte offset].
    pieces = manifest["units"][u].get("pieces", {}).get(state)
    for a, b, pattern, base in ([(a, b, name, at) for a, b, name, at in pieces] if pieces
                                else [(a, b, pattern, 0) for a, b, pattern in unit_pieces(manifest, u)]):
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


# ---------------------------------------------------------------------- save
def save(engine: SnakeEngine, checkpoint: dict[str, Any], path: str | os.PathLike,
         progress: Progress | None = None) -> None:
    """Write the checkpoint directory ``path``, each rank its own shard, rank 0 the manifest last (see the
    module docstring). Every rank calls it, in the same order (collectives)."""
    partition = engine.partition
    assert partition is not None, "per-rank shards are for partitioned optimizer state"
    rank, world = partition.rank, partition.world_size
    final = Path(path)
    engine.flush()  # pending deferred updates belong to the saved state
    tmp, error = None, None
    if rank == 0:
        try:
            ckpt._recover(final, clean=True)
            tmp = ckpt._sibling(final, "tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "shards").mkdir(parents=True)
        except OSError as err:
            error = f"rank 0 could not create the checkpoint directory next to {final}: {err}"
    tmp, error = _from_rank0((None if tmp is None else str(tmp), error))  # sync point: one small broadcast
    if error is not None:
        raise OSError(error)
    tmp = Path(tmp)
    try:
        files, error = {}, None
        try:
            files = _write_shard(engine, tmp, rank, progress)
        except Exception as err:  # reported to every rank below: no rank waits for a shard that never comes
            error = f"rank {rank} could not write its checkpoint shard in {tmp}: {err}"
        # Sync point: every shard is complete (or failed) before anything names them.
        reports: list[Any] = [None] * world
        dist.all_gather_object(reports, {"files": files, "error": error, "rank": rank, "host": socket.gethostname(),
                                         "pid": os.getpid()})
        error = next((r["error"] for r in reports if r["error"] is not None), None)
        if rank == 0 and error is None:
            try:
                _commit(engine, checkpoint, tmp, final, reports, world)
            except Exception as err:
                error = f"rank 0 could not complete the checkpoint {final}: {err}"
        error = _from_rank0(error)  # sync point: the outcome, so every rank returns (or raises) together
        if error is not None:
            raise OSError(error)
    except BaseException:
        if rank == 0:  # the unfinished new checkpoint (or, after an exchange, the old one): garbage
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_shard(engine: SnakeEngine, tmp: Path, rank: int, progress: Progress | None) -> dict[str, dict]:
    """This rank's shard of every unit, each file fsynced; returns their sizes and CRC-32s."""
    shard_dir = tmp / "shards" / f"rank{rank}"
    # Not parents=True: where rank 0's directory is not visible (no shared filesystem) this fails here.
    shard_dir.mkdir()
    partition, files = engine.partition, {}
    ranges = [partition.bounds(engine.unit_numel(u)) for u in range(engine.num_units)]
    tracker = or_quiet(progress).phase("checkpoint_save", len(ckpt.STATES) * engine.num_units, what="files",
                                       total_bytes=len(ckpt.STATES) * engine.dtypes.bytes_per("master")
                                       * sum(hi - lo for lo, hi in ranges))
    for u in range(engine.num_units):
        lo, hi = ranges[u]
        if hi == lo:
            continue  # a small unit: the last ranks' shards are empty
        values = partition.local_state(engine.units[u])  # one unit's shard in memory at a time
        for state in ckpt.STATES:
            name = f"shards/rank{rank}/unit{u:05d}.{state}.bin"
            files[name] = ckpt._write_raw(tmp / name, values[state])
            tracker.advance(1, files[name]["bytes"])
        del values
    ckpt._fsync_dir(shard_dir)
    tracker.finish()
    return files


def _commit(engine: SnakeEngine, checkpoint: dict[str, Any], tmp: Path, final: Path, reports: list[dict],
            world: int) -> None:
    """Rank 0, once every shard is complete: check that it sees them all, then the manifest last."""
    files = {}
    for report in reports:
        for name, info in report["files"].items():
            path = tmp / name
            if not path.exists() or path.stat().st_size != info["bytes"]:
                raise ValueError(f"rank {report['rank']} wrote {name} (host {report['host']}) but rank 0 does not see "
                                 "it whole: the checkpoint directory must be on a filesystem every rank shares")
            files[name] = info
    ranges = [[list(shard_bounds(engine.unit_numel(u), world, r)) for r in range(world)]
              for u in range(engine.num_units)]
    shards = {"world_size": world, "ranges": ranges,
              "writers": [{k: r[k] for k in ("rank", "host", "pid")} for r in reports]}
    tracker = or_quiet(None).phase("checkpoint_save", 2, what="files")
    ckpt.commit(engine, checkpoint, tmp, final, files, tracker, extra={"format": ckpt.SHARDED_FORMAT, "shards": shards})


def _from_rank0(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, 0)
    return box[0]


# ---------------------------------------------------------------------- load
def load_units(engine: SnakeEngine, root: Path, manifest: dict, progress: Progress | None = None) -> None:
    """Put the checkpoint's unit states (either format) into the engine's tiers: each rank reads the elements
    it keeps (its shard with partitioned state, else every unit whole), after verifying the files it reads.
    With several ranks the verification's outcome is agreed on first (one small gather), so a missing
    shard stops every rank with the same error before any collective."""
    dtype = ckpt._DTYPES[manifest["master_dtype"]]
    partition = engine.partition
    ranges = []
    for u in range(engine.num_units):
        numel = engine.unit_numel(u)
        if manifest["units"][u]["numel"] != numel:
            raise ValueError(f"{root}: unit {u} has {manifest['units'][u]['numel']} parameters, the model {numel}")
        ranges.append(partition.bounds(numel) if partition is not None else (0, numel))
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
    tracker = or_quiet(progress).phase("checkpoint_load", engine.num_units, total_bytes=len(ckpt.STATES)
                                       * dtype.itemsize * sum(hi - lo for lo, hi in ranges))
    for u, (lo, hi) in enumerate(ranges):
        state = {name: read_range(root, manifest, u, name, lo, hi, dtype) for name in ckpt.STATES}
        if partition is not None:
            partition.load_local(engine.units[u], state)  # + the all-gather of the weights (a collective)
        else:
            engine.load_unit_state(u, state)
        tracker.advance(1, len(ckpt.STATES) * (hi - lo) * dtype.itemsize)
    tracker.finish()


def _verify_shards(root: Path, manifest: dict, ranges: list[tuple[int, int]]) -> None:
    """Every shard file must exist with its recorded size (a stat each: a checkpoint with a shard missing is
    incomplete, whoever reads it); the ones this rank reads are CRC-checked too."""
    shards = manifest.get("shards")
    if shards is None:
        return  # one process's format: checkpoint.load verified its files
    files = manifest["files"]
    listed = {name for name in files if name.startswith("shards/")}
    for u in range(len(manifest["units"])):
        for _, _, pattern in unit_pieces(manifest, u):
            missing = [pattern.format(state=s) for s in ckpt.STATES if pattern.format(state=s) not in listed]
            if missing:
                raise ValueError(f"{root / 'manifest.json'} does not list the shard file {missing[0]}: the manifest is "
                                 "corrupt; use another checkpoint")
    needed = {pattern.format(state=s) for u, (lo, hi) in enumerate(ranges)
              for a, b, pattern in unit_pieces(manifest, u) if max(a, lo) < min(b, hi) for s in ckpt.STATES}
    hint = (f": {root} was saved by {shards['world_size']} ranks, each writing its own shard under shards/rank<r>/, "
            "and resuming needs all of them. Copy or move the whole checkpoint directory (a run on several machines "
            "must save its checkpoints to a filesystem every rank shares), or resume from another checkpoint")
    for name in sorted(listed):
        path = root / name
        try:
            if not path.exists():
                raise ValueError(f"checkpoint shard file {path} is missing")
            if name in needed:
                ckpt._verify(path, files[name])  # size and CRC-32
            elif path.stat().st_size != files[name]["bytes"]:  # another rank's: the size only (no read)
                size, want = path.stat().st_size, files[name]["bytes"]
                raise ValueError(f"checkpoint file {path} is {'shorter' if size < want else 'longer'} than the "
                                 f"manifest says ({size}, not {want} bytes): truncated or overwritten")
        except ValueError as err:
            raise ValueError(f"{err}{hint}") from None
