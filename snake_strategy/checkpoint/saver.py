"""The strategy's checkpoint saves and loads: what ``save_checkpoint``, ``load_checkpoint`` and the
preemption hooks of ``GreedySnakeStrategy`` delegate to, as Lightning's own FSDP strategy hands its
checkpoint I/O to module-level helpers.

``CheckpointSaver`` holds what lasts between saves of one fit: the saves a signal handler asked for in
the middle of a step (``DeferredSaves``), the preemption callback and whether it fired, how many
zero-copy (pinning) saves the fit made (the space check of the first one), the figures of the last save,
and, for an evaluation stage, the checkpoint opened before the engine exists. The choice of writer is
here too: with partitioned optimizer state every rank writes its shard (``shards.py``), else rank 0
alone writes one zero-copy directory (``store.py``).
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from snake_strategy.checkpoint import pins, shards, store
from snake_strategy.checkpoint.consolidate import CheckpointWeights
from snake_strategy.checkpoint.preemption import DeferredSaves, PreemptionSaver, save_on_preemption

if TYPE_CHECKING:
    from snake_strategy.engine.state.api import CheckpointedEngine
    from snake_strategy.planning.run_plan import RunPlan
    from snake_strategy.progress import Progress

log = logging.getLogger(__name__)


class CheckpointSaver:
    """One per strategy; ``start_fit`` resets what belongs to one fit. ``progress`` reports long saves
    and loads."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.deferred = DeferredSaves()  # saves a signal handler asked for mid-step
        self.preemption = PreemptionSaver()  # saves last.ckpt at the end of a SIGTERMed batch
        self.preempted = False  # SIGTERM: the checkpoint is written, teardown exits fast
        self.pinning_saves = 0  # zero-copy saves of this fit (the first one's growth is checked)
        self.last_save: dict[str, Any] = {}  # written_bytes, seconds, methods of the last checkpoint save
        self.eval_checkpoint: CheckpointWeights | None = None  # ckpt_path of an evaluation stage

    # ------------------------------------------------------------------ the fit around the saves
    @staticmethod
    def prepare_fit(plan: RunPlan, trainer: Any, is_global_zero: bool) -> None:
        """Before fit builds its engine: sweep what killed saves left in the checkpoint directories and check
        from the plan that the kept checkpoints fit (``pins.prepare_checkpoint_dirs``)."""
        pins.prepare_checkpoint_dirs(plan, trainer.checkpoint_callbacks, is_global_zero, store.sweep_and_log)

    def start_fit(self, engine: CheckpointedEngine, trainer: Any, is_global_zero: bool) -> None:
        """At the end of fit's setup: add the preemption callback."""
        self.preempted, self.pinning_saves = False, 0
        self.deferred = DeferredSaves()
        if not any(c is self.preemption for c in trainer.callbacks):
            trainer.callbacks.append(self.preemption)
        self.preemption.saved_step = None

    def step_started(self) -> None:
        """Until ``step_ended``, a save asked for waits for the step's end."""
        self.deferred.in_step = True

    def step_ended(self) -> None:
        self.deferred.in_step = False

    def run_deferred(self, trainer: Any) -> None:
        """The previous step is complete and counted: the moment for a save a signal handler asked for."""
        if self.deferred.pending:
            self.deferred.run(trainer)

    def on_exception(self, exception: BaseException, trainer: Any, training: bool) -> None:
        """A SIGTERM that ended a training run: the checkpoint of the last completed step is written (unless
        the callback already did at the batch's end), and teardown then skips the export."""
        if isinstance(exception, SIGTERMException) and training and trainer is not None:
            self.deferred.pending = []  # the preemption save covers them
            if self.preemption.saved_step != trainer.global_step:  # the signal came after the batch's end
                save_on_preemption(trainer)
            self.preempted = True

    # ------------------------------------------------------------------ save and load
    def save(self, engine: CheckpointedEngine, checkpoint: dict[str, Any], filepath: Any, trainer: Any,
             is_global_zero: bool, ssd_read_gb_per_s: float | None) -> None:
        """Write ``filepath`` during fit (``ssd_read_gb_per_s``: the probed rate that paces the background
        checksums; None for the nominal one)."""
        if self.deferred.in_step:
            # A signal handler's save (Lightning's SLURM requeue) in the middle of a step: at its end.
            log.warning("a checkpoint to %s was asked for in the middle of a step; it is written when the step "
                        "completes", filepath)
            self.deferred.pending.append(str(filepath))
            return
        sharded = engine.partitioned  # every rank writes its shard, rank 0 the manifest last
        if not sharded and is_global_zero:
            # Before the first byte: the growth this save's pinned versions may cause (the first one of the
            # fit; each one when every checkpoint is kept), and what it writes.
            keep_all = any(getattr(c, "save_top_k", 1) < 0 for c in trainer.checkpoint_callbacks)
            if self.pinning_saves == 0 or keep_all:
                pins.check_space(pins.state_bytes(engine), engine.ssd_path, os.path.dirname(os.path.abspath(filepath)),
                                 1, f"saving {filepath}")
            self.pinning_saves += 1
        if sharded:
            shards.save(engine, checkpoint, filepath, self.progress)
        elif is_global_zero:  # one writer, as DDPStrategy (replicated state); Lightning barriers after
            rate = pins.checksum_read_rate(ssd_read_gb_per_s)
            self.last_save = store.save(engine, checkpoint, filepath, self.progress, zero_copy=True,
                                        checksum_read_bytes_per_s=rate)

    def load(self, engine: CheckpointedEngine | None, checkpoint_path: Any, evaluating: bool, world_size: int,
             is_global_zero: bool, barrier: Callable[[str], None], optimizers: list) -> dict[str, Any]:
        """Lightning's checkpoint dict of ``checkpoint_path``. Training streams the state into the tiers
        setup built; evaluation restores before setup and only opens the checkpoint here: the engine is
        then built straight from its master weights, with no init and nothing written twice."""
        if os.path.isfile(checkpoint_path):
            raise ValueError(
                f"{checkpoint_path} is not a greedysnake checkpoint directory; to start from the weights of an "
                "ordinary state dict or .ckpt file, pass GreedySnakeStrategy(pretrained=path) instead of ckpt_path"
            )
        if evaluating:
            self.eval_checkpoint = CheckpointWeights(checkpoint_path)
            return self.eval_checkpoint.meta()
        if world_size > 1:  # rank 0 alone adopts a checkpoint a killed save left aside, then all read
            if is_global_zero:
                store.recover(checkpoint_path)
            barrier("greedysnake.load_checkpoint")
        checkpoint = store.load(engine, checkpoint_path, self.progress, recover=world_size == 1)
        # Lightning restores the LR schedulers, but the current lr lives in the optimizer's param_groups.
        for optimizer, saved in zip(optimizers, checkpoint.get("optimizer_states", [])):
            for group, saved_group in zip(optimizer.param_groups, saved.get("param_groups", [])):
                group.update(saved_group)
        return checkpoint

    def take_eval_checkpoint(self) -> CheckpointWeights | None:
        """The checkpoint ``load`` opened for this evaluation stage; the engine built from it owns it now."""
        checkpoint, self.eval_checkpoint = self.eval_checkpoint, None
        return checkpoint

    def close(self) -> None:
        """At teardown: a stage that failed between loading and setup leaves its checkpoint open."""
        if self.eval_checkpoint is not None:
            self.eval_checkpoint.close()
            self.eval_checkpoint = None


def check_save_request(filepath: Any, storage_options: Any, evaluating: bool) -> None:
    """Refuse the saves the strategy cannot write: a storage backend's options (it writes directories
    itself), and a save during validate/test/predict (the evaluation engine has no optimizer state)."""
    if storage_options is not None:
        raise ValueError("strategy='greedysnake' writes checkpoint directories itself; storage_options is not supported")
    if evaluating:
        raise ValueError(f"cannot save {filepath} during trainer.validate/test/predict with strategy='greedysnake': "
                         "the evaluation engine holds the weights only (no optimizer state). Save during fit "
                         "(ModelCheckpoint), or after it")


def save_after_fit(checkpoint: dict[str, Any], filepath: Any, write: Callable[[dict, Any], None] | None) -> None:
    """A save after fit: the module holds the trained weights (teardown gave them back) and the optimizer
    state is gone with the run, so an ordinary Lightning file, loadable by ``load_from_checkpoint``,
    written by ``write`` (the strategy's checkpoint_io; None on the ranks that do not write)."""
    log.warning("saving %s after fit: the trained weights are in it, the Adam moments are not (they end "
                "with the run); to resume training exactly, checkpoint during fit (ModelCheckpoint)", filepath)
    if write is not None:
        write(checkpoint, filepath)


def nonlayer_state_dict(engine: Any, module: torch.nn.Module) -> dict[str, Any]:
    """The module's state dict without block weights (per-unit files of ``save``, streamed from their tiers,
    never the whole model in memory) and without frozen parameters (the base model's: checkpoints record
    their checksums, not a copy). ``consolidate`` makes one ordinary file."""
    engine.flush()
    block_keys = {f"{engine.blocks_prefix}.{k}" for k in module.blocks.state_dict()}
    frozen = {k for k, v in module.state_dict(keep_vars=True).items()
              if isinstance(v, torch.nn.Parameter) and not v.requires_grad}
    return {k: v for k, v in module.state_dict().items() if k not in block_keys | frozen}


def optimizer_hyperparameters(optimizer: Any) -> dict[str, Any]:
    """What a checkpoint keeps of the user's optimizer: its param_groups' hyper-parameters, which an LR
    scheduler may have changed. The Adam moments live in the engine's tiers and ``save`` writes them."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def remove(filepath: Any, remove_file: Callable[[Any], None]) -> None:
    """Top-k rotation: a directory checkpoint is renamed aside, then unlinked (``store.release``); a file
    (saved after fit) goes through ``remove_file``, the strategy's checkpoint_io."""
    if os.path.isdir(filepath):
        store.release(filepath)
    else:
        remove_file(filepath)
