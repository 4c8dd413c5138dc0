"""``LayeredModule``: the base class of models the greedysnake strategy trains (contract in contract.py)."""
from __future__ import annotations

import io
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from torch import Tensor, nn

from snake_strategy.checkpoint.consolidate import load_consolidated, load_consolidated_with_base
from snake_strategy.checkpoint.format import is_checkpoint_dir
from snake_strategy.checkpoint.store import wrong_strategy_error
from snake_strategy.contract import check_block_output, unpack_pre_stage
from snake_strategy.engine.view import running_engine
from snake_strategy.units import reset_own_parameters


class LayeredModule(pl.LightningModule):
    """Base class for models the greedysnake strategy can train.

    Subclasses implement ``pre_stage``, ``post_stage``, ``compute_loss`` and register ``self.blocks``
    (in ``__init__`` or, for big models, in ``configure_model``). ``forward``, ``training_step``,
    ``validation_step``, ``test_step`` and ``predict_step`` then work the same under ``strategy="auto"``
    (everything in memory) and under ``strategy="greedysnake"`` (blocks streamed from their tiers).
    """

    # True when every block computes each sample from that sample alone (no BatchNorm, no attention across
    # the batch): the planner (``schedule.kind="auto"``) may then run a unit's micro-batches as one batched
    # pass, which is only exact for such blocks. False (the default) keeps passes per micro-batch.
    independent_samples: bool = False
    # A ``pretrained`` source holding tensors the model has no parameter for is refused (loading would drop
    # them silently, e.g. a config with fewer layers than the checkpoint); True loads the rest (logged).
    ignore_unexpected_keys: bool = False
    # True when the loss reads an output of every block besides its hidden state (a mixture of experts'
    # router logits for a load-balancing loss): every block returns ``(hidden, output)`` (output: the samples
    # as dim 0) and ``compute_loss(outputs, batch, block_outputs)`` gets the list of every block's output, in
    # block order, for that micro-batch. The strategy keeps them from the forward and sends the loss's
    # gradient back into each block's backward (docs/guide/model-contract.md, "Block outputs for the loss").
    loss_reads_block_outputs: bool = False

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
        seeded run initialises the same numbers either way. The default is the module's own
        ``reset_parameters`` (``units.reset_own_parameters``).
        """
        reset_own_parameters(module)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, base: Any = None, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``, which also reads a greedysnake checkpoint directory
        (consolidated in memory on the fly: the whole model is held about twice while loading). A
        fine-tuning checkpoint's frozen weights come from ``base`` (a HF directory, a state-dict or
        ``.ckpt`` file; checked against the checkpoint's CRC-32s)."""
        if isinstance(checkpoint_path, (str, os.PathLike)) and is_checkpoint_dir(checkpoint_path):
            buffer = io.BytesIO()
            if base is not None:
                consolidated = load_consolidated_with_base(checkpoint_path, base)
            else:
                consolidated = load_consolidated(checkpoint_path)
            torch.save(consolidated, buffer)
            buffer.seek(0)
            checkpoint_path = buffer
            kwargs.setdefault("weights_only", False)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def setup(self, stage: str) -> None:
        # A plain strategy cannot read a greedysnake checkpoint directory (IsADirectoryError deep inside
        # fsspec): make its checkpoint IO say what the directory is and how to use it.
        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy is not None and not hasattr(strategy, "streamed_forward") and \
                not isinstance(strategy.checkpoint_io, _SnakeDirAwareIO):
            strategy.checkpoint_io = _SnakeDirAwareIO(strategy.checkpoint_io)

    def forward(self, batch: Any) -> Tensor:
        return self.forward_with_block_outputs(batch)[0]

    def forward_with_block_outputs(self, batch: Any) -> tuple[Tensor, list[Tensor]]:
        """``(outputs, block_outputs)``: the post-stage outputs and, when ``loss_reads_block_outputs``, every
        block's output for the loss (else an empty list)."""
        if running_engine(self) is not None:
            # Under greedysnake the blocks live in their tiers: the strategy streams them in.
            return self._trainer.strategy.streamed_forward(batch, with_block_outputs=True)
        with_output = self.loss_reads_block_outputs
        hidden, side = unpack_pre_stage(self.pre_stage(batch))
        block_outputs = []
        for i, block in enumerate(self.blocks):
            out = check_block_output(block(hidden, **side), i, with_output)
            if with_output:
                hidden, output = out
                block_outputs.append(output)
            else:
                hidden = out
        return self.post_stage(hidden), block_outputs

    def batch_loss(self, batch: Any) -> Tensor:
        """``compute_loss`` of a forward over ``batch`` (with the block outputs when the loss reads them)."""
        outputs, block_outputs = self.forward_with_block_outputs(batch)
        if self.loss_reads_block_outputs:
            return self.compute_loss(outputs, batch, block_outputs)
        return self.compute_loss(outputs, batch)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        # Used by plain Lightning strategies only; greedysnake runs its own schedule.
        loss = self.batch_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.batch_loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.batch_loss(batch)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch)


class _SnakeDirAwareIO(CheckpointIO):
    """Delegates to a plain strategy's checkpoint IO; refuses greedysnake directories with the fix."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(path, (str, os.PathLike)) and is_checkpoint_dir(path):
            raise wrong_strategy_error(path)
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()

