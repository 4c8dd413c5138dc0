"""Stream pretrained weights into the tiers one unit at a time, never holding the whole model.

Sources:

- a ``torch.save``'d state dict (``.pt``/``.bin``) or a Lightning checkpoint (its ``state_dict``;
  greedysnake's own checkpoints are consolidated and load here for fine-tuning). The file is opened with
  ``torch.load(mmap=True)``: tensors stay in the file until a unit copies its own.
- a HuggingFace model directory (``model.safetensors``, or shards listed by
  ``model.safetensors.index.json``), read tensor by tensor with ``pread`` (see safetensors_io). Names
  are the module's parameter names; ``snake_strategy.hf.HFCausalLM`` names its parameters exactly as
  the HF checkpoint does, so no key map is needed. Checkpoints saved from the bare trunk (keys without
  the ``model.``/``transformer.`` prefix, as the original GPT-2 files) are found too. Where the files
  keep a layer in another layout than the module (a mixture-of-experts layer's per-expert matrices,
  stacked into 3-D parameters in memory), the module's ``checkpoint_conversion(file_keys)`` says which
  file tensors make each parameter and how to combine them (``HFCausalLM`` uses transformers' mapping).

Either way resident memory holds one unit at a time (plus one tensor being copied).
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from snake_strategy.sources.lora_init import fresh_adapter_values
from snake_strategy.sources.safetensors_io import SafetensorsDirectory
from snake_strategy.units import UnitLayout

log = logging.getLogger(__name__)


class PretrainedSource:
    """``module``: the model the weights are for; its ``checkpoint_conversion`` (when it has one) maps
    parameter names the files do not hold to the file tensors they are built from."""

    def __init__(self, path: str | os.PathLike, module: nn.Module | None = None) -> None:
        path = os.fspath(path)
        self.path = path
        self.state: Mapping[str, Tensor] = {}
        self.directory: SafetensorsDirectory | None = None
        # {parameter name: an object with ``sources`` (file keys) and ``combine(tensors) -> Tensor``}
        self.converted: Mapping[str, Any] = {}
        if os.path.isdir(path):
            self.directory = SafetensorsDirectory(path)
            conversion = getattr(module, "checkpoint_conversion", None)
            if conversion is not None:
                self.converted = conversion(self.directory.keys())
            return
        if not os.path.isfile(path):
            raise ValueError(f"pretrained='{path}' is not a file or a directory; pass a torch.save'd state dict, a Lightning "
                             ".ckpt or a HuggingFace model directory (model.safetensors or sharded)")
        try:
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # torch raises several types for foreign or corrupt files
            raise ValueError(f"pretrained='{path}' could not be read as a state dict: {err}") from None
        state = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else None
        if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
            raise ValueError(f"pretrained='{path}' holds no state dict of tensors")
        self.state = state

    def _names(self) -> list[str]:
        return self.directory.keys() if self.directory is not None else list(self.state)

    def _find(self, name: str) -> str | None:
        """The source's key for parameter ``name``, or None."""
        if name in self.converted:
            return name
        names = [name]
        if ".base_layer." in name:  # peft wraps a layer it adapts: "q_proj.weight" is now "q_proj.base_layer.weight"
            names.append(name.replace(".base_layer.", "."))
        if self.directory is not None:
            # A trunk-only HF checkpoint stores "h.0.attn..." where the causal LM says "transformer.h.0.attn...".
            names += [n.split(".", 1)[1] for n in names if "." in n]
        return next((n for n in names if n in (self.directory if self.directory is not None else self.state)), None)

    def __contains__(self, name: str) -> bool:
        return self._find(name) is not None

    def check_unexpected(self, module: nn.Module) -> list[str]:
        """Refuse a source holding tensors ``module`` has no entry for (its ``state_dict`` names, peft's
        ``base_layer`` and trunk-only names included): loading would drop them without a word, e.g. a
        config with fewer layers than the checkpoint. ``module.ignore_unexpected_keys = True`` allows it
        (logged); keys matching ``module.ignored_checkpoint_keys`` (regular expressions, HF's
        ``_keys_to_ignore_on_load_unexpected``) are never counted. Returns the unexpected keys. Reads
        names only (headers), no tensor."""
        claimed = {self._find(name) for name in module.state_dict(keep_vars=True)}
        claimed |= {key for name in claimed if name in self.converted for key in self.converted[name].sources}
        patterns = tuple(getattr(module, "ignored_checkpoint_keys", ()) or ())
        unexpected = sorted(name for name in self._names()
                            if name not in claimed and not any(re.search(p, name) for p in patterns))
        if not unexpected:
            return []
        listed = ", ".join(unexpected[:8]) + (f", ... ({len(unexpected)} in all)" if len(unexpected) > 8 else "")
        if getattr(module, "ignore_unexpected_keys", False):
            log.warning("pretrained='%s': ignoring %d tensor(s) the model has no parameter for "
                        "(ignore_unexpected_keys=True): %s", self.path, len(unexpected), listed)
            return unexpected
        raise ValueError(
            f"pretrained='{self.path}' holds tensors the model has no parameter for: {listed}. Loading would "
            "silently drop them (e.g. a config with fewer layers than the checkpoint: num_hidden_layers / n_layer). "
            "Build the model from the checkpoint's own config, or pass ignore_unexpected_keys=True "
            "(HFCausalLM(..., ignore_unexpected_keys=True); another LayeredModule: set its attribute "
            "ignore_unexpected_keys = True) to load only the tensors the model has")

    def tensor(self, name: str, shape: torch.Size | None = None) -> Tensor:
        """Parameter ``name`` as the source stores it; ``shape``, when given, is checked."""
        found = self._find(name)
        if found is None:
            raise ValueError(f"pretrained='{self.path}' has no entry '{name}' (it has e.g. "
                             f"{sorted(self._names())[:5]}); the weights must come from the same model class")
        if found in self.converted:
            recipe = self.converted[found]
            value = recipe.combine([self.directory.read(key) for key in recipe.sources])
        else:
            value = self.directory.read(found) if self.directory is not None else self.state[found]
        if shape is not None and value.shape != shape:
            raise ValueError(f"pretrained '{name}' has shape {tuple(value.shape)}, the model expects {tuple(shape)}")
        return value

    def unit_flat(self, layout: UnitLayout, first_block: int, prefix: str, dtype: torch.dtype,
                  adapter_init: Callable[[nn.Module], None] | None = None) -> Tensor:
        """The unit's flat vector, read entry by entry from the source. With ``adapter_init``
        (``adapters.adapter_initializer``), peft adapter parameters the source lacks (a base model's
        directory has none) are initialised as peft does instead."""
        flat = torch.zeros(layout.numel, dtype=dtype)  # zeros: the page padding after the trainable part
        fresh: dict[int, dict[str, Tensor]] = {}
        for s in layout.slots:
            name = f"{prefix}.{first_block + s.block}.{s.name}"
            if adapter_init is not None and name not in self:
                if s.block not in fresh:
                    fresh[s.block] = fresh_adapter_values(layout.blocks[s.block], adapter_init)
                value = fresh[s.block].get(s.name)
                if value is None:
                    self.tensor(name, s.shape)  # not an adapter either: the source's error names it
            else:
                value = self.tensor(name, s.shape)
            flat[s.offset:s.offset + s.numel].copy_(value.reshape(-1))
        return flat

    def close(self) -> None:
        self.state = {}  # drops the mmap
        if self.directory is not None:
            self.directory.close()
