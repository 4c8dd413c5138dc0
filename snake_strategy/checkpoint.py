"""Directory checkpoints of the tiered state, their verification, and consolidation to one file.

Layout of ``<name>.ckpt/`` (a directory):

    meta.pt          Lightning's checkpoint dict (loops, callbacks, LR schedulers, hparams); its
                     ``state_dict`` holds the non-layer parameters only
    nonlayer.pt      the non-layer parameters' master weights and Adam moments
    units/unitNNNNN.{master,exp_avg,exp_avg_sq}.bin   raw little-endian tensors, one unit per file
    manifest.json    written last: format, step, layouts (names, shapes, offsets), sizes and CRC-32s

Saving streams one unit at a time from its tiers (never the whole model in memory) into a temporary
sibling directory that is renamed into place only when complete, so a failure (ENOSPC, EIO, a kill)
leaves the previous checkpoint intact. Loading verifies every file's size and CRC-32 before use and
names the file that fails.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from snake_strategy.engine import SnakeEngine

FORMAT = "greedysnake-checkpoint/1"
STATES = ("master", "exp_avg", "exp_avg_sq")
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}


def save(engine: SnakeEngine, checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "units").mkdir(parents=True)
    try:
        engine.flush()  # pending deferred updates belong to the saved state
        files = {}
        units = []
        for u in range(engine.num_units):
            values = engine.unit_state(u)
            for state in STATES:
                name = f"units/unit{u:05d}.{state}.bin"
                files[name] = _write_raw(tmp / name, values[state])
            del values  # one unit in memory at a time
            units.append({"numel": engine.unit_numel(u), "slots": [list(slot) for slot in engine.unit_slots(u)]})
        torch.save(engine.nonlayer_state(), tmp / "nonlayer.pt")
        files["nonlayer.pt"] = _describe(tmp / "nonlayer.pt")
        torch.save(checkpoint, tmp / "meta.pt")
        files["meta.pt"] = _describe(tmp / "meta.pt")
        manifest = {"format": FORMAT, "step_count": engine.step_count, "master_dtype": str(engine.dtypes.master),
                    "blocks_per_unit": engine.schedule.blocks_per_unit, "units": units, "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final) if final.is_dir() else final.unlink()
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_manifest(path: str | os.PathLike) -> dict:
    root = Path(path)
    manifest_path = root / "manifest.json"
    if not manifest_path.exists():
        raise ValueError(f"{root} is not a complete greedysnake checkpoint (no manifest.json): an interrupted save "
                         "or another format")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as err:
        raise ValueError(f"{manifest_path} is corrupt: {err}") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{manifest_path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    for name, info in manifest["files"].items():
        _verify(root / name, info)
    return manifest


def load(engine: SnakeEngine, path: str | os.PathLike) -> dict[str, Any]:
    """Stream a checkpoint into the engine's tiers; returns Lightning's checkpoint dict."""
    root = Path(path)
    manifest = read_manifest(root)
    if len(manifest["units"]) != engine.num_units or manifest["blocks_per_unit"] != engine.schedule.blocks_per_unit:
        raise ValueError(f"{root} holds {len(manifest['units'])} units of {manifest['blocks_per_unit']} blocks; this "
                         f"run has {engine.num_units} of {engine.schedule.blocks_per_unit} (schedule.blocks_per_unit)")
    dtype = _DTYPES[manifest["master_dtype"]]
    engine.flush()
    for u in range(engine.num_units):
        numel = engine.unit_numel(u)
        if manifest["units"][u]["numel"] != numel:
            raise ValueError(f"{root}: unit {u} has {manifest['units'][u]['numel']} parameters, the model {numel}")
        engine.load_unit_state(u, {state: _read_raw(root / f"units/unit{u:05d}.{state}.bin", numel, dtype)
                                   for state in STATES})
    engine.load_nonlayer_state(torch.load(root / "nonlayer.pt", map_location="cpu", weights_only=True))
    engine.step_count = manifest["step_count"]
    return torch.load(root / "meta.pt", map_location="cpu", weights_only=False)


def consolidate(path: str | os.PathLike, out_path: str | os.PathLike) -> dict[str, Any]:
    """Write one ordinary Lightning checkpoint file with every parameter (master values).

    ``LightningModule.load_from_checkpoint(out_path)`` and ``torch.load(out_path)`` read it.
    Holds the whole model in memory once: that is what a single-file state dict is.
    """
    root = Path(path)
    manifest = read_manifest(root)
    checkpoint = torch.load(root / "meta.pt", map_location="cpu", weights_only=False)
    dtype = _DTYPES[manifest["master_dtype"]]
    state = dict(checkpoint.get("state_dict", {}))
    for u, unit in enumerate(manifest["units"]):
        flat = _read_raw(root / f"units/unit{u:05d}.master.bin", unit["numel"], dtype)
        for name, shape, offset, numel in unit["slots"]:
            state[name] = flat[offset:offset + numel].view(shape).clone()
    checkpoint["state_dict"] = state
    checkpoint.pop("optimizer_states", None)
    torch.save(checkpoint, out_path)
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
        raise ValueError(f"checkpoint file {path} is truncated ({got} of {raw.nbytes} bytes)")
    return value


def _describe(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _verify(path: Path, info: dict) -> None:
    if not path.exists():
        raise ValueError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if size != info["bytes"]:
        raise ValueError(f"checkpoint file {path} has {size} bytes, the manifest says {info['bytes']} (truncated or torn)")
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            crc = zlib.crc32(chunk, crc)
    if crc != info["crc32"]:
        raise ValueError(f"checkpoint file {path} is corrupt (CRC-32 {crc:#010x}, manifest {info['crc32']:#010x})")


def _fsync_dir(path: Path) -> None:
    for root, _, names in os.walk(path):
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Consolidate a greedysnake checkpoint directory into one file "
                                                 "that LightningModule.load_from_checkpoint reads.")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_file")
    args = parser.parse_args(argv)
    checkpoint = consolidate(args.checkpoint_dir, args.output_file)
    print(f"wrote {args.output_file}: {len(checkpoint['state_dict'])} tensors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
