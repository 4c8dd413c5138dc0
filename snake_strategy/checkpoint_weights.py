"""The weights of a checkpoint directory without its optimizer state, one unit at a time.

``CheckpointWeights`` reads the master weights of a greedysnake checkpoint (see checkpoint.py for the
layout) and nothing else: evaluation from ``ckpt_path`` builds its tiers straight from it, and
``export_hf_checkpoint`` (``python -m snake_strategy.checkpoint DIR OUT --format hf``) streams it into
a HuggingFace directory. Neither ever holds more than one unit of the model in memory.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from snake_strategy.checkpoint import _DTYPES, _read_manifest, _read_raw, locate
from snake_strategy.progress import Progress


class CheckpointWeights:
    """The master weights of a checkpoint directory, read one unit at a time: what evaluation
    (``trainer.validate(ckpt_path=dir)``) and the HF export need. The Adam moment files are never opened
    (nor verified); the files that are read are verified first (size and CRC-32).

    Also a pretrained source for the engine's materialization (``unit_flat``, ``tensor``, ``close``):
    parameters are matched by name, so the reader's unit layout need not be the checkpoint's.
    """

    def __init__(self, path: str | os.PathLike, progress: Progress | None = None) -> None:
        self.root = locate(path)
        self.manifest = _read_manifest(self.root, progress,
                                       verify=lambda name: not name.endswith((".exp_avg.bin", ".exp_avg_sq.bin")))
        self.dtype = _DTYPES[self.manifest["master_dtype"]]
        self._where = {name: (u, shape, offset, numel) for u, unit in enumerate(self.manifest["units"])
                       for name, shape, offset, numel in unit["slots"]}
        # mmap: the non-layer moments in the same file are not read into memory.
        nonlayer = torch.load(self.root / "nonlayer.pt", map_location="cpu", mmap=True, weights_only=True)
        self._nonlayer = dict(zip(nonlayer["names"], nonlayer["master"]))
        self._cached: tuple[int, torch.Tensor] | None = None  # the last unit read (units are read in order)

    def meta(self) -> dict[str, Any]:
        """Lightning's checkpoint dict (loops, callbacks, hparams; non-layer ``state_dict`` entries)."""
        return torch.load(self.root / "meta.pt", map_location="cpu", weights_only=False)

    def _unit(self, u: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != u:
            self._cached = None  # drop the previous unit before the next arrives: one unit in memory
            self._cached = (u, _read_raw(self.root / f"units/unit{u:05d}.master.bin",
                                         self.manifest["units"][u]["numel"], self.dtype))
        return self._cached[1]

    def tensor(self, name: str, shape: Any = None) -> torch.Tensor:
        """Parameter ``name`` (a view into the cached unit, or a non-layer tensor)."""
        if name in self._nonlayer:
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

    def unit_flat(self, layout: Any, first_block: int, prefix: str, dtype: torch.dtype) -> torch.Tensor:
        flat = torch.empty(layout.numel, dtype=dtype)
        for s in layout.slots:
            flat[s.offset:s.offset + s.numel].copy_(self.tensor(f"{prefix}.{first_block + s.block}.{s.name}",
                                                                s.shape).reshape(-1))
        return flat

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter by name: the non-layer ones, then unit by unit (one unit in memory)."""
        yield from self._nonlayer.items()
        for u, unit in enumerate(self.manifest["units"]):
            for name, _, _, _ in unit["slots"]:
                yield name, self.tensor(name)

    def close(self) -> None:
        self._cached = None
        self._nonlayer = {}


def export_hf_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, config: Any = None,
                         dtype: torch.dtype | None = None, progress: Progress | None = None) -> list[str]:
    """Write a HF model directory from a checkpoint directory of an ``HFCausalLM``, streamed unit by unit.

    ``config``: a HF model directory, a ``config.json`` path, a dict or a ``PretrainedConfig``; by default
    the one the module saved in its hyper-parameters. ``dtype``: of the files (default: the master dtype).
    """
    from snake_strategy.hf import export_hf  # the optional [hf] extra

    weights = CheckpointWeights(path, progress)
    try:
        if config is None:
            config = weights.meta().get("hyper_parameters", {}).get("config")
            if not isinstance(config, dict) or "model_type" not in config:
                raise ValueError(f"{weights.root} holds no HF config in its hyper-parameters (not an HFCausalLM "
                                 "checkpoint?); pass the model's config: --config HF_DIR_OR_CONFIG_JSON")
        elif isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
            config = json.loads(Path(config).read_text())
        return export_hf(weights.named_tensors(), out_dir, config=config, dtype=dtype or weights.dtype,
                         progress=progress)
    finally:
        weights.close()
