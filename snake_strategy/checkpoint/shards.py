"""Saving per-rank shards of a directory checkpoint (data parallelism with partitioned optimizer state);
store.load reads them back (re-sharding on another world size), consolidation merges them.

A run with partitioned optimizer state (engine/parallel/partition.py: rank ``r`` steps elements ``[lo_r, hi_r)``
of every unit) writes format ``greedysnake-checkpoint/2``: format.py's layout with ``shards/``
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
manifest LAST and puts the directory under its name with store.py's atomic replacement, so the
newest complete checkpoint is the one under the name at every instant; a last broadcast tells every rank
the outcome. A failure on any rank is raised on every rank (none is left waiting in a collective), and
the previous checkpoint is untouched. The directory must be one every rank writes and reads (on several
machines: a shared filesystem), as for any sharded checkpoint; rank 0 checks that it sees every shard.

Loading (``store.load_units``): each rank reads exactly the elements it keeps. Resuming on the same world size,
a rank reads its own shard only (and all-gathers the master weights of the others', the collective
training uses after each step); on another world size, or in one process, ``format.read_range`` reads the
overlapping parts of the shards that cover the new range (re-sharding at load). A missing, short or
corrupt shard file is refused before any step, on every rank, naming the file.
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from snake_strategy.checkpoint.format import SHARDED_FORMAT, fsync_tree, write_raw
from snake_strategy.checkpoint.store import commit, recover, sibling
from snake_strategy.planning.memory_model import shard_bounds
from snake_strategy.progress import Progress, or_quiet

if TYPE_CHECKING:
    from snake_strategy.engine.state.api import CheckpointedEngine


# ---------------------------------------------------------------------- save
def save(engine: CheckpointedEngine, checkpoint: dict[str, Any], path: str | os.PathLike,
         progress: Progress | None = None) -> None:
    """Write the checkpoint directory ``path``, each rank its own shard, rank 0 the manifest last (see the
    module docstring). Every rank calls it, in the same order (collectives)."""
    assert engine.partitioned, "per-rank shards are for partitioned optimizer state"
    rank, world = engine.shard_rank, engine.world_size
    final = Path(path)
    engine.flush()  # pending deferred updates belong to the saved state
    tmp, error = None, None
    if rank == 0:
        try:
            recover(final)
            tmp = sibling(final, "tmp")
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
        # Each rank steps, so counts, only the parameters in its shard: rank 0 records every rank's scalars.
        dist.all_gather_object(reports, {"files": files, "error": error, "rank": rank, "host": socket.gethostname(),
                                         "optimizer_scalars": engine.optimizer_scalars(),
                                         "pid": os.getpid()})
        error = next((r["error"] for r in reports if r["error"] is not None), None)
        if rank == 0 and error is None:
            try:
                engine.merge_optimizer_scalars([r["optimizer_scalars"] for r in reports])
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


def _write_shard(engine: CheckpointedEngine, tmp: Path, rank: int, progress: Progress | None) -> dict[str, dict]:
    """This rank's shard of every unit, each file fsynced; returns their sizes and CRC-32s."""
    shard_dir = tmp / "shards" / f"rank{rank}"
    # Not parents=True: where rank 0's directory is not visible (no shared filesystem) this fails here.
    shard_dir.mkdir()
    files = {}
    ranges = [engine.unit_range(u) for u in range(engine.num_units)]
    states = engine.state_names()
    tracker = or_quiet(progress).phase("checkpoint_save", len(states) * engine.num_units, what="files",
                                       total_bytes=sum(t.elem_bytes for t in engine.unit_tiers(0).values())
                                       * sum(hi - lo for lo, hi in ranges))
    for u in range(engine.num_units):
        lo, hi = ranges[u]
        if hi == lo:
            continue  # a small unit: the last ranks' shards are empty
        values = engine.local_unit_state(u)  # one unit's shard in memory at a time
        for state in states:
            name = f"shards/rank{rank}/unit{u:05d}.{state}.bin"
            files[name] = write_raw(tmp / name, values[state])
            tracker.advance(1, files[name]["bytes"])
        del values
    fsync_tree(shard_dir)
    tracker.finish()
    return files


def _commit(engine: CheckpointedEngine, checkpoint: dict[str, Any], tmp: Path, final: Path, reports: list[dict],
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
    commit(engine, checkpoint, tmp, final, files, tracker, extra={"format": SHARDED_FORMAT, "shards": shards})


def _from_rank0(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, 0)
    return box[0]


# ---------------------------------------------------------------------- load

