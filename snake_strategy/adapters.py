"""Parameter-efficient fine-tuning: save what was trained, without the frozen base weights.

A peft model (``peft.get_peft_model(module, LoraConfig(...))``) wraps the LightningModule in place: the
module keeps its ``blocks`` and stages, the LoRA layers become parts of the blocks, and every base
weight gets ``requires_grad=False``. The strategy trains it like any model with frozen parameters
(docs/design.md, "Frozen parameters"): the adapter lives in its unit's trainable part, the base weights
are only ever read.

After ``fit`` the module holds the trained weights (teardown gives them back), so
``peft_model.save_pretrained(dir)`` works as usual. ``save_adapter`` does the same also *during* fit
(a callback, a checkpoint hook), when the trained values live in the engine's tiers: it reads the
trainable parts only, one unit at a time, never the base weights.

A model built on the meta device (a big base streamed in by the strategy) can get its adapters before
fit too: peft then moves them to the meta device with their base layers, dropping its initial values.
The engine initialises them again when it materializes each unit, as ``get_peft_model`` does
(``reset_lora_parameters`` with the config's ``init_lora_weights``: A Kaiming-uniform, B zero), after
the model's own init of the unit or around the base weights streamed from ``pretrained``
(``adapter_initializer``). Inits that derive the adapter from the base weights (PiSSA, OLoRA, LoftQ, ...)
need the base in memory and are refused for meta-built models.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn


def trained_parameters(module: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters of ``module`` by name (CPU copies): from the greedysnake engine while it
    trains the module, else from the module itself."""
    trainer = getattr(module, "_trainer", None)
    engine = getattr(trainer.strategy, "engine", None) if trainer is not None else None
    if engine is None:
        return {name: p.detach().cpu().clone() for name, p in module.named_parameters() if p.requires_grad}
    state = engine.nonlayer_state()  # flushes pending updates first
    out = dict(zip(state["names"], state["master"]))
    for u in range(engine.num_units):
        flat = engine.unit_state(u)["master"]  # the unit's trainable part only
        out.update({name: flat[offset:offset + numel].view(shape).clone()
                    for name, shape, offset, numel in engine.unit_slots(u)})
    return out


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
    from snake_strategy.hf import module_weights  # the optional [hf] extra

    layers = {path: layer for path, layer in module.named_modules() if _is_lora_layer(layer)}
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
    Returns the weight files written. ``dtype``: of the files; None keeps the master dtype (``hf.master_dtype``).
    """
    from snake_strategy.hf import HFCausalLM, export_hf, master_dtype  # the optional [hf] extra

    module = model.base_model.model if hasattr(model, "base_model") and hasattr(model, "peft_config") else model
    if not isinstance(module, HFCausalLM):
        raise ValueError("export_merged_hf expects peft.get_peft_model(<HFCausalLM>, config) or that HFCausalLM; "
                         f"got {type(module).__name__}")
    return export_hf(merged_weights(module), out_dir, config=module.hf_config, dtype=dtype or master_dtype(module),
                     max_shard_bytes=max_shard_bytes, progress=progress)


def adapter_parameter_ids(module: nn.Module) -> set[int]:
    """``id`` of every peft adapter parameter in ``module`` (``lora_A``, ``lora_B``, ... of its LoRA layers):
    the parameters a base model's weights do not hold."""
    return {id(p) for layer in module.modules() if _is_lora_layer(layer)
            for name in layer.adapter_layer_names for p in getattr(layer, name).parameters()}


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A")


def adapter_initializer(root: nn.Module) -> Callable[[nn.Module], None] | None:
    """For a model that peft wrapped (``root.peft_config``, set by ``get_peft_model``): a function that
    initialises the adapters of one LoRA layer as ``get_peft_model`` did; None for other models.

    Called on a LoRA layer after its children (``nn.Module.apply`` order), it overrides whatever the
    model's own init put into the adapter's ``nn.Linear`` children."""
    configs = getattr(root, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None

    def init(module: nn.Module) -> None:
        if not _is_lora_layer(module):
            return
        for adapter in list(module.lora_A.keys()) + list(module.lora_embedding_A.keys()):
            how = getattr(configs.get(adapter), "init_lora_weights", True)
            if _needs_base(how):
                raise _needs_base_error(how, f"the adapter '{adapter}'")
            if how is False:  # peft keeps the nn.Linear constructors' init
                for name in ("lora_A", "lora_B"):
                    getattr(module, name)[adapter].reset_parameters()
            else:
                module.reset_lora_parameters(adapter, how)

    return init


def _needs_base(how: Any) -> bool:
    """Whether ``init_lora_weights=how`` derives the adapter from the base weights (PiSSA, OLoRA, LoftQ, ...)."""
    return not (how is True or how is False or (isinstance(how, str) and how.lower() == "gaussian"))


def _needs_base_error(how: Any, what: str) -> ValueError:
    return ValueError(f"LoraConfig(init_lora_weights={how!r}) computes {what} from the base weights, which a model "
                      "built on the meta device does not hold: build the base model for real before get_peft_model "
                      "(HFCausalLM: call module.configure_model() first, which loads the directory's weights on the "
                      "CPU), or use init_lora_weights=True or 'gaussian'")


def get_peft_model(module: nn.Module, config: Any, **kwargs: Any) -> Any:
    """``peft.get_peft_model(module, config, **kwargs)``, also for a module whose base is on the meta device
    (``HFCausalLM(dir)`` before ``configure_model``, or a model built under ``torch.device("meta")``).

    peft's own call fails there for inits that derive the adapter from the base weights (PiSSA, OLoRA:
    ``RuntimeError: Attempted to call variable.set_data(tensor), but variable and tensor have
    incompatible tensor type`` from inside peft, which names neither the init nor the fix; no code of this
    project runs inside that call, so it cannot be caught there); this one refuses every init other than
    True, False and "gaussian" on a meta base before peft runs, with the ValueError the engine raises for
    them (``adapter_initializer``). Other inits behave as with peft: the engine initialises the meta
    adapters as peft does.
    """
    import peft  # an optional dependency: only this function needs it

    meta = any(p.is_meta for p in module.parameters())
    how = getattr(config, "init_lora_weights", True)
    if meta and _needs_base(how):
        raise _needs_base_error(how, "the adapters")
    return peft.get_peft_model(module, config, **kwargs)


def fresh_adapter_values(block: nn.Module, init: Callable[[nn.Module], None]) -> dict[str, Tensor]:
    """Initial values of a block's adapter parameters, by parameter name inside the block: what a
    pretrained source lacks. Adapters on the meta device are initialised with ``init``
    (``adapter_initializer``) in a copy of their LoRA layer (only the adapters get storage; the base layer
    stays on the meta device); materialized ones keep their values."""
    values: dict[str, Tensor] = {}
    for path, layer in block.named_modules():
        if not _is_lora_layer(layer):
            continue
        real = layer
        if any(p.is_meta for name in layer.adapter_layer_names for p in getattr(layer, name).parameters()):
            real = copy.deepcopy(layer)  # meta tensors copy without storage
            for name in layer.adapter_layer_names:
                getattr(real, name).to_empty(device="cpu")
            with torch.no_grad():
                init(real)
        for name in layer.adapter_layer_names:
            for sub, p in getattr(real, name).named_parameters():
                values[f"{path + '.' if path else ''}{name}.{sub}"] = p.detach()
    return values


def nonlayer_adapter_values(module: nn.Module, init: Callable[[nn.Module], None] | None,
                            missing: Callable[[str], bool]) -> dict[str, Tensor]:
    """Initial values of the peft adapters outside ``module.blocks`` (a LoRA ``lm_head``, say) for which
    ``missing(name)`` holds (a base model's pretrained source has none), by parameter name in ``module``:
    initialised as ``get_peft_model`` does (``init`` from ``adapter_initializer``). Blocks are not visited
    (their adapters come with their unit), so no random number is drawn for them here."""
    values: dict[str, Tensor] = {}
    if init is None:
        return values

    def walk(mod: nn.Module, path: str) -> None:
        if mod is module.blocks:
            return
        if _is_lora_layer(mod):
            fresh = {f"{path}.{name}": value for name, value in fresh_adapter_values(mod, init).items()}
            values.update({name: value for name, value in fresh.items() if missing(name)})
            return
        for name, child in mod.named_children():
            walk(child, f"{path}.{name}" if path else name)

    walk(module, "")
    return values

