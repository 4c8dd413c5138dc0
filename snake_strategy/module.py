"""``LayeredModule``: the base class of models the greedysnake strategy trains (contract in contract.py)."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn

from snake_strategy.contract import check_block_output, unpack_pre_stage


class LayeredModule(pl.LightningModule):
    """Base class for models the greedysnake strategy can train.

    Subclasses implement ``pre_stage``, ``post_stage``, ``compute_loss`` and register ``self.blocks``
    (in ``__init__`` or, for big models, in ``configure_model``). ``forward``, ``training_step``,
    ``validation_step``, ``test_step`` and ``predict_step`` then work the same under ``strategy="auto"``
    (everything in memory) and under ``strategy="greedysnake"`` (blocks streamed from their tiers).
    """

    def pre_stage(self, batch: Any) -> Tensor | tuple[Tensor, dict[str, Any]]:
        raise NotImplementedError("implement pre_stage(batch) -> hidden (the embedding), or (hidden, side_inputs)")

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
        if streamed is not None and getattr(strategy, "engine", None) is not None:
            # Under greedysnake the blocks live in their tiers: the strategy streams them in.
            return streamed(batch)
        hidden, side = unpack_pre_stage(self.pre_stage(batch))
        for i, block in enumerate(self.blocks):
            hidden = check_block_output(block(hidden, **side), i)
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
