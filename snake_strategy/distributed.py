"""Several processes, the Lightning way: launchers, cluster environments, the process group, collectives.

``DataParallelMixin`` gives ``GreedySnakeStrategy`` what Lightning's ``DDPStrategy`` has, without the
``DistributedDataParallel`` wrapper (the engine sums the gradients itself, unit by unit, see
``engine/parallel/reduce.py``):

- ``devices=N, num_nodes=K``: Lightning's ``_SubprocessScriptLauncher`` starts the other local ranks by
  re-running the script; under torchrun or SLURM the cluster environment says the processes exist already
  and the launcher only runs the function. One process per device; gloo on CPU, NCCL on CUDA.
- ``reduce``, ``barrier``, ``broadcast``, ``all_gather`` (``ParallelStrategy``'s), ``is_global_zero``:
  as ``DDPStrategy``'s, so ``self.log(..., sync_dist=True)``, ``ModelCheckpoint`` and loggers work.
- ``is_distributed``: Lightning inserts a ``DistributedSampler`` (each rank loads its own batch).

With one process (the default) nothing here creates a process group: the strategy is exactly the
single-process one.

The module also holds the per-rank rules: each rank's SSD directory (``ssd_dir/rank{r}``), the data
checks that keep N ranks x M micro-batches equal to 1 rank x N*M (no padded or short per-rank batches),
and the initial-state check that makes every rank start from rank 0's weights.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import zlib
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.utils.data import DistributedSampler

from snake_strategy.config import StorageConfig
from snake_strategy.launchers import ScriptLauncher, SingleProcessLauncher

DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch.distributed's default process-group timeout


class DataParallelMixin:
    """Process-group and collectives glue for a ``ParallelStrategy`` (put it before it in the bases)."""

    def _init_data_parallel(self, process_group_backend: str | None, timeout: timedelta | None) -> None:
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout if timeout is not None else DEFAULT_TIMEOUT

    # ------------------------------------------------------------------ topology
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def root_device(self) -> torch.device:
        if self.parallel_devices:
            return self.parallel_devices[self.local_rank]
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connectors: True inserts a DistributedSampler into the loaders."""
        return self.num_processes * self.num_nodes > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_processes * self.num_nodes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        # Lightning's script launcher starts the local ranks (or, under torchrun / SLURM, sees that the
        # environment already did); both launchers first recover what killed saves left (launchers.py).
        if self.is_distributed:
            self._launcher = ScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = SingleProcessLauncher()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.is_distributed:
            reset_seed()  # the seed Lightning's seed_everything exported, in this process too
            self.set_world_ranks()
            self._process_group_backend = (self._process_group_backend
                                           or _get_default_process_group_backend_for_device(self.root_device))
            device = self.root_device if self.root_device.type != "cpu" else None
            _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                                  device_id=device)

    # ------------------------------------------------------------------ collectives (as DDPStrategy's)
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]


# ---------------------------------------------------------------------- per-rank rules
def rank_storage(storage: StorageConfig, rank: int, world_size: int) -> StorageConfig:
    """Each rank's own SSD directory, ``ssd_dir/rank{r}``: its own files, lock and free-space check. A
    per-node path comes from the environment (``ssd_dir="$LOCAL_NVME/run1"`` is expanded in each process).
    Without an ``ssd_dir`` every process makes its own temporary directory anyway."""
    if world_size == 1 or storage.ssd_dir is None:
        return storage
    return dataclasses.replace(storage, ssd_dir=os.path.join(storage.ssd_dir, f"rank{rank}"))


def check_rank_storage(storage: StorageConfig, rank: int, world_size: int) -> list[str]:
    """Refuse, on every rank and before any rank takes its lock, SSD layouts where the ranks' directories
    are not one per rank: ranks of one machine given different ``ssd_dir`` roots (a rank-dependent variable
    or a relative path seen from different working directories), a root or rank directory that resolves to
    another rank's (symbolic links), a rank directory or root in use by a live run (another run's lock, or
    a one-process run on the root itself), and a variable left unexpanded. One small gather of each rank's
    host and paths (a sync point).

    Returns the directories this run creates above the rank directories (the root ``ssd_dir`` and its
    missing parents, deepest first): those no rank of this machine found before the gather, so no rank
    has created them yet. Each rank's engine removes only what it created itself, which leaves the shared
    root behind; ``remove_empty_dirs`` after the engine closes removes it as a single process does."""
    mine = rank_storage(storage, rank, world_size).ssd_dir
    local = {"rank": rank, "host": socket.gethostname(), "root": None, "dir": None, "problem": None, "missing": []}
    if storage.ssd_dir is not None:
        local["root"] = os.path.abspath(storage.ssd_dir)
        local["dir"] = os.path.realpath(mine)
        local["problem"] = _layout_problem(storage.ssd_dir, local["root"], mine)
        level = local["root"]
        while not os.path.exists(level) and os.path.dirname(level) != level:
            local["missing"].append(level)
            level = os.path.dirname(level)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local)
    for g in gathered:
        if g["problem"] is not None:
            raise ValueError(f"rank {g['rank']} (host {g['host']}): {g['problem']}")
    for a in gathered:
        for b in gathered[a["rank"] + 1:]:
            if a["host"] != b["host"]:
                continue  # per-node paths (ssd_dir="$LOCAL_NVME/run") are how several machines are set up
            if a["root"] != b["root"]:
                raise ValueError(
                    f"ranks {a['rank']} and {b['rank']} on host {a['host']} were given different storage.ssd_dir "
                    f"roots ({a['root']!r} and {b['root']!r}): every process of a machine must get the same ssd_dir "
                    "(each rank uses its own ssd_dir/rank<r> below it), e.g. an absolute path without rank-dependent "
                    "variables in the configuration all ranks start from")
            if a["dir"] is not None and a["dir"] == b["dir"]:
                raise ValueError(f"ranks {a['rank']} and {b['rank']} on host {a['host']} would share the SSD directory "
                                 f"{a['dir']} (a symbolic link between the rank directories under storage.ssd_dir="
                                 f"{a['root']!r}?): give every rank its own directory; remove the link")
    same_host = [g for g in gathered if g["host"] == local["host"]]
    return [level for level in local["missing"] if all(level in g["missing"] for g in same_host)]


def close_engine(engine: Any, created_dirs: list[str]) -> None:
    """``engine.close()`` (re-raising its error), then ``remove_empty_dirs(created_dirs)`` even when it failed:
    with several ranks each engine removes only its rank's directory, not the shared root this run made."""
    try:
        engine.close()
    finally:
        remove_empty_dirs(created_dirs)


def remove_empty_dirs(levels: list[str]) -> None:
    """Remove ``levels`` (deepest first) where they are empty; each rank calls it after its engine closed.
    The rank that closes last finds the root empty and removes it; a rank that closes earlier, or a file a
    user put there, leaves it (rmdir never removes content)."""
    for level in levels:
        try:
            os.rmdir(level)
        except OSError:
            return  # not empty (another rank still runs, or a user's file) or already gone: stop there


def _layout_problem(given: str, root: str, mine: str) -> str | None:
    """What is wrong with this rank's SSD directory before it is locked (None: nothing)."""
    from snake_strategy.storage.leftovers import lock_pid
    from snake_strategy.storage.ssd_directory import LOCK_NAME, owner_alive

    if "$" in given:
        return (f"storage.ssd_dir={given!r} names an environment variable that is not set in this process; "
                "set it on every node (or write the path out)")
    for directory, what in ((root, "one-process run on storage.ssd_dir itself"), (mine, "run in this rank's directory")):
        lock_path = os.path.join(directory, LOCK_NAME)
        owner = lock_pid(lock_path)
        if owner is None:
            continue  # no lock (or a torn one: SsdDirectory deals with it)
        if owner != os.getpid() and owner_alive(lock_path, owner):
            return (f"{directory} is in use by a running process (pid {owner}, a {what}); give this run its own "
                    "storage.ssd_dir, or wait for that run to end")
    return None


def check_rank_loader(loader: Any, batch_size: int, world_size: int) -> None:
    """Refuse, before step 1, data that would make N ranks differ from one rank over the same global
    batches: a DistributedSampler that pads the dataset with repeated samples, or per-rank batches that
    end short (a short global batch splits into other micro-batches on N ranks than on one)."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        return  # the user shards the data (use_distributed_sampler=False, an iterable dataset): their call
    num_samples = len(sampler.dataset)
    if not sampler.drop_last and num_samples % world_size:
        raise ValueError(
            f"the training set has {num_samples} samples, which the {world_size} ranks cannot share evenly: "
            f"DistributedSampler would repeat {world_size - num_samples % world_size} of them, and the step "
            "would not equal one process over the same data. Use a dataset whose length is a multiple of "
            f"{world_size} (or a DistributedSampler with drop_last=True)")
    if len(sampler) % batch_size and not getattr(loader, "drop_last", False):
        raise ValueError(
            f"each of the {world_size} ranks gets {len(sampler)} samples, which is not a multiple of the per-rank "
            f"batch size {batch_size}: the last global batch would be short and split differently across ranks "
            f"than on one process. Make the dataset length a multiple of {world_size * batch_size} "
            "(world size x per-rank batch), or set drop_last=True in the DataLoader")


def build_engine(build: Callable[[], Any], storage: StorageConfig, rank: int, world_size: int) -> tuple[Any, list[str]]:
    """(``build()``, the shared SSD directories this run creates; see ``check_rank_storage``); with several
    ranks, after ``check_rank_storage``, and through ``build_together``."""
    if world_size == 1:
        return build(), []  # the engine's own SsdDirectory removes everything it created
    created = check_rank_storage(storage, rank, world_size)  # before any rank takes its lock
    return build_together(build), created


def build_together(build: Callable[[], Any]) -> Any:
    """``build()`` on every rank, and a failure on any rank raised on all of them (one small gather: a
    sync point). Without it a rank whose setup fails (its disk is full, its directory locked) exits and the
    others wait for it in their first collective until the process-group timeout."""
    built, failure = None, None
    try:
        built = build()
    except Exception as err:  # reported to every rank; this rank raises its own error
        failure = err
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if failure is None else f"{type(failure).__name__}: {failure}")
    failed = next(((r, e) for r, e in enumerate(gathered) if e is not None), None)
    if failed is not None:
        if built is not None:
            built.close()
        if failure is not None:
            raise failure
        raise ValueError(f"the setup failed on rank {failed[0]}, so every rank stops: {failed[1]}")
    return built


def sync_initial_state(engine: Any, device: torch.device) -> int:
    """Make every rank start from rank 0's state, as DistributedDataParallel does at wrapping: compare a
    CRC-32 of each unit's trainable state and of the non-layer state across ranks (one small gather), and
    broadcast rank 0's copy of what differs. Returns the number of parts broadcast. Frozen (base) weights
    must already agree (every rank loads the same pretrained files): a mismatch is refused.

    Cost: every unit's master weights and moments are read once at setup (SSD reads on an SSD layout)."""
    local = {"units": [_crc_of(engine.unit_state(u)) for u in range(engine.num_units)],
             "frozen": engine.frozen_checksums(),
             "nonlayer": _crc_of(engine.nonlayer_state())}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    reference = gathered[0]
    if any(g["frozen"] != reference["frozen"] for g in gathered):
        raise ValueError("the ranks hold different frozen (base) weights; every rank must load the same "
                         "pretrained weights (pretrained= a file every rank can read)")
    broadcast = 0
    for u in range(engine.num_units):
        if any(g["units"][u] != reference["units"][u] for g in gathered):
            state = {}
            for name, value in sorted(engine.unit_state(u).items()):
                value = value.to(device)  # NCCL moves device tensors only
                dist.broadcast(value, 0)
                state[name] = value.cpu()
            engine.load_unit_state(u, state)
            broadcast += 1
    if any(g["nonlayer"] != reference["nonlayer"] for g in gathered):
        box = [engine.nonlayer_state()]
        dist.broadcast_object_list(box, 0)
        engine.load_nonlayer_state(box[0])
        broadcast += 1
    return broadcast


def _crc_of(value: Any) -> int:
    """CRC-32 over every tensor in a (nested) state, in a fixed order."""
    crc = 0
    if isinstance(value, Tensor):
        return zlib.crc32(memoryview(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    if isinstance(value, dict):
        for key in sorted(value):
            crc = zlib.crc32(str(key).encode(), crc)
            crc = zlib.crc32(_crc_of(value[key]).to_bytes(4, "little"), crc)
    elif isinstance(value, (list, tuple)):
        for item in value:
            crc = zlib.crc32(_crc_of(item).to_bytes(4, "little"), crc)
    else:
        crc = zlib.crc32(repr(value).encode())
    return crc
