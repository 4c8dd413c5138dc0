"""Resumable directory checkpoints of the SSD-resident state, consolidation, and corruption detection."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib

import lightning as L
import pytest
import torch

import snake_strategy
from snake_strategy import checkpoint as snake_checkpoint
from snake_strategy.checkpoint import format as checkpoint_format, store as checkpoint_store
from snake_strategy.gpt import GPTModule
from tests.helpers import assert_bitwise, fit_resumable

def test_resume_is_bitwise_identical(tmp_path):
    straight = fit_resumable(6, tmp_path / "ssd_a").last
    trainer = fit_resumable(3, tmp_path / "ssd_b", ckpt_dir=tmp_path / "ckpts").trainer
    saved = sorted(p for p in os.listdir(tmp_path / "ckpts"))
    assert saved == ["epoch=0-step=3.ckpt"] and os.path.isdir(tmp_path / "ckpts" / saved[0])
    run = fit_resumable(6, tmp_path / "ssd_c", ckpt_path=str(tmp_path / "ckpts" / saved[0]))
    resumed, trainer = run.last, run.trainer
    assert trainer.global_step == 6
    assert_bitwise(resumed, straight)


def test_consolidated_file_equals_live_model(tmp_path):
    run = fit_resumable(3, tmp_path / "ssd", ckpt_dir=tmp_path / "ckpts")
    live, trainer = run.last, run.trainer
    path = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    # meta.pt does not repeat the non-layer weights nonlayer.pt holds (one copy per save); readers put
    # them back, bitwise, in Lightning's key order.
    shared = snake_strategy.checkpoint.read_manifest(path)["state_dict_from_nonlayer"]
    assert set(shared) == {name for name in live if not name.startswith("blocks.")}
    assert not set(torch.load(path / "meta.pt", weights_only=False)["state_dict"]) & set(shared)
    meta = snake_strategy.checkpoint.CheckpointWeights(path).meta()
    assert list(meta["state_dict"]) == [k for k in trainer.lightning_module.state_dict() if not k.startswith("blocks.")]
    for name in shared:
        assert torch.equal(meta["state_dict"][name], live[name]), name
    assert meta["state_dict"]["lm_head.weight"] is meta["state_dict"]["wte.weight"]  # tied, as in the module
    out = tmp_path / "model.ckpt"
    subprocess.run([sys.executable, "-m", "snake_strategy.checkpoint", str(tmp_path / "ckpts" / "epoch=0-step=3.ckpt"),
                    str(out)], check=True, capture_output=True)
    state = torch.load(out, weights_only=False)["state_dict"]
    for name, value in live.items():
        assert torch.equal(state[name], value), name
    reloaded = GPTModule.load_from_checkpoint(str(out))
    for name, p in reloaded.named_parameters():
        assert torch.equal(p.detach(), live[name]), name


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove_manifest"])
def test_corrupt_checkpoint_is_refused_with_the_file_named(tmp_path, damage):
    fit_resumable(3, tmp_path / "ssd", ckpt_dir=tmp_path / "ckpts")
    ckpt = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    victim = ckpt / "units" / "unit00001.exp_avg.bin"
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        (ckpt / "manifest.json").unlink()
    with pytest.raises(ValueError, match="unit00001.exp_avg.bin" if damage != "remove_manifest" else "manifest"):
        fit_resumable(6, tmp_path / "ssd2", ckpt_path=str(ckpt))


def _tree(root):
    """Every file under ``root`` with its bytes (a checkpoint is a few hundred kB here)."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = fh.read()
    return out


class _NoSpaceWhenPickled:
    """A checkpoint entry whose serialisation fails as a full disk would, after the unit files of the
    save were already written (meta.pt is written after them)."""

    def __reduce__(self):
        raise OSError(errno.ENOSPC, "No space left on device")


class _SaveAgainAt(L.Callback):
    """At ``step``, overwrite ``path`` with ``trainer.save_checkpoint``; ``extra`` goes into that save."""

    def __init__(self, step, path, extra=None):
        self.step, self.path, self.extra = step, str(path), extra
        self.saving = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.saving = True
            trainer.save_checkpoint(self.path)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.saving and self.extra is not None:
            checkpoint["extra"] = self.extra


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path):
    """A save that fails half-way while overwriting the SAME path leaves the previous checkpoint
    byte-for-byte intact (and loadable) and nothing else in the directory."""
    fit_resumable(3, tmp_path / "ssd", ckpt_dir=tmp_path / "ckpts")
    ckpt = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    before = _tree(ckpt)
    assert before and snake_checkpoint.read_manifest(ckpt)["step_count"] == 3
    with pytest.raises(OSError, match="No space left"):
        # A different state (step 2 of another run) saved over the step-3 checkpoint.
        fit_resumable(6, tmp_path / "ssd2", callbacks=[_SaveAgainAt(2, ckpt, _NoSpaceWhenPickled())])
    assert os.listdir(tmp_path / "ckpts") == [ckpt.name]  # no partial or temporary leftovers at all
    assert _tree(ckpt) == before
    straight = fit_resumable(6, tmp_path / "ssd_a").last
    resumed = fit_resumable(6, tmp_path / "ssd_b", ckpt_path=str(ckpt)).last
    assert_bitwise(resumed, straight)


class _PauseWhenPickled:
    """Inside a save (the unit files already in the temporary directory, meta.pt being written): tell
    the parent through ``marker`` and wait there to be killed."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        with open(self.marker, "w") as f:
            f.write("meta.pt")
        time.sleep(600)
        raise AssertionError("not killed")


def _pause_after_touching(path, marker):
    """In the child: after any rmtree / rename / replace that removes or replaces ``path``, tell the
    parent through ``marker`` and wait to be killed (the window between old and new checkpoint)."""
    import shutil

    target = os.path.abspath(path)

    def wrap(module, name):
        real = getattr(module, name)

        def paused(*args, **kwargs):
            result = real(*args, **kwargs)
            if any(isinstance(a, (str, os.PathLike)) and os.path.abspath(a) == target for a in args[:2]):
                with open(marker, "w") as f:
                    f.write(f"after {name}({', '.join(map(str, args[:2]))})")
                time.sleep(600)
                raise AssertionError("not killed")
            return result

        setattr(module, name, paused)

    wrap(shutil, "rmtree")
    wrap(os, "rename")
    wrap(os, "replace")
    wrap(checkpoint_store, "_exchange")  # the atomic swap (renameat2 RENAME_EXCHANGE) where Linux has it


class _OverwriteAndPause(L.Callback):
    """Step 3: save ``path``. Step 4: overwrite ``path`` and pause inside that save (``mode``)."""

    def __init__(self, path, marker, mode):
        self.path, self.marker, self.mode = str(path), marker, mode

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            trainer.save_checkpoint(self.path)
        elif trainer.global_step == 4:
            if self.mode == "at_replace":
                _pause_after_touching(self.path, self.marker)
            trainer.save_checkpoint(self.path)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step == 4 and self.mode == "during_write":
            checkpoint["pause"] = _PauseWhenPickled(self.marker)


KILL_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[5])
from tests.checkpoint.test_save_and_resume import _OverwriteAndPause
from tests.helpers import fit_resumable
fit_resumable(60, sys.argv[1], callbacks=[_OverwriteAndPause(sys.argv[2], sys.argv[3], sys.argv[4])])
"""


@pytest.fixture(scope="module")
def straight_six(tmp_path_factory):
    return fit_resumable(6, tmp_path_factory.mktemp("straight") / "ssd").last


@pytest.mark.parametrize("mode", [
    "during_write",
    "at_replace",
])
def test_sigkill_inside_an_overwriting_save(tmp_path, straight_six, mode):
    """A process is SIGKILLed deterministically inside a save that overwrites its previous checkpoint
    (``during_write``: the unit files are in the temporary directory; ``at_replace``: right after the
    old checkpoint was first removed or renamed). The path must still hold the previous, complete,
    verified checkpoint, and a new process resumes from it (recovering the dead run's SSD lock) to
    exactly the uninterrupted result."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ckpt_dir, ssd, marker = tmp_path / "ckpts", tmp_path / "ssd", tmp_path / "paused"
    ckpt = ckpt_dir / "last.ckpt"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(ssd), str(ckpt), str(marker), mode, repo],
                            cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not marker.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        if not marker.exists():
            proc.kill()
            pytest.fail(f"the child never paused inside its save: {proc.communicate()[1].decode()[-3000:]}")
        entries = sorted(os.listdir(ckpt_dir))
        if mode == "during_write":
            # The kill lands inside the save: its temporary directory is there, beside the old checkpoint.
            assert len(entries) == 2 and ckpt.name in entries, entries
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    manifest = snake_checkpoint.read_manifest(ckpt)  # complete and verified ...
    if mode == "during_write":
        assert manifest["step_count"] == 3  # ... and the previous one (the step-4 save never completed)
    else:
        # ... the previous one, or the new one when the kill landed right after an atomic swap
        assert manifest["step_count"] in (3, 4), manifest["step_count"]
    assert [e for e in os.listdir(ckpt_dir) if not e.startswith(".")] == [ckpt.name]
    run = fit_resumable(6, ssd, ckpt_path=str(ckpt))
    resumed, trainer = run.last, run.trainer
    assert trainer.global_step == 6
    if manifest["step_count"] == 3:  # an epoch boundary: bitwise (mid-epoch, Lightning replays the epoch)
        assert_bitwise(resumed, straight_six)


def test_enospc_during_a_step_is_clear_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """The disk fills up in the middle of training: a clear error naming the file, and the checkpoint
    written before still loads and resumes."""
    import errno as errno_mod

    from snake_strategy.storage import io_engine

    real_pwritev = os.pwritev

    class FailLater(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 4:  # step 5 runs on a full disk; the step-3 checkpoint is done
                def full(fd, buffers, offset):
                    raise OSError(errno_mod.ENOSPC, os.strerror(errno_mod.ENOSPC))
                monkeypatch.setattr(io_engine.os, "pwritev", full)

    with pytest.raises(OSError, match=r"SSD tier write .* No space left on device; the SSD tier is full") as err:
        fit_resumable(6, tmp_path / "ssd", ckpt_dir=tmp_path / "ckpts", callbacks=[FailLater()], record=None)
    assert str(tmp_path / "ssd") in str(err.value)
    monkeypatch.setattr(io_engine.os, "pwritev", real_pwritev)
    saved = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    snake_checkpoint.read_manifest(saved)  # intact and verified
    straight = fit_resumable(6, tmp_path / "ssd_a").last
    resumed = fit_resumable(6, tmp_path / "ssd_b", ckpt_path=str(saved)).last
    assert_bitwise(resumed, straight)


def test_a_checkpoint_with_the_older_nonlayer_file_still_resumes(tmp_path):
    """Checkpoints written before the non-layer vectors became raw files hold them inside nonlayer.pt:
    resuming one gives the same parameters as resuming the same state in today's layout."""
    _ = fit_resumable(3, tmp_path / "ssd", ckpt_dir=tmp_path / "ckpts").last
    new = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    old = tmp_path / "old.ckpt"
    shutil.copytree(new, old)
    manifest = json.loads((old / "manifest.json").read_text())
    state = checkpoint_format.read_nonlayer(old, manifest)
    state = {k: [t.clone() for t in v] if k in ("master", "exp_avg", "exp_avg_sq") else v for k, v in state.items()}
    torch.save(state, old / "nonlayer.pt")
    for name in ("master", "exp_avg", "exp_avg_sq"):
        (old / f"nonlayer.{name}.bin").unlink()
        del manifest["files"][f"nonlayer.{name}.bin"]
    del manifest["nonlayer"]
    manifest["files"]["nonlayer.pt"] = {"bytes": (old / "nonlayer.pt").stat().st_size,
                                        "crc32": zlib.crc32((old / "nonlayer.pt").read_bytes())}
    (old / "manifest.json").write_text(json.dumps(manifest))
    from_new = fit_resumable(4, tmp_path / "ssd_new", ckpt_path=str(new)).last
    from_old = fit_resumable(4, tmp_path / "ssd_old", ckpt_path=str(old)).last
    assert_bitwise(from_old, from_new)
