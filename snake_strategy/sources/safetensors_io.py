"""Streamed safetensors: read a HuggingFace model directory one tensor at a time, write one unit at a time.

A HF model directory holds its weights either in one ``model.safetensors`` or in shards listed by
``model.safetensors.index.json`` (``{"weight_map": {name: shard file}}``). A safetensors file is an
8-byte little-endian header length, a JSON header (``{name: {dtype, shape, data_offsets}}``, offsets
relative to the end of the header) and the raw tensor bytes.

Both directions use plain ``os.preadv``/``os.pwrite`` at known offsets rather than memory maps: a mapped
file's touched pages count in the process's resident memory until it is unmapped, so streaming a model
larger than RAM through a map would show a peak RSS near the model size. Reading into a fresh buffer
keeps the resident set at one tensor plus whatever the caller holds (one unit), and the page cache
pages stay the kernel's to drop.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The header length is checked against this before it is allocated: a foreign file read as safetensors
# would otherwise ask for an arbitrary amount of memory.
MAX_HEADER_BYTES = 100 * 2**20

DTYPE_OF_CODE = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
CODE_OF_DTYPE = {v: k for k, v in DTYPE_OF_CODE.items()}


@dataclass(frozen=True)
class TensorEntry:
    file: str  # absolute path of the file that holds the tensor
    dtype: torch.dtype
    shape: torch.Size
    start_byte: int  # absolute offset in the file
    num_bytes: int


def read_header(path: str) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, by name (raises ValueError naming the file if it is malformed)."""
    size_bytes = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"'{path}' is too short to be a safetensors file")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(MAX_HEADER_BYTES, size_bytes - 8):
            raise ValueError(f"'{path}' is not a safetensors file (header length {header_bytes} is impossible)")
        try:
            header = json.loads(f.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"'{path}' has a corrupt safetensors header: {err}") from None
    data_start = 8 + header_bytes
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPE_OF_CODE.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"'{path}': tensor '{name}' has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        shape = torch.Size(info["shape"])
        if end - begin != shape.numel() * dtype.itemsize or data_start + end > size_bytes:
            raise ValueError(f"'{path}': tensor '{name}' has data offsets {begin}..{end} that do not fit its "
                             f"shape {tuple(shape)} / {info['dtype']} or the file ({size_bytes} bytes); the file "
                             "is truncated or corrupt")
        entries[name] = TensorEntry(path, dtype, shape, data_start + begin, end - begin)
    return entries


def _read_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        # One preadv moves at most ~2 GiB on Linux: loop until the whole tensor is in.
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ValueError(f"'{path}' ended early (truncated file)")
        done += n


class SafetensorsDirectory:
    """The weights of a HF model directory, readable tensor by tensor.

    Only headers are read up front; ``read(name)`` reads one tensor into a new CPU tensor.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        index_path = os.path.join(self.path, INDEX_FILE)
        single_path = os.path.join(self.path, SINGLE_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"'{index_path}' has no weight_map; re-save the model with save_pretrained")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single_path):
            weight_map, files = None, [SINGLE_FILE]
        else:
            present = sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []
            raise ValueError(
                f"'{self.path}' holds neither {SINGLE_FILE} nor {INDEX_FILE} (it has {present[:8]}); save the model "
                "with save_pretrained(..., safe_serialization=True) (pytorch_model.bin files are not read)")
        self.entries: dict[str, TensorEntry] = {}
        for name in files:
            file_path = os.path.join(self.path, name)
            if not os.path.isfile(file_path):
                raise ValueError(f"'{index_path}' lists shard '{name}', which is missing from '{self.path}'")
            self.entries.update(read_header(file_path))
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.entries))
            if missing:
                raise ValueError(f"'{index_path}' maps {missing[:5]} to shards that do not contain them")
        self._fds: dict[str, int] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str) -> Tensor:
        """Tensor ``name`` as a new CPU tensor in the file's dtype (KeyError if absent)."""
        entry = self.entries[name]
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        buffer = torch.empty(entry.num_bytes, dtype=torch.uint8)
        if entry.num_bytes:
            _read_exact(fd, memoryview(buffer.numpy()), entry.start_byte, entry.file)
        return buffer.view(entry.dtype).view(entry.shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _shard_names(num_shards: int) -> list[str]:
    if num_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


class ShardedSafetensorsWriter:
    """Writes a known set of tensors into sharded safetensors files, in any order, one tensor at a time.

    Every name, shape and dtype is declared up front (``plan``), so each shard's header and every
    tensor's offset are fixed before any data arrives: ``write`` puts one tensor in place and forgets
    it, and memory never holds more than the caller's current unit. Shards are cut in plan order once
    ``max_shard_bytes`` would be exceeded (a tensor larger than that gets a shard of its own). One shard
    is written as ``model.safetensors`` without an index, as ``save_pretrained`` does.
    """

    def __init__(self, out_dir: str | os.PathLike, plan: Iterable[tuple[str, torch.dtype, torch.Size]],
                 max_shard_bytes: int = 5 * 2**30) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = os.fspath(out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        stale_index = os.path.join(self.out_dir, INDEX_FILE)
        if os.path.exists(stale_index):
            os.remove(stale_index)  # else a previous sharded export's index would shadow a single new file
        shards: list[list[tuple[str, torch.dtype, torch.Size]]] = [[]]
        shard_bytes = 0
        for name, dtype, shape in plan:
            if dtype not in CODE_OF_DTYPE:
                raise ValueError(f"tensor '{name}' has dtype {dtype}, which safetensors cannot store")
            num_bytes = torch.Size(shape).numel() * dtype.itemsize
            if shards[-1] and shard_bytes + num_bytes > max_shard_bytes:
                shards.append([])
                shard_bytes = 0
            shards[-1].append((name, dtype, torch.Size(shape)))
            shard_bytes += num_bytes
        if not shards[-1]:
            raise ValueError("nothing to write: the plan names no tensors")
        self.files = _shard_names(len(shards))
        self.slots: dict[str, tuple[int, int, torch.dtype, torch.Size]] = {}  # name -> (shard, offset, dtype, shape)
        self.total_bytes = 0
        self._fds = []
        for index, (file, shard) in enumerate(zip(self.files, shards)):
            # Wider dtypes first: every tensor then starts at a multiple of its own item size.
            ordered = sorted(shard, key=lambda e: -e[1].itemsize)
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, dtype, shape in ordered:
                num_bytes = shape.numel() * dtype.itemsize
                header[name] = {"dtype": CODE_OF_DTYPE[dtype], "shape": list(shape),
                                "data_offsets": [offset, offset + num_bytes]}
                offset += num_bytes
            encoded = json.dumps(header, separators=(",", ":")).encode()
            encoded += b" " * (-len(encoded) % 8)  # keeps the data section 8-byte aligned
            data_start = 8 + len(encoded)
            fd = os.open(os.path.join(self.out_dir, file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds.append(fd)
            os.pwrite(fd, struct.pack("<Q", len(encoded)) + encoded, 0)
            os.ftruncate(fd, data_start + offset)
            for name, dtype, shape in ordered:
                self.slots[name] = (index, data_start + header[name]["data_offsets"][0], dtype, shape)
            self.total_bytes += offset
        self.written: set[str] = set()

    def write(self, name: str, tensor: Tensor) -> None:
        """Put ``tensor`` (any device/dtype, cast to the planned dtype) at its place on disk."""
        if name not in self.slots:
            raise ValueError(f"'{name}' is not among the tensors planned for this export "
                             f"(e.g. {sorted(self.slots)[:5]})")
        shard, offset, dtype, shape = self.slots[name]
        if tensor.shape != shape:
            raise ValueError(f"'{name}' has shape {tuple(tensor.shape)}, the export planned {tuple(shape)}")
        flat = tensor.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1)
        view = memoryview(flat.view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            done += os.pwrite(self._fds[shard], view[done:], offset + done)
        self.written.add(name)

    def abort(self) -> None:
        """Close the files without checking completeness (the export failed; its files are partial)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def close(self) -> list[str]:
        """Check that every planned tensor arrived, write the index (sharded case); return the files."""
        for fd in self._fds:
            os.fsync(fd)
            os.close(fd)
        self._fds = []
        missing = sorted(set(self.slots) - self.written)
        if missing:
            raise ValueError(f"export incomplete: {len(missing)} planned tensors were never written "
                             f"(e.g. {missing[:5]}); the source must provide every parameter")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {name: self.files[slot[0]] for name, slot in sorted(self.slots.items())}}
            with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
        return list(self.files)
