"""Checkpoint directories in Lightning's lifecycle: top-k removal, ``ckpt_path="last"``, resuming in
the middle of an epoch, and the refusal of a second live run on the same ``ssd_dir``."""
import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from snake_strategy import checkpoint as snake_checkpoint
from snake_strategy.gpt import GPTModule
from tests.helpers import SMALL_GPT, ParamRecorder, token_data, trainer_kwargs

MICRO, MICRO_SIZE, STEPS_PER_EPOCH = 4, 2, 6


def _loader():
    x, y = token_data(STEPS_PER_EPOCH * MICRO * MICRO_SIZE, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    return DataLoader(TensorDataset(x, y), batch_size=MICRO * MICRO_SIZE, shuffle=False)


def _fit(max_steps, ssd_dir, callbacks=(), ckpt_path=None, loader=None):
    torch.manual_seed(0)
    module = GPTModule(SMALL_GPT, learning_rate=1e-2, warmup_steps=1, max_steps=8)
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"ssd_dir": str(ssd_dir), "weights": "ssd", "optimizer": "ssd"},
        schedule={"num_micro_batches": MICRO, "alpha": 0.25})
    rec = ParamRecorder(only_last=True)
    checkpointing = any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks)
    trainer = L.Trainer(strategy=strategy, max_steps=max_steps, callbacks=[rec, *callbacks],
                        **trainer_kwargs(enable_checkpointing=checkpointing))
    trainer.fit(module, train_dataloaders=loader or _loader(), ckpt_path=ckpt_path)
    assert len(rec.states) == 1
    return rec.states[0], trainer


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 uninterrupted steps (the second epoch starts at step 6)."""
    return _fit(8, tmp_path_factory.mktemp("straight") / "ssd")[0]


def _assert_equal(got, want):
    assert got and got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_top_k_removes_directory_checkpoints(tmp_path):
    ckpts = tmp_path / "ckpts"
    cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts), monitor="step", mode="max", save_top_k=2,
                                             every_n_train_steps=1)
    _fit(5, tmp_path / "ssd", callbacks=[cb])
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

    _fit(6, tmp_path / "ssd", callbacks=[callback()])
    assert sorted(os.listdir(ckpts)) == ["last.ckpt"]
    assert snake_checkpoint.read_manifest(ckpts / "last.ckpt")["step_count"] == 6
    resumed, trainer = _fit(8, tmp_path / "ssd2", callbacks=[callback()], ckpt_path="last")
    assert trainer.global_step == 8
    _assert_equal(resumed, straight)


class ResumableLoader(DataLoader):
    """Lightning's resumable-dataloader interface (``state_dict`` / ``load_state_dict``): resumes after
    the batches already consumed. With a plain DataLoader Lightning restarts the epoch's data from its
    first batch (it warns "your dataloader is not resumable"), whatever the strategy does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.yielded, self._skip = 0, 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self.yielded = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self.yielded += 1
                yield batch

    def state_dict(self):
        return {"yielded": self.yielded}

    def load_state_dict(self, state):
        self._skip = state["yielded"]


def test_resume_in_the_middle_of_an_epoch(tmp_path, straight):
    def loader():
        plain = _loader()
        return ResumableLoader(plain.dataset, batch_size=plain.batch_size, shuffle=False)

    ckpts = tmp_path / "ckpts"
    cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts), save_top_k=-1, every_n_train_steps=2)
    _fit(2, tmp_path / "ssd", callbacks=[cb], loader=loader())
    ckpt = ckpts / "epoch=0-step=2.ckpt"
    assert snake_checkpoint.read_manifest(ckpt)["step_count"] == 2  # 2 of the epoch's 6 batches
    resumed, trainer = _fit(8, tmp_path / "ssd2", ckpt_path=str(ckpt), loader=loader())
    assert trainer.global_step == 8  # crossed into the second epoch (6 batches per epoch)
    _assert_equal(resumed, straight)


def test_second_live_run_on_the_same_ssd_dir_is_refused(tmp_path):
    ssd = tmp_path / "ssd"
    refusals = []

    class StartAnotherRun(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                with pytest.raises(ValueError, match="in use by a running process") as err:
                    _fit(1, ssd)
                refusals.append(str(err.value))

    first, _ = _fit(2, ssd, callbacks=[StartAnotherRun()])
    assert len(refusals) == 1 and str(ssd) in refusals[0] and f"pid {os.getpid()}" in refusals[0]
    # The first run was not disturbed: it equals a run that nobody interrupted.
    alone, _ = _fit(2, tmp_path / "ssd_alone")
    _assert_equal(first, alone)
    # Once the first run ended, the directory is free again.
    again, _ = _fit(2, ssd)
    _assert_equal(again, alone)
