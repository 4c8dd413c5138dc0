"""Preemption: SIGTERM (and the SLURM requeue signal) end a run with a zero-copy checkpoint of its last
completed step.

Lightning's own handler turns SIGTERM into a flag; the current step runs to its end (a step of the
schedule cannot be cut: its units are updated while its backward runs). At the end of that batch
(``on_train_batch_end``, where ModelCheckpoint saves, so the loops' state is the one a resume expects)
the ``PreemptionSaver`` callback (added by ``saver.CheckpointSaver``) commits ``last.ckpt`` (``last_checkpoint_path``);
Lightning then raises ``SIGTERMException``. Should the signal land after that hook, the strategy's
``on_exception`` saves instead (``CheckpointSaver.on_exception``) (the loops then count the batch as complete: the weights are the same,
the resumed data order may differ). Being zero-copy, that save writes the host-tier and non-layer state and the manifest
only, and links the SSD files: seconds, not minutes. Teardown then skips giving the weights back to the
module (the process is exiting; the checkpoint holds them). A second SIGTERM during that save only sets
Lightning's flag again; a SIGKILL leaves the previous ``last`` intact (atomic replacement).

Lightning's SLURM requeue handler calls ``trainer.save_checkpoint`` from inside the signal handler, which
may land in the middle of a step. The saver then defers that save to the end of the step
(``DeferredSaves``): a checkpoint of a half-updated model would not resume exactly.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import lightning.pytorch as pl

log = logging.getLogger(__name__)


def last_checkpoint_path(trainer: Any) -> str:
    """Where a preempted run writes its checkpoint: the first ModelCheckpoint's ``last.ckpt`` (what
    ``fit(ckpt_path="last")`` finds), else ``<default_root_dir>/last.ckpt``."""
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        dirpath = getattr(callback, "dirpath", None)
        if dirpath:
            return os.path.join(dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
    return os.path.join(trainer.default_root_dir, "last.ckpt")


def save_on_preemption(trainer: Any) -> str:
    """Commit the checkpoint of the last completed step (called from ``on_exception(SIGTERMException)``)."""
    path = last_checkpoint_path(trainer)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    trainer.save_checkpoint(path)
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        if getattr(callback, "dirpath", None) and os.path.dirname(path) == callback.dirpath:
            callback.last_model_path = path  # as if ModelCheckpoint(save_last=True) had written it
            break
    log.warning("SIGTERM: saved the last completed step (%d) to %s; resume with fit(ckpt_path=%r)",
                trainer.global_step, path, "last" if trainer.checkpoint_callbacks else path)
    return path


class DeferredSaves:
    """Saves asked for in the middle of a step (a signal handler's), done once the step is complete."""

    def __init__(self) -> None:
        self.in_step = False
        self.pending: list[str] = []

    def run(self, trainer: Any) -> None:
        pending, self.pending = self.pending, []
        for path in pending:
            log.info("saving %s, asked for during the step that just ended", path)
            trainer.save_checkpoint(path)


class PreemptionSaver(pl.Callback):
    """Added by the strategy: at the end of the batch during which SIGTERM arrived, save ``last``."""

    def __init__(self) -> None:
        self.saved_step: int | None = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.received_sigterm and self.saved_step != trainer.global_step:
            save_on_preemption(trainer)
            self.saved_step = trainer.global_step
