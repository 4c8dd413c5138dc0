"""The layered-model contract: what a LightningModule must declare so the strategy can stream it.

The strategy never calls a monolithic ``forward`` during training. It drives the model stage by stage:

    batch --pre_stage--> hidden --blocks[0]--> ... --blocks[N-1]--> hidden --post_stage--> outputs
    outputs, batch --compute_loss--> scalar loss (mean over the micro-batch)

``pre_stage`` and ``post_stage`` (embedding, final norm, head) are "non-layer" parameters that live on
the device for the whole run; the ``blocks`` are the offloaded part. Every block maps a hidden tensor
to a hidden tensor of the same shape and dtype, has no buffers that change during training, and
keeps no state between calls (the strategy re-runs blocks to recompute activations).
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn

CONTRACT_DOC = (
    "A LightningModule trained with strategy='greedysnake' must declare its layers: "
    "`blocks` (an nn.ModuleList of blocks, hidden -> hidden), `pre_stage(batch) -> hidden` "
    "(the embedding), `post_stage(hidden) -> outputs` (final norm + head) and "
    "`compute_loss(outputs, batch) -> scalar`. Subclass snake_strategy.LayeredModule to get "
    "forward/training_step/validation_step for free (see README, 'The model contract')."
)


def contract_violations(module: nn.Module) -> list[str]:
    """Return a human-readable list of what ``module`` lacks to follow the contract (empty if it follows it)."""
    problems = []
    blocks = getattr(module, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        problems.append("attribute `blocks` must be an nn.ModuleList of the repeated layers "
                        f"(found {type(blocks).__name__})")
    elif len(blocks) == 0:
        problems.append("`blocks` is empty: build the layers in __init__ or configure_model()")
    for name in ("pre_stage", "post_stage", "compute_loss"):
        if not callable(getattr(module, name, None)):
            problems.append(f"method `{name}` is missing")
    return problems


def check_contract(module: nn.Module) -> None:
    """Raise ValueError that names every missing piece if ``module`` does not follow the contract."""
    problems = contract_violations(module)
    if problems:
        raise ValueError(
            f"{type(module).__name__} does not follow the layered-model contract: "
            + "; ".join(problems) + ". " + CONTRACT_DOC
        )


class LayeredModule(pl.LightningModule):
    """Base class for models the greedysnake strategy can train.

    Subclasses implement ``pre_stage``, ``post_stage``, ``compute_loss`` and register ``self.blocks``
    (in ``__init__`` or, for big models, in ``configure_model``). ``forward``, ``training_step`` and
    ``validation_step`` then work the same under ``strategy="auto"`` (everything in memory) and under
    ``strategy="greedysnake"`` (blocks streamed from their storage tiers).
    """

    def pre_stage(self, batch: Any) -> Tensor | tuple[Tensor, dict[str, Any]]:
        """batch -> hidden, or (hidden, side): ``side`` holds keyword arguments every block receives."""
        raise NotImplementedError("implement pre_stage(batch) -> hidden (the embedding)")

    def post_stage(self, hidden: Tensor) -> Tensor:
        raise NotImplementedError("implement post_stage(hidden) -> outputs (final norm + head)")

    def compute_loss(self, outputs: Tensor, batch: Any) -> Tensor:
        raise NotImplementedError("implement compute_loss(outputs, batch) -> scalar mean loss")

    def init_module_weights(self, module: nn.Module) -> None:
        """Initialise one module's own parameters (called through ``nn.Module.apply``).

        The strategy materializes the model one unit at a time from the meta device and calls this on
        every sub-module in the same order as ``self.apply(self.init_module_weights)`` would, so a
        seeded run initialises the same numbers either way. The default defers to ``reset_parameters``.
        """
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()

    def forward(self, batch: Any) -> Tensor:
        strategy = self._trainer.strategy if self._trainer is not None else None
        streamed = getattr(strategy, "streamed_forward", None)
        if streamed is not None:
            # Under greedysnake the blocks live in their tiers: the strategy streams them in.
            return streamed(batch)
        hidden = self.pre_stage(batch)
        # pre_stage may add side inputs (rotary cos/sin, attention mask, ...) that every block receives
        # as keyword arguments: computed once per micro-batch, not trained through.
        side: dict[str, Any] = {}
        if isinstance(hidden, tuple):
            hidden, side = hidden
            if not isinstance(side, dict):
                raise ValueError(f"{type(self).__name__}.pre_stage returned a tuple whose second item is a "
                                 f"{type(side).__name__}; return `hidden` or `(hidden, side)` with `side` a dict "
                                 "of keyword arguments for every block")
        for block in self.blocks:
            hidden = block(hidden, **side)
        return self.post_stage(hidden)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        # Used by plain Lightning strategies only; greedysnake runs its own schedule.
        loss = self.compute_loss(self(batch), batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.compute_loss(self(batch), batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.compute_loss(self(batch), batch)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch)


def split_micro_batches(batch: Any, num_micro_batches: int) -> list[Any]:
    """Split every tensor of a (nested) batch along dim 0 into equal micro-batches.

    Raises ValueError when the batch size is not a multiple of ``num_micro_batches``.
    """
    sizes = {t.shape[0] for t in batch_tensors(batch)}
    if not sizes:
        raise ValueError("the batch holds no tensors to split into micro-batches")
    if len(sizes) != 1:
        raise ValueError(f"batch tensors disagree on dim 0 (sizes {sorted(sizes)}); cannot split into micro-batches")
    (size,) = sizes
    if size % num_micro_batches != 0:
        raise ValueError(
            f"global batch of {size} samples does not split into schedule.num_micro_batches="
            f"{num_micro_batches} equal micro-batches; make the DataLoader batch_size a multiple of "
            f"{num_micro_batches} (micro-batch size x num_micro_batches)"
        )
    step = size // num_micro_batches
    return [_map(batch, lambda t, i=i: t[i * step:(i + 1) * step]) for i in range(num_micro_batches)]


def batch_tensors(batch: Any) -> list[Tensor]:
    """Every tensor in a (nested) batch, in order."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in batch_tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in batch_tensors(v)]
    return []


def _map(batch: Any, fn) -> Any:
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _map(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_map(v, fn) for v in batch)
    if isinstance(batch, list):
        return [_map(v, fn) for v in batch]
    return batch
