"""Resumable directory checkpoints of the SSD-resident state, consolidation, and corruption detection."""
import os
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from snake_strategy import checkpoint as snake_checkpoint
from snake_strategy.gpt import GPTModule
from tests.helpers import SMALL_GPT, ParamRecorder, token_data, trainer_kwargs

MICRO, MICRO_SIZE = 4, 2


def _loader():
    # One epoch = 3 optimizer steps, so a resume after step 3 starts a fresh epoch (same data order).
    x, y = token_data(3 * MICRO * MICRO_SIZE, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    return DataLoader(TensorDataset(x, y), batch_size=MICRO * MICRO_SIZE, shuffle=False)


def _fit(max_steps, ssd_dir, ckpt_dir=None, ckpt_path=None, record=True):
    torch.manual_seed(0)
    module = GPTModule(SMALL_GPT, learning_rate=1e-2, warmup_steps=1, max_steps=6)
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"ssd_dir": str(ssd_dir), "weights": "ssd", "optimizer": "ssd"},
        schedule={"kind": "vertical", "num_micro_batches": MICRO, "alpha": 0.25})
    rec = ParamRecorder(only_last=True)
    callbacks = [rec]
    if ckpt_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=3,
                                                             save_top_k=-1))
    kw = trainer_kwargs(enable_checkpointing=ckpt_dir is not None)
    trainer = L.Trainer(strategy=strategy, precision="32-true", max_steps=max_steps, callbacks=callbacks, **kw)
    trainer.fit(module, train_dataloaders=_loader(), ckpt_path=ckpt_path)
    return rec.states[-1], trainer


def test_resume_is_bitwise_identical(tmp_path):
    straight, _ = _fit(6, tmp_path / "ssd_a")
    _, trainer = _fit(3, tmp_path / "ssd_b", ckpt_dir=tmp_path / "ckpts")
    saved = sorted(p for p in os.listdir(tmp_path / "ckpts"))
    assert saved == ["epoch=0-step=3.ckpt"] and os.path.isdir(tmp_path / "ckpts" / saved[0])
    resumed, trainer = _fit(6, tmp_path / "ssd_c", ckpt_path=str(tmp_path / "ckpts" / saved[0]))
    assert trainer.global_step == 6
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_consolidated_file_equals_live_model(tmp_path):
    live, trainer = _fit(3, tmp_path / "ssd", ckpt_dir=tmp_path / "ckpts")
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
    _fit(3, tmp_path / "ssd", ckpt_dir=tmp_path / "ckpts")
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
        _fit(6, tmp_path / "ssd2", ckpt_path=str(ckpt))


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    _fit(3, tmp_path / "ssd", ckpt_dir=tmp_path / "ckpts")
    ckpt = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    before = snake_checkpoint.read_manifest(ckpt)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snake_checkpoint, "_write_raw", no_space)
    with pytest.raises(OSError, match="No space left"):
        _fit(6, tmp_path / "ssd2", ckpt_dir=tmp_path / "ckpts", ckpt_path=str(ckpt))
    assert snake_checkpoint.read_manifest(ckpt) == before  # still complete and verified
    assert not [p for p in os.listdir(tmp_path / "ckpts") if p.startswith(".")]  # no partial leftovers


KILL_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[3])
from tests.test_checkpoint import _fit
_fit(60, sys.argv[1], ckpt_dir=sys.argv[2])  # checkpoints every 3 steps until it is killed
"""


def test_resume_after_sigkill(tmp_path):
    """Kill a run at a random point after its first checkpoint; a new process resumes from the
    checkpoint (reusing the dead run's SSD directory, whose stale lock is recovered) and matches."""
    import random

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ckpt_dir, ssd = tmp_path / "ckpts", tmp_path / "ssd"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(ssd), str(ckpt_dir), repo], cwd=repo,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = ckpt_dir / "epoch=0-step=3.ckpt"
    deadline = time.time() + 120
    while not (first / "manifest.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert (first / "manifest.json").exists(), "the first run never wrote its checkpoint"
    time.sleep(random.uniform(0.0, 1.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    straight, _ = _fit(6, tmp_path / "ssd_straight")
    resumed, _ = _fit(6, ssd, ckpt_path=str(first))
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


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

    torch.manual_seed(0)
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"ssd_dir": str(tmp_path / "ssd"), "weights": "ssd", "optimizer": "ssd"},
        schedule={"num_micro_batches": MICRO})
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(strategy=strategy, max_steps=6, callbacks=[ckpt, FailLater()],
                        **trainer_kwargs(enable_checkpointing=True))
    with pytest.raises(OSError, match=r"SSD tier write .* No space left on device; the SSD tier is full") as err:
        trainer.fit(GPTModule(SMALL_GPT, learning_rate=1e-2, warmup_steps=1, max_steps=6), train_dataloaders=_loader())
    assert str(tmp_path / "ssd") in str(err.value)
    monkeypatch.setattr(io_engine.os, "pwritev", real_pwritev)
    saved = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    snake_checkpoint.read_manifest(saved)  # intact and verified
    straight, _ = _fit(6, tmp_path / "ssd_a")
    resumed, _ = _fit(6, tmp_path / "ssd_b", ckpt_path=str(saved))
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
