"""Checkpoint directories in Lightning's lifecycle: top-k removal, ``ckpt_path="last"``, resuming in
the middle of an epoch, and the refusal of a second live run on the same ``ssd_dir``."""
import os

import lightning as L
import pytest

from snake_strategy import checkpoint as snake_checkpoint
from tests.helpers import TWO_EPOCHS, ResumableLoader, assert_bitwise, fit_resumable, resume_loader

@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 uninterrupted steps (the second epoch starts at step 6)."""
    return fit_resumable(8, tmp_path_factory.mktemp("straight") / "ssd", **TWO_EPOCHS).last


def test_top_k_removes_directory_checkpoints(tmp_path):
    ckpts = tmp_path / "ckpts"
    cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts), monitor="step", mode="max", save_top_k=2,
                                             every_n_train_steps=1)
    fit_resumable(5, tmp_path / "ssd", callbacks=[cb], **TWO_EPOCHS)
    # Steps 1..5 were saved; the three worst (oldest) directories were removed whole.
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt"]
    for step in (4, 5):
        path = ckpts / f"epoch=0-step={step}.ckpt"
        assert path.is_dir() and snake_checkpoint.read_manifest(path)["step_count"] == step


def test_resume_from_last(tmp_path, straight):
    ckpts = tmp_path / "ckpts"

    def callback():
        return L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts), save_last=True, save_top_k=0,
                                                   every_n_train_steps=3)

    fit_resumable(6, tmp_path / "ssd", callbacks=[callback()], **TWO_EPOCHS)
    assert sorted(os.listdir(ckpts)) == ["last.ckpt"]
    assert snake_checkpoint.read_manifest(ckpts / "last.ckpt")["step_count"] == 6
    run = fit_resumable(8, tmp_path / "ssd2", callbacks=[callback()], ckpt_path="last", **TWO_EPOCHS)
    resumed, trainer = run.last, run.trainer
    assert trainer.global_step == 8
    assert_bitwise(resumed, straight)


def test_resume_in_the_middle_of_an_epoch(tmp_path, straight):
    def loader():
        return resume_loader(TWO_EPOCHS["steps_per_epoch"], loader_cls=ResumableLoader)

    ckpts = tmp_path / "ckpts"
    cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts), save_top_k=-1, every_n_train_steps=2)
    fit_resumable(2, tmp_path / "ssd", callbacks=[cb], loader=loader(), **TWO_EPOCHS)
    ckpt = ckpts / "epoch=0-step=2.ckpt"
    assert snake_checkpoint.read_manifest(ckpt)["step_count"] == 2  # 2 of the epoch's 6 batches
    run = fit_resumable(8, tmp_path / "ssd2", ckpt_path=str(ckpt), loader=loader(), **TWO_EPOCHS)
    resumed, trainer = run.last, run.trainer
    assert trainer.global_step == 8  # crossed into the second epoch (6 batches per epoch)
    assert_bitwise(resumed, straight)


def test_second_live_run_on_the_same_ssd_dir_is_refused(tmp_path):
    ssd = tmp_path / "ssd"
    refusals = []

    class StartAnotherRun(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                with pytest.raises(ValueError, match="in use by a running process") as err:
                    fit_resumable(1, ssd, **TWO_EPOCHS)
                refusals.append(str(err.value))

    first = fit_resumable(2, ssd, callbacks=[StartAnotherRun()], **TWO_EPOCHS).last
    assert len(refusals) == 1 and str(ssd) in refusals[0] and f"pid {os.getpid()}" in refusals[0]
    # The first run was not disturbed: it equals a run that nobody interrupted.
    alone = fit_resumable(2, tmp_path / "ssd_alone", **TWO_EPOCHS).last
    assert_bitwise(first, alone)
    # Once the first run ended, the directory is free again.
    again = fit_resumable(2, ssd, **TWO_EPOCHS).last
    assert_bitwise(again, alone)
