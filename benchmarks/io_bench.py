"""SSD bandwidth: the pure-Python IOEngine against ``dd`` with O_DIRECT, on the same file size.

    python benchmarks/io_bench.py                      # 1 GiB in a temp dir under /tmp, removed after
    python benchmarks/io_bench.py --size-mib 256 --dir /mnt/nvme/scratch --threads 2,4 --chunks-mib 4

Every transfer bypasses the page cache: ``dd`` runs with ``oflag=direct`` / ``iflag=direct``, and the
IOEngine opens its file with O_DIRECT and moves page-aligned buffers. Each write goes to a freshly
created file (so both tools pay the same block allocation) and ends with an fsync, which is timed
(``dd conv=fsync``; ``os.fsync`` for the engine). Each read reads back the file just written.

The payload is random bytes, the same for both tools: a virtual disk may short-cut all-zero writes
(``detect-zeroes``), so ``dd if=/dev/zero`` can flatter the disk. dd therefore copies from a random
source file in /dev/shm (a RAM copy costs it far less than the disk write); a ``dd /dev/zero`` row is
kept for reference.

O_DIRECT skips this machine's page cache only: on a virtual disk the host may still cache, so single
runs scatter (use ``--repeats``; every run is kept in the JSON). GB/s means 10**9 bytes per second. Results go to ``benchmarks/results/io_bench/io_bench.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from snake_strategy.storage.aligned import PAGE_BYTES, aligned_empty
from snake_strategy.storage.io_engine import IOEngine
from snake_strategy.storage.ssd_directory import SsdDirectory

MIB = 2**20
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "io_bench" / "io_bench.json"


# ---------------------------------------------------------------------------------------- dd
def _run_dd(args: list[str]) -> float:
    """Run dd and return its wall time in seconds (process start is ~ms, well under the transfer)."""
    start = time.perf_counter()
    done = subprocess.run(["dd", *args], capture_output=True, text=True)
    elapsed_s = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"dd {' '.join(args)} failed: {done.stderr.strip()}")
    return elapsed_s


def bench_dd(path: str, size_bytes: int, block_mib: int, source: str) -> dict:
    """Write ``size_bytes`` from ``source`` with oflag=direct, then read it back with iflag=direct."""
    count = size_bytes // (block_mib * MIB)
    if os.path.exists(path):
        os.remove(path)
    write_s = _run_dd([f"if={source}", f"of={path}", f"bs={block_mib}M", f"count={count}",
                       "oflag=direct", "conv=fsync", "status=none"])
    read_s = _run_dd([f"if={path}", "of=/dev/null", f"bs={block_mib}M", f"count={count}",
                      "iflag=direct", "status=none"])
    os.remove(path)
    moved = count * block_mib * MIB
    return {"write_s": write_s, "read_s": read_s, "bytes": moved}


# ---------------------------------------------------------------------------------------- IOEngine
def bench_engine(bench_dir: str, name: str, payload: torch.Tensor, landing: torch.Tensor,
                 num_threads: int, chunk_bytes: int) -> dict:
    """One whole-buffer write (split into ``chunk_bytes`` requests over ``num_threads`` threads) into a
    fresh file, fsync, then one whole-buffer read back into ``landing``; checks the bytes survived."""
    engine = IOEngine(num_threads=num_threads, chunk_bytes=chunk_bytes)
    try:
        path = os.path.join(bench_dir, name)
        if os.path.exists(path):
            os.remove(path)
        # A fresh, empty file: the write allocates its blocks, as dd's does.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        start = time.perf_counter()
        engine.submit_write(fd, 0, payload).wait()
        os.fsync(fd)
        write_s = time.perf_counter() - start

        landing.zero_()  # so a read that silently did nothing cannot pass the check below
        start = time.perf_counter()
        engine.submit_read(fd, 0, landing).wait()
        read_s = time.perf_counter() - start
        os.close(fd)
        os.remove(path)
    finally:
        engine.close()
    # Spot-check rather than compare all bytes: a full torch.equal costs ~0.3 s per GiB on 2 cores.
    step = max(1, payload.numel() // 4096)
    if not torch.equal(payload[::step], landing[::step]):
        raise RuntimeError(f"IOEngine read back different bytes (threads={num_threads}, chunk={chunk_bytes})")
    return {"write_s": write_s, "read_s": read_s, "bytes": payload.numel()}


# ---------------------------------------------------------------------------------------- driver
def _median_row(tool: str, runs: list[dict], **labels) -> dict:
    moved = runs[0]["bytes"]
    write_s = statistics.median(r["write_s"] for r in runs)
    read_s = statistics.median(r["read_s"] for r in runs)
    return {
        "tool": tool, **labels, "bytes": moved, "repeats": len(runs),
        "write_s": write_s, "read_s": read_s,
        "write_gb_per_s": moved / write_s / 1e9, "read_gb_per_s": moved / read_s / 1e9,
        # Every run, so the spread shows: a virtual disk's host cache makes single runs noisy.
        "write_gb_per_s_runs": [moved / r["write_s"] / 1e9 for r in runs],
        "read_gb_per_s_runs": [moved / r["read_s"] / 1e9 for r in runs],
    }


def _filesystem_of(path: str) -> str:
    """The mount entry holding ``path`` (device, fs type, options), for the record."""
    best = ("", "?")
    real = os.path.realpath(path)
    with open("/proc/mounts") as mounts:
        for line in mounts:
            device, mount_point, fs_type, options = line.split()[:4]
            if (real == mount_point or real.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) > len(best[0]):
                best = (mount_point, f"{device} {fs_type} {options}")
    return best[1]


def run(size_mib: int, directory: str | None, threads: list[int], chunks_mib: list[int],
        dd_block_mib: int, repeats: int) -> dict:
    if size_mib <= 0 or any(c <= 0 for c in chunks_mib) or any(t <= 0 for t in threads):
        raise ValueError("--size-mib, --threads and --chunks-mib take positive integers")
    if size_mib % dd_block_mib:
        raise ValueError(f"--size-mib={size_mib} must be a multiple of dd's block size {dd_block_mib} MiB")
    if shutil.which("dd") is None:
        raise RuntimeError("dd is not on PATH")
    size_bytes = size_mib * MIB

    # Always a fresh sub-directory of our own (under --dir, or /tmp), removed whole at the end.
    parent = "/tmp" if directory is None else os.path.abspath(directory)
    os.makedirs(parent, exist_ok=True)
    bench_dir = tempfile.mkdtemp(prefix="io-bench-", dir=parent)
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(prefix="io-bench-src-", dir=shm_dir, delete=False) as handle:
        dd_source = handle.name

    rows: list[dict] = []
    try:
        ssd = SsdDirectory(bench_dir)  # checks the directory is writable and probes O_DIRECT
        if not ssd.o_direct:
            raise RuntimeError(f"{bench_dir} refuses O_DIRECT: this benchmark would measure the page cache")
        ssd.check_free_space(size_bytes * 2, "benchmark files")

        # One random payload for every run (seeded, so two runs of the benchmark write the same bytes).
        generator = torch.Generator().manual_seed(0)
        payload = aligned_empty(size_bytes, torch.uint8)
        payload.copy_(torch.randint(0, 256, (size_bytes,), dtype=torch.uint8, generator=generator))
        landing = aligned_empty(size_bytes, torch.uint8)
        payload.numpy().tofile(dd_source)

        dd_file = os.path.join(bench_dir, "io_bench_dd.bin")
        runs = [bench_dd(dd_file, size_bytes, dd_block_mib, dd_source) for _ in range(repeats)]
        rows.append(_median_row("dd", runs, threads=1, chunk_mib=dd_block_mib, source="random"))
        _print_row(rows[-1])
        runs = [bench_dd(dd_file, size_bytes, dd_block_mib, "/dev/zero") for _ in range(repeats)]
        rows.append(_median_row("dd", runs, threads=1, chunk_mib=dd_block_mib, source="zeros"))
        _print_row(rows[-1])

        for num_threads in threads:
            for chunk_mib in chunks_mib:
                name = f"io_bench_engine_t{num_threads}_c{chunk_mib}.bin"
                runs = []
                for _ in range(repeats):
                    runs.append(bench_engine(bench_dir, name, payload, landing, num_threads, chunk_mib * MIB))
                rows.append(_median_row("IOEngine", runs, threads=num_threads, chunk_mib=chunk_mib, source="random"))
                _print_row(rows[-1])
    finally:
        os.remove(dd_source)
        shutil.rmtree(bench_dir, ignore_errors=True)

    dd_row = rows[0]
    engine_rows = [r for r in rows if r["tool"] == "IOEngine"]
    best_write = max(engine_rows, key=lambda r: r["write_gb_per_s"])
    best_read = max(engine_rows, key=lambda r: r["read_gb_per_s"])
    return {
        "benchmark": "io_bench",
        "size_bytes": size_bytes,
        "dir": parent,
        "filesystem": _filesystem_of(bench_dir),
        "o_direct": True,
        "page_bytes": PAGE_BYTES,
        "repeats": repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "torch": torch.__version__},
        "rows": rows,
        "summary": {
            "dd_write_gb_per_s": dd_row["write_gb_per_s"],
            "dd_read_gb_per_s": dd_row["read_gb_per_s"],
            "best_engine_write": {k: best_write[k] for k in ("threads", "chunk_mib", "write_gb_per_s")},
            "best_engine_read": {k: best_read[k] for k in ("threads", "chunk_mib", "read_gb_per_s")},
            "engine_over_dd_write": best_write["write_gb_per_s"] / dd_row["write_gb_per_s"],
            "engine_over_dd_read": best_read["read_gb_per_s"] / dd_row["read_gb_per_s"],
        },
    }


HEADER = f"{'tool':<9} {'source':<7} {'threads':>7} {'chunk MiB':>9} {'write GB/s':>10} {'read GB/s':>9}"


def _print_row(row: dict) -> None:
    print(f"{row['tool']:<9} {row['source']:<7} {row['threads']:>7} {row['chunk_mib']:>9} "
          f"{row['write_gb_per_s']:>10.2f} {row['read_gb_per_s']:>9.2f}", flush=True)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes per transfer, in MiB (default 1024)")
    parser.add_argument("--dir", default=None,
                        help="directory on the disk to test (default: a temp dir under /tmp, removed after)")
    parser.add_argument("--threads", type=_int_list, default=[1, 2, 4, 8], help="IOEngine thread counts, e.g. 1,2,4,8")
    parser.add_argument("--chunks-mib", type=_int_list, default=[1, 4, 16], help="IOEngine chunk sizes in MiB")
    parser.add_argument("--dd-block-mib", type=int, default=4, help="dd bs= in MiB (default 4)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting; the median is reported")
    parser.add_argument("--json-out", default=str(DEFAULT_RESULTS), help="where to write the results")
    args = parser.parse_args(argv)

    print(f"{args.size_mib} MiB per transfer, O_DIRECT, fsync after writes, GB = 1e9 bytes")
    print(HEADER)
    result = run(args.size_mib, args.dir, args.threads, args.chunks_mib, args.dd_block_mib, args.repeats)
    summary = result["summary"]
    print(f"best IOEngine write {summary['best_engine_write']['write_gb_per_s']:.2f} GB/s "
          f"({summary['engine_over_dd_write']:.2f}x dd), read {summary['best_engine_read']['read_gb_per_s']:.2f} GB/s "
          f"({summary['engine_over_dd_read']:.2f}x dd)")
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
