"""The weights of a checkpoint directory without its optimizer state: one unit at a time, or consolidated.

``CheckpointWeights`` reads the master weights of a greedysnake checkpoint (format.py has the layout)
and nothing else: evaluation from ``ckpt_path`` builds its tiers straight from it, and
``hf.export.export_hf_checkpoint`` (``python -m snake_strategy.checkpoint DIR OUT --format hf``) streams it
into a HuggingFace directory. Neither ever holds more than one unit of the model in memory.
``consolidate`` / ``load_consolidated`` instead build one ordinary Lightning checkpoint (every parameter
in one ``state_dict``), which holds the whole model in memory once.

A fine-tuning checkpoint (frozen parameters: LoRA, a frozen embedding, frozen lower blocks) holds the
trained parameters only, plus the names and CRC-32s of the frozen base weights. Its frozen values come
from a *base*: the base model's directory or state-dict file, or a module that holds them. The base is
checked against the recorded CRC-32s before any value is used (one extra read of the frozen weights),
and a different base is refused, naming the parameters that differ.
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from snake_strategy.checkpoint.format import DTYPES, read_meta, read_nonlayer, read_range, verified_manifest
from snake_strategy.checkpoint.store import locate
from snake_strategy.progress import Progress, or_quiet
from snake_strategy.sources.pretrained import PretrainedSource
from snake_strategy.units import named_tensors

BASE_HELP = ("the base model the run started from: a HuggingFace model directory, a torch.save'd state dict or a "
             "Lightning .ckpt file")


class _MappingWeights:
    """Base weights from a state dict, or from a module that holds them for real (not on the meta device)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], what: str) -> None:
        self.tensors, self.what = tensors, what

    def tensor(self, name: str, shape: Any = None) -> torch.Tensor:
        value = self.tensors.get(name)
        if value is None or value.is_meta:
            raise ValueError(f"{self.what} has no (materialized) parameter '{name}'; the base must be the model the "
                             "checkpoint's run started from")
        return value.detach().cpu()

    def close(self) -> None:
        self.tensors = {}


def open_base(base: Any) -> Any:
    """A base-weight source (``tensor(name)``, ``close()``) from a path, a state dict, a module or a source."""
    if isinstance(base, (str, os.PathLike)):
        return PretrainedSource(base)
    if isinstance(base, nn.Module):
        return _MappingWeights(dict(base.named_parameters()), f"module {type(base).__name__}")
    if isinstance(base, Mapping):
        return _MappingWeights(base, "the base state dict")
    if hasattr(base, "tensor") and hasattr(base, "close"):
        return base
    raise ValueError(f"base must be a path ({BASE_HELP}), a state dict or a module; got {type(base).__name__}")


def _bytes(value: torch.Tensor) -> memoryview:
    return memoryview(value.contiguous().reshape(-1).view(torch.uint8).numpy())


class CheckpointWeights:
    """The master weights of a checkpoint directory, read one unit at a time: what evaluation
    (``trainer.validate(ckpt_path=dir)``) and the HF export need. The Adam moment files are never opened
    (nor verified); the files that are read are verified first (size and CRC-32).

    Also a pretrained source for the engine's materialization (``unit_flat``, ``tensor``, ``close``):
    parameters are matched by name, so the reader's unit layout need not be the checkpoint's.

    ``base``: where the frozen parameters of a fine-tuning checkpoint come from (see the module
    docstring; ``open_base`` lists the kinds); checked against the checkpoint's CRC-32s here.
    """

    def __init__(self, path: str | os.PathLike, progress: Progress | None = None, base: Any = None) -> None:
        self.root = locate(path)
        # The optimizer's state files are never read here: only the master weights' and the rest are verified.
        self.manifest = verified_manifest(self.root, progress, verify=_not_optimizer_state)
        self.dtype = DTYPES[self.manifest["master_dtype"]]
        # The frozen CRC-32s are of the training run's compute weights (older checkpoints: master dtype).
        self.compute_dtype = DTYPES[self.manifest.get("compute_dtype", self.manifest["master_dtype"])]
        self._frozen_units = [unit.get("frozen", {}).get("names", []) for unit in self.manifest["units"]]
        self._frozen_nonlayer: dict[str, int] = dict(self.manifest.get("frozen_nonlayer", {}))
        self.frozen_names = {n for names in self._frozen_units for n in names} | set(self._frozen_nonlayer)
        self.base: Any = None
        self._where = {name: (u, shape, offset, numel) for u, unit in enumerate(self.manifest["units"])
                       for name, shape, offset, numel in unit["slots"]}
        # mmap: the non-layer moments in the same file are not read into memory.
        nonlayer = read_nonlayer(self.root, self.manifest, ("master",))
        self._nonlayer = dict(zip(nonlayer["names"], nonlayer["master"]))
        self._cached: tuple[int, torch.Tensor] | None = None  # the last unit read (units are read in order)
        if base is not None:
            self.set_base(base)

    # ------------------------------------------------------------------ the frozen base
    def set_base(self, base: Any) -> None:
        """Take the frozen weights from ``base`` after checking them against the recorded CRC-32s."""
        if not self.frozen_names:
            return  # every parameter is in the checkpoint: nothing to take from a base
        source = open_base(base)
        try:
            self._check_base(source)
        except BaseException:
            source.close()
            raise
        if self.base is not None:
            self.base.close()
        self.base = source

    def _check_base(self, source: Any) -> None:
        """The CRC-32 of each unit's frozen bytes and of each frozen non-layer parameter, as the training
        engine stored them (base -> master dtype -> compute dtype), against the manifest's. Costs one read
        of the frozen weights, one tensor in memory at a time."""
        changed = [name for name, crc in self._frozen_nonlayer.items()
                   if zlib.crc32(_bytes(source.tensor(name).to(self.compute_dtype))) != crc]
        for u, names in enumerate(self._frozen_units):
            crc = 0
            for name in names:  # flat-vector order: the unit's frozen part, contiguous
                crc = zlib.crc32(_bytes(source.tensor(name).to(self.dtype).to(self.compute_dtype)), crc)
            if names and crc != self.manifest["units"][u]["frozen"]["crc32"]:
                changed.append(f"unit {u} ({names[0]} ... {names[-1]})")  # one checksum per unit
        if changed:
            raise ValueError(f"the base weights given for {self.root} are not the ones it was fine-tuned from: "
                             f"{changed[:3]}{' ...' if len(changed) > 3 else ''} have another CRC-32 than the "
                             "checkpoint records. Pass the base model the run started from (the same pretrained "
                             "weights, or the same seed and init)")

    def with_base(self, module: nn.Module, pretrained: Any = None) -> CheckpointWeights:
        """This reader with its base attached (evaluation from ``ckpt_path``): the module's own frozen
        parameters when it holds them for real (built with its base weights, or given back after fit),
        else ``pretrained`` (the strategy's source, e.g. the directory an ``HFCausalLM`` was built from)."""
        if not self.frozen_names or self.base is not None:
            return self
        try:
            params = dict(module.named_parameters())
            if all(name in params and not params[name].is_meta for name in self.frozen_names):
                self.set_base(module)
            elif pretrained is not None:
                self.set_base(pretrained)
            else:
                raise ValueError(self._needs_base(next(iter(sorted(self.frozen_names)))))
        except BaseException:
            self.close()
            raise
        return self

    def _needs_base(self, name: str) -> str:
        return (f"{self.root} is a fine-tuning checkpoint: it holds the trained parameters and only a checksum of "
                f"the {len(self.frozen_names)} frozen base parameters (e.g. '{name}'), which must come from the base "
                "model. Evaluation: build the module with its base weights, or pass GreedySnakeStrategy(pretrained="
                "<base model>); consolidation: --base PATH (Python: base=PATH), " + BASE_HELP)

    def meta(self) -> dict[str, Any]:
        """Lightning's checkpoint dict (loops, callbacks, hparams; non-layer ``state_dict`` entries)."""
        return read_meta(self.root, self.manifest)

    def _unit(self, u: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != u:
            self._cached = None  # drop the previous unit before the next arrives: one unit in memory
            # one file, or the shards of a data-parallel run merged
            self._cached = (u, read_range(self.root, self.manifest, u, "master", 0,
                                          self.manifest["units"][u]["numel"], self.dtype))
        return self._cached[1]

    def tensor(self, name: str, shape: Any = None) -> torch.Tensor:
        """Parameter ``name`` (a view into the cached unit, or a non-layer tensor)."""
        if name in self.frozen_names:
            if self.base is None:
                raise ValueError(self._needs_base(name))
            value = self.base.tensor(name)
        elif name in self._nonlayer:
            value = self._nonlayer[name]
        elif name in self._where:
            u, saved_shape, offset, numel = self._where[name]
            value = self._unit(u)[offset:offset + numel].view(saved_shape)
        else:
            raise ValueError(f"checkpoint {self.root} has no parameter '{name}' (it has e.g. "
                             f"{sorted(self._nonlayer)[:3] + sorted(self._where)[:3]}); it was saved from another model")
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise ValueError(f"checkpoint {self.root}: '{name}' has shape {tuple(value.shape)}, the model expects "
                             f"{tuple(shape)}")
        return value

    def unit_flat(self, layout: Any, first_block: int, prefix: str, dtype: torch.dtype,
                  adapter_init: Any = None) -> torch.Tensor:
        """The unit's flat vector (``adapter_init`` is not needed: the adapters are in the checkpoint)."""
        flat = torch.empty(layout.numel, dtype=dtype)
        for s in layout.slots:
            flat[s.offset:s.offset + s.numel].copy_(self.tensor(f"{prefix}.{first_block + s.block}.{s.name}",
                                                                s.shape).reshape(-1))
        return flat

    def named_tensors(self, trained_nonlayer: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter by name: the non-layer ones (the trained ones unless ``trained_nonlayer`` is
        False, then the frozen ones from the base), then unit by unit (one unit in memory), its frozen
        parameters from the base."""
        if trained_nonlayer:
            yield from self._nonlayer.items()
        for name in self._frozen_nonlayer:
            yield name, self.tensor(name)
        for u, unit in enumerate(self.manifest["units"]):
            for name, _, _, _ in unit["slots"]:
                yield name, self.tensor(name)
            for name in self._frozen_units[u]:
                yield name, self.tensor(name)

    def close(self) -> None:
        self._cached = None
        self._nonlayer = {}
        if self.base is not None:
            self.base.close()
            self.base = None


def load_consolidated_with_base(path: str | os.PathLike, base: Any, progress: Progress | None = None) -> dict[str, Any]:
    """``checkpoint.load_consolidated`` of a fine-tuning checkpoint, with the frozen parameters taken from
    ``base`` (checked against the recorded CRC-32s first): one ordinary Lightning checkpoint dict that
    ``load_from_checkpoint`` reads. Frozen tensors keep the base's dtype."""
    weights = CheckpointWeights(path, base=base)  # refuses a different base before anything is read
    try:
        checkpoint = load_consolidated(path, progress)  # the trained parameters, in the master dtype
        for name in sorted(weights.frozen_names):
            checkpoint["state_dict"][name] = weights.tensor(name).clone()
        return checkpoint
    finally:
        weights.close()


def consolidate(path: str | os.PathLike, out_path: str | os.PathLike,
                progress: Progress | None = None, base: Any = None) -> dict[str, Any]:
    """Write one ordinary Lightning checkpoint file with every parameter (master values).

    ``LightningModule.load_from_checkpoint(out_path)`` and ``torch.load(out_path)`` read it.
    Holds the whole model in memory once: that is what a single-file state dict is. A fine-tuning
    checkpoint holds no frozen base weights: ``base`` (``open_base``) supplies them.
    """
    out = Path(out_path)
    if out.is_dir():
        raise ValueError(f"the output {out} is a directory; name the file to write, e.g. {out / 'model.ckpt'}")
    if not out.parent.is_dir():
        raise ValueError(f"the output directory {out.parent} does not exist; create it or write elsewhere")
    progress = or_quiet(progress)
    with progress.group("consolidate"):  # verify, read, write: one line when they are short
        return _consolidate(path, out_path, progress, base)


def _consolidate(path: str | os.PathLike, out_path: str | os.PathLike, progress: Progress, base: Any) -> dict[str, Any]:
    out = Path(out_path)
    if base is not None:
        checkpoint = load_consolidated_with_base(path, base, progress)
    else:
        checkpoint = load_consolidated(path, progress)
    # One torch.save of the whole model: no progress inside it, but its size and rate when it ends.
    tensor_bytes = sum(v.numel() * v.element_size() for v in checkpoint["state_dict"].values()
                       if isinstance(v, torch.Tensor))
    with progress.phase("consolidate_write", 1, what="files", total_bytes=tensor_bytes) as tracker:
        torch.save(checkpoint, out)
        tracker.advance(1, out.stat().st_size)
    return checkpoint


def load_consolidated(path: str | os.PathLike, progress: Progress | None = None) -> dict[str, Any]:
    """The checkpoint at ``path`` as the dict of one ordinary Lightning checkpoint file (every parameter
    in ``state_dict``, no optimizer state), in memory: what ``consolidate`` writes, and what
    ``load_from_checkpoint`` can read from a buffer without a file on disk. A sharded checkpoint's
    shards are merged (each unit's master weights read from the shards that hold them)."""
    root = locate(path)
    manifest = verified_manifest(root, progress)
    checkpoint = read_meta(root, manifest)
    dtype = DTYPES[manifest["master_dtype"]]
    state = dict(checkpoint.get("state_dict", {}))
    tracker = or_quiet(progress).phase("consolidate", len(manifest["units"]),
                                       total_bytes=dtype.itemsize * sum(unit["numel"] for unit in manifest["units"]))
    for u, unit in enumerate(manifest["units"]):
        flat = read_range(root, manifest, u, "master", 0, unit["numel"], dtype)
        state.update({name: value.clone() for name, value in named_tensors(flat, unit["slots"]).items()})
        tracker.advance(1, flat.numel() * flat.element_size())
    tracker.finish()
    checkpoint["state_dict"] = state
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def _not_optimizer_state(name: str) -> bool:
    """Whether a checkpoint file is anything but a unit's (or its shard's) optimizer state."""
    if not name.startswith(("units/", "shards/")):
        return True
    return ".master." in name
