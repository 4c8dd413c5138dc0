"""peft LoRA models after (or during) training: the adapter directory, and the merged HF model.

``save_adapter`` is ``peft_model.save_pretrained`` with the trained values, also *during* fit (a callback,
a checkpoint hook), when they live in the engine's tiers: it reads the trainable parts only, one unit at a
time, never the base weights. ``export_merged_hf`` writes the model with every LoRA layer merged into its
base weight, streamed one unit at a time. (How adapters are initialised on a meta-built model is
sources/lora_init.py.)
"""
from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from snake_strategy.engine.view import running_engine
from snake_strategy.hf.export import export_hf, master_dtype, module_weights
from snake_strategy.hf.model import HFCausalLM
from snake_strategy.sources.lora_init import is_lora_layer, needs_base, needs_base_error, refuse_base_inits_on_meta

try:  # the optional [peft] extra
    from peft.tuners.lora.layer import LoraLayer
except ImportError:
    pass
else:  # peft's own get_peft_model on a meta-built model: the ValueError naming the fix, not set_data's
    refuse_base_inits_on_meta(LoraLayer)


def trained_parameters(module: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters of ``module`` by name (CPU copies): from the greedysnake engine while it
    trains the module, else from the module itself."""
    engine = running_engine(module)
    if engine is None:
        return {name: p.detach().cpu().clone() for name, p in module.named_parameters() if p.requires_grad}
    return dict(engine.trainable_named_weights())


def save_adapter(peft_model: Any, out_dir: str | os.PathLike, **kwargs: Any) -> None:
    """``peft_model.save_pretrained(out_dir)`` with the trained adapter values, during or after fit.

    The directory loads with ``peft.PeftModel.from_pretrained(base_model, out_dir)``; ``kwargs`` go to
    ``save_pretrained`` (e.g. ``safe_serialization``).
    """
    module = peft_model.base_model.model
    if not hasattr(module, "blocks"):
        raise ValueError("save_adapter expects peft.get_peft_model(<LayeredModule>, config), whose "
                         "base_model.model is the LightningModule that was trained")
    # peft names the wrapped module's entries base_model.model.<name>; it keeps the adapter's own.
    state = {f"base_model.model.{name}": value for name, value in trained_parameters(module).items()}
    peft_model.save_pretrained(os.fspath(out_dir), state_dict=state, **kwargs)


def merged_weights(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The trained weights of a peft-wrapped ``HFCausalLM`` with every LoRA layer merged into its base
    weight, by the base model's names (``...q_proj.weight``): the state ``merge_and_unload`` would give,
    read one unit at a time (``hf.module_weights``), never the whole model.

    The delta is peft's own (``get_delta_weight``: scaling, ``fan_in_fan_out``, rsLoRA), computed in a
    copy of the layer that holds only the adapters, then added to the base weight in its dtype.
    """
    layers = {path: layer for path, layer in module.named_modules() if is_lora_layer(layer)}
    for path, wrapper in module.named_modules():
        if hasattr(wrapper, "modules_to_save") and hasattr(wrapper, "original_module"):
            raise ValueError(f"merged export does not handle peft's modules_to_save (on '{path}'): save the adapter "
                             "with save_adapter and merge with peft, or train without modules_to_save")
    for path, layer in layers.items():
        for adapter in layer.active_adapters:
            if layer.use_dora.get(adapter, False):
                raise ValueError(f"merged export of a DoRA adapter ('{path}', use_dora=True) is not supported: save the "
                                 "adapter with save_adapter and merge it with peft")
    expected = {path: {name for name, _ in layer.named_parameters()} for path, layer in layers.items()}
    pending: dict[str, dict[str, Tensor]] = {}
    for name, tensor in module_weights(module):
        path = _owning_layer(name, layers)
        if path is None:
            yield name, tensor
            continue
        parts = pending.setdefault(path, {})
        parts[name[len(path) + 1:]] = tensor
        if set(parts) == expected[path]:  # a layer's parts all come from the same unit
            yield from _merge_layer(path, layers[path], pending.pop(path))
    assert not pending, f"LoRA layers left incomplete: {sorted(pending)}"


def _owning_layer(name: str, layers: dict[str, nn.Module]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:end]) in layers:
            return ".".join(parts[:end])
    return None


def _merge_layer(path: str, layer: nn.Module, parts: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    # A copy of the layer whose adapters hold the trained values (assign=True also replaces meta tensors);
    # its base layer is a meta copy, so the copy costs the adapters only.
    memo = {id(p): torch.empty_like(p, device="meta") for p in layer.base_layer.parameters()}
    real = copy.deepcopy(layer, memo)
    real.load_state_dict({k: v for k, v in parts.items() if not k.startswith("base_layer.")}, strict=False,
                         assign=True)
    base = {k[len("base_layer."):]: v for k, v in parts.items() if k.startswith("base_layer.")}
    weight = base.pop("weight").clone()  # a copy: the source may be the module's own parameter
    with torch.no_grad():
        for adapter in real.active_adapters:
            if adapter in real.lora_A or adapter in real.lora_embedding_A:
                weight += real.get_delta_weight(adapter).to(weight.dtype)
    yield f"{path}.weight", weight
    for name, value in base.items():  # the bias, untouched by LoRA
        yield f"{path}.{name}", value


def export_merged_hf(model: Any, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None,
                     max_shard_bytes: int = 5 * 2**30, progress: Any = None) -> list[str]:
    """Write the LoRA-merged model as a HF directory (``config.json`` + sharded safetensors) that
    ``AutoModelForCausalLM.from_pretrained`` loads, streamed one unit at a time: during fit (weights in
    the engine's tiers) or after it. ``model``: the peft model or the ``HFCausalLM`` it wraps.
    Returns the weight files written. ``dtype``: of the files; None keeps the master dtype
    (``export.master_dtype``)."""
    module = model.base_model.model if hasattr(model, "base_model") and hasattr(model, "peft_config") else model
    if not isinstance(module, HFCausalLM):
        raise ValueError("export_merged_hf expects peft.get_peft_model(<HFCausalLM>, config) or that HFCausalLM; "
                         f"got {type(module).__name__}")
    return export_hf(merged_weights(module), out_dir, config=module.hf_config, dtype=dtype or master_dtype(module),
                     max_shard_bytes=max_shard_bytes, progress=progress)


def get_peft_model(module: nn.Module, config: Any, **kwargs: Any) -> Any:
    """``peft.get_peft_model(module, config, **kwargs)``, also for a module whose base is on the meta device
    (``HFCausalLM(dir)`` before ``configure_model``, or a model built under ``torch.device("meta")``).

    Inits that derive the adapter from the base weights (PiSSA, OLoRA, ...) cannot run on a meta base. peft's
    own call stops at the first such layer (importing this package makes peft's init methods raise the
    ValueError that names the fix: ``sources.lora_init.refuse_base_inits_on_meta``); this one refuses
    every init other than True, False and "gaussian" on a meta base before peft touches the model, with
    the same ValueError the engine raises for them (``sources.lora_init.adapter_initializer``). Other
    inits behave as with peft: the engine initialises the meta adapters as peft does.
    """
    import peft  # the optional [peft] extra: only this function needs it

    how = getattr(config, "init_lora_weights", True)
    if needs_base(how) and any(p.is_meta for p in module.parameters()):
        raise needs_base_error(how, "the adapters")
    return peft.get_peft_model(module, config, **kwargs)
