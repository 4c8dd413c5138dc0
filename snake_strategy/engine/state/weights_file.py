"""The trained weights after fit when they do not fit the host budget: streamed one unit at a time into a
safetensors file, then handed to the module as tensors memory-mapped from that file.

The mapped tensors cost no anonymous memory: their pages are the page cache's, read in on first touch
and dropped by the kernel under pressure (a cgroup limit reclaims them too). ``state_dict()``, a second
``fit``, validate/test/predict and ``export_hf`` read them like any CPU tensor. The maps are private
(``MAP_PRIVATE``): a write into a parameter copies that page into the process and never changes the file.

One mapping per dtype, each of the whole file up to the end of that dtype's tensors: ``torch.save`` then
sees one storage per dtype (it refuses two dtypes viewing one storage), and every tensor starts at a
multiple of its own item size because the writer puts wider dtypes first after an 8-byte aligned header.

Unless the user keeps it (``storage.export_dir``), the file's name is removed as soon as it is mapped
(``release_name``): the maps keep its data alive while the module uses it, and the kernel frees it when
the process ends, however it ends. A descriptor per such file (``_UNLINKED``) lets a failed later fit map
the same weights again (``/proc/self/fd/N``); ``close_unmapped`` lets go of the ones nothing maps.
"""
from __future__ import annotations

import itertools
import os
import shutil
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from snake_strategy.progress import Progress, or_quiet
from snake_strategy.sources.safetensors_io import SINGLE_FILE, ShardedSafetensorsWriter, read_header

if TYPE_CHECKING:
    from snake_strategy.engine.state.api import TrainedWeights, WeightSpec

WEIGHTS_FILE = "greedysnake-weights.safetensors"
# The file is written as one piece: the shard limit of the HF writer is set past any model.
_ONE_FILE_BYTES = 2**62
# How the kernel marks a mapped file whose name is gone in /proc/self/maps.
_DELETED = " (deleted)"
# The path a weights file had when its name was removed -> a read-only descriptor of it (see above).
_UNLINKED: dict[str, int] = {}
_TEMPORARY_NAMES = itertools.count()


def weights_file_name(world_size: int = 1, rank: int = 0) -> str:
    """One file per rank when several processes train (each gives its module the weights back)."""
    return WEIGHTS_FILE if world_size == 1 else f"greedysnake-weights-rank{rank}.safetensors"


def temporary_file_name(file_name: str) -> str:
    """A name no other process or export of this one uses (``file_name`` with the pid and a counter): the
    file is written under it, mapped, then its name is removed, so two runs sharing a directory never meet."""
    stem = file_name.removesuffix(".safetensors")
    return f"{stem}-pid{os.getpid()}-{next(_TEMPORARY_NAMES)}.safetensors"


def release_name(path: str) -> None:
    """Remove the name of the weights file ``path``, which the module's parameters map: the disk space goes
    back when the process ends (or when nothing maps it and ``close_unmapped`` ran). A read-only descriptor
    is kept so that the same weights can be mapped again while the process lives."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
    except BaseException:
        os.close(fd)
        raise
    old = _UNLINKED.pop(path, None)
    if old is not None:
        os.close(old)
    _UNLINKED[path] = fd


def name_released(path: str) -> bool:
    """Whether ``path`` is a weights file whose name ``release_name`` removed (its data lives on)."""
    return path in _UNLINKED


def close_unmapped() -> None:
    """Close the descriptors of released weights files that no parameter maps any more: their disk space
    goes back now rather than at the end of the process."""
    mapped = {path for _, _, path in file_mappings()}
    for path in [p for p in _UNLINKED if p not in mapped]:
        os.close(_UNLINKED.pop(path))


def file_bytes_needed(specs: list[WeightSpec]) -> int:
    """The file's data bytes plus a generous bound on its JSON header (``specs``: ``TrainedWeights.weight_specs``)."""
    return sum(shape.numel() * dtype.itemsize for _, dtype, shape in specs) + 256 * (len(specs) + 4)


@torch.no_grad()
def export_to_file(weights: TrainedWeights, path: str, specs: list[WeightSpec],
                   progress: Progress | None = None, scratch: bool = True) -> int:
    """Write every parameter's trained value into the safetensors file ``path``, one unit in memory at a
    time, and make the module's parameters views of that file (``map_weights_file``). ``specs``: the
    engine's ``weight_specs()``, which the caller sized the file from. Returns the file's size. The file is
    written under a temporary name and renamed when complete: a module still mapping an older file at
    ``path`` (the previous fit's) keeps reading it until its parameters are replaced. ``scratch``: the file is
    this process's (its name is released next), so it is mapped shared (``give_module_file_weights``)."""
    weights.release_working_memory()  # the pending updates land; the working buffers' memory goes back first
    partial_dir = path + ".partial"
    writer = ShardedSafetensorsWriter(partial_dir, specs, _ONE_FILE_BYTES)
    tracker = or_quiet(progress).phase("export", weights.num_units, total_bytes=writer.total_bytes)
    groups = weights.weight_groups()
    try:
        for name, value in next(groups):  # the non-layer parameters
            writer.write(name, value)
        for group in groups:  # one unit in memory at a time (a copy of its master values)
            unit_bytes = 0
            for name, value in group:
                writer.write(name, value)
                unit_bytes += value.numel() * value.element_size()
            del group
            tracker.advance(1, unit_bytes)
        writer.close()  # fsync: the file is complete on disk before the module depends on it
        os.replace(os.path.join(partial_dir, SINGLE_FILE), path)
    except BaseException:
        writer.abort()  # a no-op once close() ran
        shutil.rmtree(partial_dir, ignore_errors=True)
        raise
    shutil.rmtree(partial_dir, ignore_errors=True)
    tracker.finish()
    give_module_file_weights(weights.module, path, shared=scratch)
    return os.path.getsize(path)


def map_weights_file(path: str, shared: bool = False) -> dict[str, Tensor]:
    """Every tensor of the safetensors file ``path``, as views of memory maps (no copy is made): private (a
    write stays in this process) or ``shared`` (a write reaches the file). A private writable map is charged
    to the kernel's commit limit whole, so one larger than the machine's RAM is refused (ENOMEM); a shared
    one is not."""
    entries = read_header(path)
    by_dtype: dict[torch.dtype, list] = {}
    for name, entry in entries.items():
        by_dtype.setdefault(entry.dtype, []).append((name, entry))
    out: dict[str, Tensor] = {}
    for dtype, group in by_dtype.items():
        end_byte = max(entry.start_byte + entry.num_bytes for _, entry in group)
        item = dtype.itemsize
        # The map covers the file from its start; each tensor's start is a multiple of its item size
        # (wider dtypes first after an 8-byte aligned header), asserted rather than assumed.
        mapped = torch.from_file(path, shared=shared, size=-(-end_byte // item), dtype=dtype)
        for name, entry in group:
            assert entry.start_byte % item == 0, f"{path}: '{name}' starts at {entry.start_byte}, not {dtype}-aligned"
            first = entry.start_byte // item
            out[name] = mapped[first:first + entry.shape.numel()].view(entry.shape)
    return out


def give_module_file_weights(module: nn.Module, path: str, shared: bool | None = None) -> None:
    """Swap every parameter of ``module`` named in the file for its mapped view (the Parameter objects,
    which the optimizer and tied modules refer to, are kept). A file whose name was released is opened
    through its kept descriptor. ``shared`` (default: whether the name was released): the file is this
    process's scratch, so writes to the weights may land in it, and a private map of a model larger than RAM
    would be refused; a kept file (``storage.export_dir``) is mapped private, so changing the module never
    changes the file."""
    fd = _UNLINKED.get(path)
    shared = fd is not None if shared is None else shared
    mapped = map_weights_file(path if fd is None else f"/proc/self/fd/{fd}", shared=shared)
    for name, value in mapped.items():
        p = module.get_parameter(name)
        torch.utils.swap_tensors(p, nn.Parameter(value, p.requires_grad))


def file_mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file this process maps, sorted (Linux ``/proc/self/maps``; empty
    elsewhere). A private map does not record its file in the tensor's storage, the kernel does. A file
    whose name is gone is listed under the path it had (the kernel's " (deleted)" mark is dropped)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    out.append((start, end, fields[5].rstrip("\n").removesuffix(_DELETED)))
    except OSError:
        return []
    return sorted(out)


def file_backed(tensor: Tensor, mappings: list[tuple[int, int, str]] | None = None) -> str | None:
    """The file a CPU tensor's memory maps (``torch.from_file``), or None for ordinary memory."""
    if tensor.is_meta or tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    address = tensor.data_ptr()
    for start, end, path in (file_mappings() if mappings is None else mappings):
        if start <= address < end:
            return path
    return None


def mapped_parameters(module: nn.Module) -> dict[str, str]:
    """name -> the file each of the module's file-backed parameters maps (empty when none is)."""
    maps = file_mappings()
    return {name: f for name, p in module.named_parameters() if (f := file_backed(p, maps)) is not None}
