"""LoRA adapters on a model built on the meta device: initialised as ``get_peft_model`` does.

A peft model (``peft.get_peft_model(module, LoraConfig(...))``) wraps the LightningModule in place: the
module keeps its ``blocks`` and stages, the LoRA layers become parts of the blocks, and every base
weight gets ``requires_grad=False``. The strategy trains it like any model with frozen parameters
(docs/design.md, "Frozen parameters"): the adapter lives in its unit's trainable part, the base weights
are only ever read.

Saving the adapter and the merged model is hf/lora.py.

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
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def is_lora_layer(module: nn.Module) -> bool:
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
        if not is_lora_layer(module):
            return
        for adapter in list(module.lora_A.keys()) + list(module.lora_embedding_A.keys()):
            how = getattr(configs.get(adapter), "init_lora_weights", True)
            if needs_base(how):
                raise needs_base_error(how, f"the adapter '{adapter}'")
            if how is False:  # peft keeps the nn.Linear constructors' init
                for name in ("lora_A", "lora_B"):
                    getattr(module, name)[adapter].reset_parameters()
            else:
                module.reset_lora_parameters(adapter, how)

    return init


def needs_base(how: Any) -> bool:
    """Whether ``init_lora_weights=how`` derives the adapter from the base weights (PiSSA, OLoRA, LoftQ, ...)."""
    return not (how is True or how is False or (isinstance(how, str) and how.lower() == "gaussian"))


def needs_base_error(how: Any, what: str) -> ValueError:
    return ValueError(f"LoraConfig(init_lora_weights={how!r}) computes {what} from the base weights, which a model "
                      "built on the meta device does not hold: build the base model for real before get_peft_model "
                      "(HFCausalLM: call module.configure_model() first, which loads the directory's weights on the "
                      "CPU), or use init_lora_weights=True or 'gaussian'")


# peft's LoraLayer methods that compute the adapters from the base weight's values (``update_layer`` calls
# them for init_lora_weights "pissa*", "olora", "corda*", "mica", "loftq"). Not "orthogonal" (only the
# base's dtype) nor "lora_ga" (a gradient peft attaches beforehand): peft's call goes through for those.
BASE_READING_INITS = ("pissa_init", "olora_init", "corda_init", "mica_init", "loftq_init")


def refuse_base_inits_on_meta(lora_layer_class: type) -> None:
    """Make peft's base-reading LoRA inits (methods of ``lora_layer_class``, peft's ``LoraLayer``) raise
    ``needs_base_error`` when the base weight is on the meta device and the adapters are not, i.e. when
    ``peft.get_peft_model`` wraps a meta-built model (``HFCausalLM(dir)``) outside a meta device context.

    Why a wrapper around peft's methods: unwrapped, peft computes meta adapters from the meta base and then
    fails at ``lora_A.weight.data = <meta tensor>`` with ``RuntimeError: Attempted to call
    variable.set_data(tensor) ...``, which names neither the init nor the fix, and no code of this project
    runs during that call before it fails. Under ``torch.device("meta")`` the adapters are meta too and
    peft's call goes through unchanged (the engine refuses the init at setup, ``adapter_initializer``).
    Idempotent."""
    for name in BASE_READING_INITS:
        method = lora_layer_class.__dict__.get(name)
        if method is None or getattr(method, "refuses_meta_base", False):
            continue
        setattr(lora_layer_class, name, _refusing_meta_base(name, method))


def _refusing_meta_base(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def init(self: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        if self.get_base_layer().weight.is_meta and not self.lora_A[adapter_name].weight.is_meta:
            # pissa_init / corda_init get the config's init_lora_weights ("pissa_niter_4"); the others the name
            how = args[0] if args and isinstance(args[0], str) else name.removesuffix("_init")
            raise needs_base_error(how, f"the adapter '{adapter_name}'")
        return method(self, adapter_name, *args, **kwargs)

    init.refuses_meta_base = True  # type: ignore[attr-defined]
    return init


def adapter_parameter_ids(module: nn.Module) -> set[int]:
    """``id`` of every peft adapter parameter in ``module`` (``lora_A``, ``lora_B``, ... of its LoRA layers):
    the parameters a base model's weights do not hold."""
    return {id(p) for layer in module.modules() if is_lora_layer(layer)
            for name in layer.adapter_layer_names for p in getattr(layer, name).parameters()}


def fresh_adapter_values(block: nn.Module, init: Callable[[nn.Module], None]) -> dict[str, Tensor]:
    """Initial values of a block's adapter parameters, by parameter name inside the block: what a
    pretrained source lacks. Adapters on the meta device are initialised with ``init``
    (``adapter_initializer``) in a copy of their LoRA layer (only the adapters get storage; the base layer
    stays on the meta device); materialized ones keep their values."""
    values: dict[str, Tensor] = {}
    for path, layer in block.named_modules():
        if not is_lora_layer(layer):
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
        if is_lora_layer(mod):
            fresh = {f"{path}.{name}": value for name, value in fresh_adapter_values(mod, init).items()}
            values.update({name: value for name, value in fresh.items() if missing(name)})
            return
        for name, child in mod.named_children():
            walk(child, f"{path}.{name}" if path else name)

    walk(module, "")
    return values

