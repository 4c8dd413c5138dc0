"""What a killed save leaves in a checkpoint directory, seen by the next run (issue 36 items 2 and 7): real
processes SIGKILLed at a targeted point of a save, then a resume in this process.

- A partial save (``.<name>.tmp-PID`` of a dead process) is gone by the time the resumed run trains, even
  when the resume names a checkpoint of that directory directly (no ModelCheckpoint there), and one log
  line names it with the disk space it held; a live process's save in progress is left alone.
- Without an atomic exchange (NFS, some FUSE mounts), a kill between "old aside" and "new in" leaves no
  ``last.ckpt``: ``fit(ckpt_path="last")`` puts the newest complete copy back before Lightning looks for
  ``last*.ckpt``, says so, and resumes from that step, bitwise.
"""
import logging
import os
import signal
import subprocess
import sys
import warnings

import lightning as L
import pytest

from tests.helpers import TWO_EPOCHS, ResumableLoader, assert_bitwise, fit_resumable, resume_loader

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KILL_SCRIPT = r"""
import os, signal, sys, types
sys.path.insert(0, sys.argv[1])
import lightning as L
from snake_strategy.checkpoint import store
from tests.helpers import TWO_EPOCHS, ResumableLoader, fit_resumable, resume_loader

mode, ckpts, ssd, marker = sys.argv[2:6]

def killed(what):
    with open(marker, "w") as f:
        f.write(what)
    os.kill(os.getpid(), signal.SIGKILL)

if mode == "partial":
    # Inside the save of epoch=0-step=2.ckpt: its unit files are in the temporary directory, the
    # manifest is not written yet.
    real_commit = store.commit
    def commit(engine, checkpoint, tmp, final, *args, **kwargs):
        if final.name == "epoch=0-step=2.ckpt":
            killed(f"in the save of {final.name}")
        return real_commit(engine, checkpoint, tmp, final, *args, **kwargs)
    store.commit = commit
    callback = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpts, every_n_train_steps=1, save_top_k=-1,
                                                   save_last=True)
    fit_resumable(60, ssd, callbacks=[callback],
                  loader=resume_loader(TWO_EPOCHS["steps_per_epoch"], loader_cls=ResumableLoader), **TWO_EPOCHS)
else:
    # A filesystem without renameat2(RENAME_EXCHANGE): the old last.ckpt is renamed aside, then the new
    # one in; the kill lands between the two.
    store._exchange = lambda a, b: False
    def rename(src, dst):
        os.rename(src, dst)
        if ".old-" in os.path.basename(dst):
            killed(f"after {src} -> {dst}")
    store.os = types.SimpleNamespace(**{**vars(os), "rename": rename})
    callback = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpts, every_n_train_steps=3, save_top_k=0,
                                                   save_last=True)
    fit_resumable(60, ssd, callbacks=[callback], **TWO_EPOCHS)
"""


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 uninterrupted steps (the second epoch starts at step 6)."""
    return fit_resumable(8, tmp_path_factory.mktemp("straight") / "ssd", **TWO_EPOCHS).last


def _killed_run(tmp_path, mode) -> list[str]:
    """Runs the child until it SIGKILLs itself at the point ``mode`` names; the checkpoint directory's listing."""
    ckpts, marker = tmp_path / "ckpts", tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, REPO, mode, str(ckpts), str(tmp_path / "ssd"),
                             str(marker)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL and marker.exists(), err.decode()[-3000:]
    return sorted(os.listdir(ckpts))


class AtStart(L.Callback):
    """What the checkpoint directory holds and the step the run starts from, when training begins."""

    def __init__(self, ckpts):
        self.ckpts, self.listing, self.step = ckpts, None, None

    def on_train_start(self, trainer, pl_module):
        self.listing, self.step = sorted(os.listdir(self.ckpts)), trainer.global_step


def test_a_killed_saves_partial_directory_is_removed_by_the_next_run(tmp_path, straight, caplog):
    """Issue 36 item 2. Before: `.epoch=0-step=2.ckpt.tmp-PID` stayed before and after a resume that
    named `last.ckpt` (the sweep covered ModelCheckpoint directories and the loaded name's siblings only)."""
    listing = _killed_run(tmp_path, "partial")
    partial = [n for n in listing if n.startswith(".epoch=0-step=2.ckpt.tmp-")]
    assert len(partial) == 1 and "last.ckpt" in listing, listing
    ckpts = tmp_path / "ckpts"
    assert (ckpts / partial[0] / "units").is_dir()  # the unit files were in it
    theirs = ckpts / f".epoch=0-step=9.ckpt.tmp-{os.getppid()}"  # a live process's save in progress
    theirs.mkdir()
    seen = AtStart(ckpts)
    with caplog.at_level(logging.INFO, logger="snake_strategy"):
        run = fit_resumable(8, tmp_path / "ssd2", callbacks=[seen], ckpt_path=str(ckpts / "last.ckpt"),
                            loader=resume_loader(TWO_EPOCHS["steps_per_epoch"], loader_cls=ResumableLoader),
                            **TWO_EPOCHS)
    resumed, trainer = run.last, run.trainer
    assert seen.step == 1  # last.ckpt was saved at step 1; step 2's save was the one killed
    assert partial[0] not in seen.listing and theirs.name in seen.listing, seen.listing
    assert partial[0] not in os.listdir(ckpts) and theirs.is_dir()
    said = [r.getMessage() for r in caplog.records if partial[0] in r.getMessage()]
    assert len(said) == 1, said  # once
    assert "removed" in said[0] and "KiB" in said[0], said[0]  # what, and the disk space it held
    assert trainer.global_step == 8
    assert_bitwise(resumed, straight)


def test_kill_between_the_two_renames_then_fit_last_resumes_from_the_new_checkpoint(tmp_path, straight, caplog):
    """Issue 36 item 7. Before: `.last.ckpt.old-PID` (step 3) and `.last.ckpt.tmp-PID` (step 6), both
    complete, and no `last.ckpt`: fit(ckpt_path="last") started from step 0 with Lightning's "no last
    checkpoint" warning (the setup sweep put step 6 back only after Lightning had looked)."""
    pid_listing = _killed_run(tmp_path, "aside")
    assert "last.ckpt" not in pid_listing and len(pid_listing) == 2, pid_listing
    assert {n.rpartition("-")[0] for n in pid_listing} == {".last.ckpt.old", ".last.ckpt.tmp"}
    ckpts = tmp_path / "ckpts"
    callback = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=3, save_top_k=0,
                                                   save_last=True)
    seen = AtStart(ckpts)
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit_resumable(8, tmp_path / "ssd2", callbacks=[callback, seen], ckpt_path="last", **TWO_EPOCHS)
        resumed, trainer = run.last, run.trainer
    assert not [w for w in caught if "no last checkpoint" in str(w.message)]
    assert seen.step == 6 and seen.listing == ["last.ckpt"], (seen.step, seen.listing)
    assert "restored" in caplog.text and "(step 6)" in caplog.text
    assert trainer.global_step == 8
    assert_bitwise(resumed, straight)  # step 6 ends the first epoch: the resume is bitwise
