"""Stream pretrained weights into the tiers one unit at a time, never holding the whole model.

Sources: a ``torch.save``'d state dict (``.pt``/``.bin``) or a Lightning checkpoint (its ``state_dict``;
greedysnake's own checkpoints are consolidated and load here for fine-tuning). The file is opened with
``torch.load(mmap=True)``: tensors stay in the file until a unit copies its own, so resident memory
holds one unit at a time plus clean file pages the kernel can drop.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import Tensor

from snake_strategy.units import UnitLayout


class PretrainedSource:
    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise ValueError(f"pretrained='{path}' is not a file; pass a torch.save'd state dict or a Lightning .ckpt")
        try:
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # torch raises several types for foreign or corrupt files
            raise ValueError(f"pretrained='{path}' could not be read as a state dict: {err}") from None
        state = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else None
        if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
            raise ValueError(f"pretrained='{path}' holds no state dict of tensors")
        self.path, self.state = path, state

    def tensor(self, name: str, shape: torch.Size) -> Tensor:
        if name not in self.state:
            raise ValueError(f"pretrained='{self.path}' has no entry '{name}' (it has e.g. "
                             f"{sorted(self.state)[:5]}); the file must come from the same model class")
        value = self.state[name]
        if value.shape != shape:
            raise ValueError(f"pretrained '{name}' has shape {tuple(value.shape)}, the model expects {tuple(shape)}")
        return value

    def unit_flat(self, layout: UnitLayout, first_block: int, prefix: str, dtype: torch.dtype) -> Tensor:
        """The unit's flat vector, read entry by entry from the file."""
        flat = torch.empty(layout.numel, dtype=dtype)
        for s in layout.slots:
            source = self.tensor(f"{prefix}.{first_block + s.block}.{s.name}", s.shape)
            flat[s.offset:s.offset + s.numel].copy_(source.reshape(-1))
        return flat

    def close(self) -> None:
        self.state = {}  # drops the mmap
