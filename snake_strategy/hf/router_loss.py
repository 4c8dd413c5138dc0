"""The router's load-balancing loss of HF mixture-of-experts families, as their causal LM's forward adds it.

With ``output_router_logits`` and a non-zero ``router_aux_loss_coef`` in the config, HF's loss is the cross
entropy plus ``router_aux_loss_coef * load_balancing_loss_func(router logits of every layer, num_experts,
top_k, attention_mask)``, each family with its own copy of the function. ``HFCausalLM`` computes the same
through the contract's block outputs: each decoder layer returns its router logits (read where HF's own
output recorder reads them, ``_can_record_outputs["router_logits"]``), and the loss calls the family's
function on them.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import transformers
from torch import nn


@dataclass(frozen=True)
class RouterLoss:
    """The load-balancing loss a mixture-of-experts causal LM adds to its loss (HF's forward with labels and
    ``output_router_logits``): ``coefficient * function(router logits of every layer, num_experts, top_k,
    attention_mask)``, the family's own ``load_balancing_loss_func``."""

    router_class: type  # the module whose output holds a layer's router logits (HF's output recorder)
    index: int  # where in that output
    function: Any
    num_experts: int
    top_k: int
    coefficient: float


def router_loss_of(hf: nn.Module) -> RouterLoss | None:
    """The model's load-balancing loss, None when its loss has none (the config's ``output_router_logits``
    off, or a zero ``router_aux_loss_coef``); refused when the family does not say where its logits are."""
    config = hf.config
    coefficient = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(config, "output_router_logits", False) or coefficient == 0.0:
        return None
    recorder = (getattr(type(hf), "_can_record_outputs", None) or {}).get("router_logits")
    function = getattr(sys.modules[type(hf).__module__], "load_balancing_loss_func", None)
    if recorder is None or function is None or not hasattr(hf, "num_experts_per_tok"):
        raise ValueError(f"{config.model_type}: output_router_logits=True, but {type(hf).__name__} records no router "
                         "logits or has no load_balancing_loss_func in transformers "
                         f"{transformers.__version__}; set output_router_logits=False")
    return RouterLoss(recorder.target_class, recorder.index, function, int(hf.num_experts), int(hf.num_experts_per_tok),
                      coefficient)
