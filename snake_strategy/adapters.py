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
"""
from __future__ import annotations

import os
from typing import Any

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
