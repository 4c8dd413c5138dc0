"""What a copy-on-write version's first pass costs on this filesystem: O_DIRECT writes through the
package's I/O engine into a new file, into a fallocated one, into one given written-zero extents
(``FALLOC_FL_WRITE_ZEROES``, Linux 6.17+, where the filesystem has it), and over blocks already written;
for a few chunk sizes. The step after a zero-copy save writes every pinned unit into another file
(storage/versions.py): a rotation's spare is the "overwrite" case, a first save the "new file" one.

    flock /tmp/snake-bench.lock python benchmarks/new_blocks.py            # 2 GiB, in $TMPDIR's filesystem
    python benchmarks/new_blocks.py --gib 1 --dir /mnt/nvme --chunks-mib 4

Writes ``benchmarks/results/new_blocks/new_blocks.json`` (seconds per case and chunk size, median of ``--repeat``).
Not part of the test suite.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from snake_strategy.storage import IOEngine, aligned_empty
from snake_strategy.storage.aligned import padded_bytes

RESULTS = Path(__file__).resolve().parent / "results" / "new_blocks"
FALLOC_FL_WRITE_ZEROES = 0x80  # linux/falloc.h (6.17)


def _fallocate(fd: int, mode: int, size: int) -> int:
    """0, or the errno of ``fallocate(fd, mode, 0, size)``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return 0 if libc.fallocate(fd, mode, 0, size) == 0 else ctypes.get_errno()


def _timed_write(io: IOEngine, fd: int, buffer: torch.Tensor) -> float:
    start = time.perf_counter()
    io.submit_write(fd, 0, buffer).wait()
    os.fsync(fd)
    return time.perf_counter() - start


def run(directory: str, num_bytes: int, chunks_mib: list[int], repeat: int) -> dict:
    scratch = tempfile.mkdtemp(prefix="snake-new-blocks-", dir=directory)
    data = aligned_empty(num_bytes, torch.uint8)
    data.fill_(5)
    buffer = padded_bytes(data)
    out: dict = {"bytes": num_bytes, "dir": directory, "cases": {}}
    try:
        for mib in chunks_mib:
            io = IOEngine(num_threads=2, chunk_bytes=mib * 2**20)
            times: dict[str, list[float]] = {"new": [], "fallocated": [], "overwrite": [], "write_zeroes": []}
            try:
                for _ in range(repeat):
                    fd = os.open(scratch, os.O_TMPFILE | os.O_RDWR | os.O_DIRECT, 0o600)
                    times["new"].append(_timed_write(io, fd, buffer))
                    times["overwrite"].append(_timed_write(io, fd, buffer))
                    os.close(fd)
                    fd = os.open(scratch, os.O_TMPFILE | os.O_RDWR | os.O_DIRECT, 0o600)
                    os.posix_fallocate(fd, 0, num_bytes)
                    times["fallocated"].append(_timed_write(io, fd, buffer))
                    os.close(fd)
                    fd = os.open(scratch, os.O_TMPFILE | os.O_RDWR | os.O_DIRECT, 0o600)
                    start = time.perf_counter()
                    err = _fallocate(fd, FALLOC_FL_WRITE_ZEROES, num_bytes)
                    if err:
                        out["write_zeroes_error"] = errno.errorcode.get(err, str(err))
                    else:
                        times["write_zeroes"].append(time.perf_counter() - start + _timed_write(io, fd, buffer))
                    os.close(fd)
            finally:
                io.close()
            out["cases"][f"{mib}MiB"] = {k: {"median_s": statistics.median(v), "runs_s": v}
                                         for k, v in times.items() if v}
            row = ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in times.items() if v)
            print(f"{mib:>3} MiB chunks, {num_bytes / 2**30:.1f} GiB: {row}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if "write_zeroes_error" in out:
        print(f"FALLOC_FL_WRITE_ZEROES: {out['write_zeroes_error']} on this filesystem")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--chunks-mib", default="4,16,64")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    result = run(args.dir, int(args.gib * 2**30), [int(c) for c in args.chunks_mib.split(",")], args.repeat)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "new_blocks.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
