"""DeepSpeed ZeRO-Infinity with 1 and 2 data-parallel ranks on the r1 preset, next to
``distributed.py``'s greedysnake runs: the same global batch of 16 sequences (1 rank x 8 micro-batches
or 2 ranks x 4, micro-batch 2, the same ``ByteWindows`` slices through a ``DistributedSampler``).

    OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=... python benchmarks/zero_infinity_ranks.py --ranks 1,2 \\
        --steps 3 --nvme-dir /tmp/zi-ranks

Each world size is one ``torch.distributed.run`` (torchrun) launch: gloo on 127.0.0.1, one intra-op
thread per rank, each rank its own NVMe directory ``<nvme-dir>/rank<r>``, ZeRO-3 with parameters and
optimizer state on NVMe (``zero_infinity.py``'s tuned settings). Per rank and step (means over the steps
after the first, as ``zero_infinity.py``): SSD bytes read / written (/proc/self/io of the rank's process),
bytes sent by collectives (every torch.distributed collective DeepSpeed calls, counted by a wrapper
under the ring model of ``engine/parallel/reduce.py``), the swap files on the rank's NVMe directory, the step
time (median). Rank 0 gathers the ranks' results (``all_gather_object``) and the driver writes one JSON
and a plot. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import zero_infinity as zi  # noqa: E402
from common import plot_ranks, results_dir  # noqa: E402

RESULTS = results_dir("zero_infinity_ranks")
# r1 as compare.py / distributed.py run it: global batch = 2 x the preset's 4 micro-batches of 2.
PRESET = dict(model="r1", context_len=128, micro_batch_size=2, global_micro=8)


class CollectiveBytes:
    """Wraps torch.distributed's collectives (before DeepSpeed binds them) and counts, per kind, the
    calls, the payload and the bytes this rank sends under the ring model: all-reduce 2(N-1)/N of the
    payload, all-gather and reduce-scatter (N-1)/N of the full (gathered / unreduced) tensor, broadcast
    the payload on the source rank. The model, not a wire measurement: gloo may pick other algorithms."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        def full_out(args, kwargs):  # all-gather: the gathered tensor
            return args[0] if args else kwargs.get("output_tensor")

        def full_in(args, kwargs):  # reduce-scatter: the unreduced input
            return args[1] if len(args) > 1 else kwargs.get("input")

        def first(args, kwargs):
            return args[0] if args else kwargs.get("tensor")

        def list_bytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        specs = {
            "all_reduce": (first, 2),
            "all_gather_into_tensor": (full_out, 1),
            "_all_gather_base": (full_out, 1),
            "reduce_scatter_tensor": (full_in, 1),
            "_reduce_scatter_base": (full_in, 1),
            "all_to_all_single": (lambda a, k: a[1] if len(a) > 1 else k.get("input"), 1),
            "broadcast": (first, None),
        }
        for name, (pick, factor) in specs.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original, pick, factor)
            setattr(dist, name, wrapped)
            if getattr(c10d, name, None) is original:
                setattr(c10d, name, wrapped)
        # List forms: all_gather(tensor_list, tensor), all_reduce_coalesced(tensors).
        self._wrap_list(dist, c10d, "all_gather", lambda a, k: list_bytes(a[0] if a else k["tensor_list"]), 1)
        self._wrap_list(dist, c10d, "all_reduce_coalesced", lambda a, k: list_bytes(a[0] if a else k["tensors"]), 2)

    def _wrap(self, name, original, pick, factor):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            tensor = pick(args, kwargs)
            payload = tensor.numel() * tensor.element_size()
            self._add(name, payload, factor, kwargs.get("group"),
                      src=(args[1] if len(args) > 1 else kwargs.get("src")) if factor is None else None)
            return original(*args, **kwargs)

        return counted

    def _wrap_list(self, dist, c10d, name, payload_of, factor):
        original = getattr(dist, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def counted(*args, **kwargs):
            self._add(name, payload_of(args, kwargs), factor, kwargs.get("group"))
            return original(*args, **kwargs)

        setattr(dist, name, counted)
        if getattr(c10d, name, None) is original:
            setattr(c10d, name, counted)

    def _add(self, name, payload, factor, group, src=None) -> None:
        import torch.distributed as dist

        world = dist.get_world_size(group)
        if factor is None:  # broadcast: the source sends the payload, the others receive
            sent = payload * (world - 1) if dist.get_rank() == src else 0
        else:
            sent = factor * (world - 1) * payload // world
        for key, value in ((f"{name}/calls", 1), (f"{name}/payload", payload), (f"{name}/sent", sent),
                           ("sent", sent)):
            self.totals[key] = self.totals.get(key, 0) + value

    def snapshot(self) -> dict[str, int]:
        return dict(self.totals)


class RankData:
    """This rank's slice of the global batch: ``distributed.py``'s data (``ByteWindows`` in order,
    a ``DistributedSampler`` without shuffling), ``per_rank`` windows per step."""

    def __init__(self, context_len: int, per_rank: int, steps: int, rank: int, world: int) -> None:
        from torch.utils.data import DataLoader, DistributedSampler, Subset

        from snake_strategy.data import ByteWindows, load_corpus

        data = Subset(ByteWindows(load_corpus("stdlib"), context_len), range(per_rank * world * steps))
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
        self._loader = DataLoader(data, batch_size=per_rank, sampler=sampler)

    def train_dataloader(self):
        return self._loader


def run_worker(args) -> None:
    import torch.distributed as dist

    from snake_strategy.gpt import preset

    deepspeed = zi._import_deepspeed()
    counter = CollectiveBytes()
    counter.install()  # before init: DeepSpeed's backend binds all_gather_into_tensor at construction
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # RANK, WORLD_SIZE, MASTER_*: torchrun's
    rank, world = dist.get_rank(), dist.get_world_size()
    shm = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{rank}"
    if PRESET["global_micro"] % world:
        raise ValueError(f"--ranks: {world} does not divide the {PRESET['global_micro']} micro-batches per step")
    num_micro = PRESET["global_micro"] // world
    config = preset(PRESET["model"])
    config.context_len = PRESET["context_len"]
    data = RankData(config.context_len, PRESET["micro_batch_size"] * num_micro, args.steps, rank, world)
    try:
        result = zi.run_zero_infinity(config, PRESET["micro_batch_size"], num_micro, args.steps,
                                      os.path.join(args.nvme_dir, f"rank{rank}"), data=data, counters=counter.snapshot)
        sent = [c.get("sent", 0) for c in result["counters_per_step"]]
        result.update(rank=rank, omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                      collective_sent_bytes_per_step=statistics.mean(sent[1:]),
                      collective_sent_bytes_setup=counter.totals.get("sent", 0) - sum(sent))
        gathered = [None] * world
        dist.all_gather_object(gathered, result)  # after the counters were read
        if rank == 0:
            Path(args.json_out).write_text(json.dumps(gathered, indent=1) + "\n")
    finally:
        if os.path.exists(shm):
            os.remove(shm)  # DeepSpeed's shm all-reduce segment, never removed by it (64 MiB of tmpfs)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(world: int, args) -> list[dict]:
    """One torchrun launch of ``world`` ranks on this machine; the gathered per-rank results."""
    out = Path(tempfile.mkdtemp(prefix=f"zi-ranks-{world}-")) / "ranks.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(zi.REPO_ROOT / ".torch_extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={world}",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", __file__, "--worker",
           "--steps", str(args.steps), "--nvme-dir", os.path.abspath(args.nvme_dir), "--json-out", str(out)]
    print(f"running {world} rank(s): {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env=env, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{world} rank(s) failed with exit status {proc.returncode} (output above)")
    return json.loads(out.read_text())


def _summary(r: dict) -> dict:
    return dict(rank=r["rank"], world=r["world_size"], num_micro=r["num_micro_batches"],
                s_per_step=r["s_per_step"], step_s=r["step_s"], losses=r["losses"],
                ssd_read_bytes_per_step=r["ssd_read_bytes_per_step"], ssd_write_bytes_per_step=r["ssd_write_bytes_per_step"],
                collective_sent_bytes_per_step=r["collective_sent_bytes_per_step"],
                collectives_per_step=r["counters_per_step"][-1], nvme_state_bytes=r["swap_files_apparent_bytes"],
                nvme_state_bytes_by_dir=r["swap_files_apparent_bytes_by_dir"], peak_rss_bytes=r["peak_rss_bytes"],
                torch_threads=r["torch_threads"], omp_num_threads=r["omp_num_threads"])


def _plot(report: dict, path: Path) -> None:
    keys = [("ssd_read_bytes_per_step", "SSD read / step"), ("ssd_write_bytes_per_step", "SSD write / step"),
            ("collective_sent_bytes_per_step", "sent by collectives / step"), ("nvme_state_bytes", "state on NVMe")]
    plot_ranks(report, path, keys, "MB per rank (rank 0)",
               f"DeepSpeed ZeRO-Infinity data parallel, r1, global batch {report['global_batch']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2", help="comma-separated world sizes, one torchrun launch each")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is warm-up)")
    p.add_argument("--nvme-dir", default=os.path.join(tempfile.gettempdir(), "zi-ranks"),
                   help="each rank swaps to <nvme-dir>/rank<r> (a fresh sub-directory, removed at the end)")
    p.add_argument("--json-out", default=str(RESULTS / "r1.json"))
    p.add_argument("--timeout-s", type=int, default=3600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    runs, full = {}, {}
    for world in (int(w) for w in args.ranks.split(",")):
        name = f"{world} rank{'s' if world > 1 else ''}"
        full[name] = launch(world, args)
        runs[name] = [_summary(r) for r in full[name]]
        for r in runs[name]:
            print(f"  rank {r['rank']}/{world}: {r['s_per_step']:.2f} s/step, SSD read {r['ssd_read_bytes_per_step'] / 1e6:.0f} MB"
                  f" write {r['ssd_write_bytes_per_step'] / 1e6:.0f} MB, sent {r['collective_sent_bytes_per_step'] / 1e6:.0f} MB"
                  f" per step, state on NVMe {r['nvme_state_bytes'] / 1e6:.0f} MB, losses {r['losses']}", flush=True)
    first = next(iter(full.values()))[0]
    report = dict(preset="r1", steps=args.steps, global_batch=PRESET["micro_batch_size"] * PRESET["global_micro"],
                  machine="2 shared CPU cores, gloo on 127.0.0.1, OMP_NUM_THREADS=1 per rank",
                  collective_bytes="ring model over every torch.distributed collective DeepSpeed called (wrapper)",
                  deepspeed_version=first["deepspeed_version"], deepspeed_settings={n: rs[0]["deepspeed_settings"] for n, rs in full.items()},
                  runs=runs)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    _plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
