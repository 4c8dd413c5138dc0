"""Issue 9, engine side: no trained weights lost after fit, short last batches, exact replay of randomness,
fp16 scaler state in checkpoints, and clear refusals instead of silent wrong math or raw crashes."""
from __future__ import annotations

import errno
import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import snake_strategy
from snake_strategy import EngineHooks, GreedySnakeStrategy
from snake_strategy.gpt import GPTModule
from snake_strategy.precision import GreedySnakePrecision
from tests.helpers import SMALL_GPT, StackModule, fit_lightning, fit_with, max_abs_diff, token_data, trainer_kwargs


def _loader(num_samples: int, batch_size: int, seed: int = 1234) -> DataLoader:
    x, y = token_data(num_samples, SMALL_GPT.context_len, SMALL_GPT.vocab_size, seed=seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def _snake(micro: int = 2, storage: dict | None = None, **schedule) -> GreedySnakeStrategy:
    return GreedySnakeStrategy(storage=storage, schedule={"num_micro_batches": micro, **schedule})


def _model(seed: int = 0, **kw) -> GPTModule:
    torch.manual_seed(seed)
    return GPTModule(SMALL_GPT, learning_rate=1e-3, **kw)


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ---------------------------------------------------------------------------------------- items 1-3: weights after fit
def test_module_holds_the_trained_weights_after_fit(tmp_path):
    captured = {}

    class Last(L.Callback):
        def on_train_end(self, trainer, *args):
            captured.update(trainer.strategy.engine.state_dict())

    module = _model()
    storage = {"ssd_dir": str(tmp_path / "ssd"), "weights": "ssd", "optimizer": "ssd"}
    L.Trainer(strategy=_snake(storage=storage), precision="64-true", max_steps=2, callbacks=[Last()],
              **trainer_kwargs()).fit(module, _loader(8, 4))
    state = module.state_dict()
    assert not any(t.is_meta for t in state.values())
    assert captured.keys() <= state.keys()
    for name, value in captured.items():
        assert torch.equal(state[name], value), name
    # A plain trainer can evaluate the module right away.
    L.Trainer(**trainer_kwargs(limit_val_batches=1)).validate(module, _loader(4, 4))


def test_second_fit_continues_from_the_trained_weights_like_plain_lightning():
    def twice(strategy_factory, loader_batch, accumulate):
        module = _model()
        for _ in range(2):
            fit_with(strategy_factory(), module, _loader(16, loader_batch), steps=2, precision="64-true",
                     accumulate=accumulate, record=None, seed=None)
        return _params(module)

    plain = twice(lambda: "auto", 2, 2)
    snake = twice(lambda: _snake(2), 4, 1)
    assert max_abs_diff(plain, snake) < 1e-10


def test_save_checkpoint_after_fit_keeps_the_weights(tmp_path):
    module = _model()
    trainer = L.Trainer(strategy=_snake(2), precision="64-true", max_steps=2, **trainer_kwargs())
    trainer.fit(module, _loader(8, 4))
    path = tmp_path / "after.ckpt"
    trainer.save_checkpoint(path)
    loaded = GPTModule.load_from_checkpoint(path, map_location="cpu")
    loaded_params = _params(loaded)  # built in fp32 by load_from_checkpoint: compare in its dtype
    for name, value in _params(module).items():
        assert torch.equal(loaded_params[name], value.to(loaded_params[name].dtype)), name


def test_weights_that_exceed_the_budget_say_how_to_get_them(tmp_path):
    # 32 small units: the working set (a few units) fits 3 MiB, the 6.4 MB of trained weights do not. They
    # go to a file the module maps (test_lifecycle.py) unless none can be written: here export_dir is
    # under a regular file, so the guard remains and says why and how to get them.
    torch.manual_seed(0)
    module = GPTModule(snake_strategy.gpt.GPTConfig(vocab_size=64, d_model=64, num_layers=32, num_heads=4,
                                                    context_len=16))
    (tmp_path / "a_file").write_text("")
    storage = {"ssd_dir": str(tmp_path / "ssd"), "weights": "ssd", "optimizer": "ssd", "gradients": "ssd",
               "host_budget_bytes": 3 * 2**20, "export_dir": str(tmp_path / "a_file" / "export")}
    L.Trainer(strategy=_snake(2, storage=storage), max_steps=1, **trainer_kwargs()).fit(module, _loader(4, 4))
    with pytest.raises(ValueError, match="exceed the host budget.*storage.host_budget_bytes.*no weights file could "
                                         "be written.*a_file/export.*snake_strategy.checkpoint"):
        module.state_dict()


# ---------------------------------------------------------------------------------------- item 4: a short last batch
@pytest.mark.parametrize("num_samples,micro,micro_size", [(10, 2, 2), (10, 3, 2), (11, 3, 2)])
def test_short_last_batch_trains_like_plain_accumulation(tmp_path, num_samples, micro, micro_size):
    plain_module = _model()
    fit_lightning(plain_module, _loader(num_samples, micro_size), steps=-1, precision="64-true", accumulate=micro,
                  record=None, seed=None, trainer_extra={"max_epochs": 1})
    snake_module = _model()
    storage = {"ssd_dir": str(tmp_path / "ssd"), "weights": "ssd", "optimizer": "ssd",
               "checkpoints": {"ssd": 1.0}, "checkpoint_host_ends": 0}
    run = fit_with(_snake(micro, storage=storage), snake_module, _loader(num_samples, micro * micro_size), steps=-1,
                   precision="64-true", record=None, seed=None, trainer_extra={"max_epochs": 1})
    assert run.trainer.global_step == -(-num_samples // (micro * micro_size))
    assert max_abs_diff(_params(plain_module), _params(snake_module)) < 1e-10


def test_a_batch_size_that_never_splits_is_refused_before_step_1():
    with pytest.raises(ValueError, match="batch_size=5 does not split into schedule.num_micro_batches=2"):
        L.Trainer(strategy=_snake(2), max_steps=1, **trainer_kwargs()).fit(_model(), _loader(10, 5))


# ---------------------------------------------------------------------------------------- item 5: fp16 scaler resumes
class OverflowAtStep1(GPTModule):
    def compute_loss(self, outputs, batch):
        loss = super().compute_loss(outputs, batch)
        return loss * float("inf") if self.trainer.global_step == 1 else loss


def test_fp16_loss_scale_survives_resume_bitwise(tmp_path):
    def fit(steps, ssd, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        module = OverflowAtStep1(SMALL_GPT, learning_rate=1e-3)
        strategy = GreedySnakeStrategy(storage={"ssd_dir": str(ssd), "weights": "ssd", "optimizer": "ssd"},
                                       schedule={"num_micro_batches": 2},
                                       precision_plugin=GreedySnakePrecision("16-mixed"))
        seen = {}

        class Scale(L.Callback):
            def on_train_end(self, trainer, *args):
                seen["scale"] = trainer.strategy.engine.scaler.scale
                seen["params"] = trainer.strategy.engine.state_dict()

        trainer = L.Trainer(strategy=strategy, max_steps=steps, callbacks=[Scale(), *callbacks],
                            **trainer_kwargs(enable_checkpointing=bool(callbacks)))
        # 3 batches per epoch: the checkpoint at step 3 is an epoch boundary (Lightning restarts a plain
        # DataLoader's epoch on a mid-epoch resume, for every strategy).
        trainer.fit(module, _loader(12, 4), ckpt_path=ckpt_path)
        return seen

    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=3, save_top_k=-1)
    first = fit(3, tmp_path / "a", callbacks=[ckpt])
    assert first["scale"] == 2.0**15  # halved by the overflow at step 1 (which was skipped)
    straight = fit(6, tmp_path / "b")
    resumed = fit(6, tmp_path / "c", ckpt_path=str(tmp_path / "ck" / "epoch=0-step=3.ckpt"))
    assert resumed["scale"] == straight["scale"]
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name


# ---------------------------------------------------------------------------------------- item 7: randomness replay
class MaskLog:
    """Dropout masks drawn by a block, keyed by a fingerprint of its input: the forward and the
    recompute of the same input must draw the same mask."""

    def __init__(self) -> None:
        self.masks: dict[tuple[int, float], list[torch.Tensor]] = {}


class DropoutBlock(nn.Module):
    def __init__(self, width: int, log: MaskLog, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.log, self.index = log, index

    def forward(self, hidden):
        out = F.dropout(self.lin(hidden), p=0.5, training=True)  # functional dropout, not an nn.Dropout
        mask = (out == 0).detach()
        if not self.training:
            return hidden + out  # the batching check's eval-mode calls (engine/step/batch_check.py) are not steps
        self.log.masks.setdefault((self.index, round(float(hidden.detach().double().sum()), 6)), []).append(mask)
        return hidden + out


def DropoutStack(log: MaskLog, width: int = 16, depth: int = 3) -> StackModule:
    return StackModule(lambda i: DropoutBlock(width, log, i), width, depth)


@pytest.mark.parametrize("kind,batched", [("vertical", False), ("horizontal", False), ("vertical", True)])
def test_recompute_replays_the_forward_dropout_masks(kind, batched):
    log = MaskLog()
    torch.manual_seed(0)
    extra = {"batched_forward": True, "batched_backward": True} if batched else {}
    strategy = _snake(3, kind=kind, **extra)
    L.Trainer(strategy=strategy, max_steps=1, **trainer_kwargs()).fit(DropoutStack(log), _loader(6, 6))
    recomputed = {k: v for k, v in log.masks.items() if len(v) > 1}
    # Every unit but the last is recomputed once per micro-batch (one batched call when batched).
    assert len(recomputed) == 2 * (1 if batched else 3), sorted(log.masks)
    for key, masks in recomputed.items():
        assert len(masks) == 2 and torch.equal(masks[0], masks[1]), key
        assert 0 < masks[0].float().mean() < 1  # a real mask


# ---------------------------------------------------------------------------------------- items 8-9 and contract crashes
class TinyStack(StackModule):
    """The guide's contract model; ``block`` builds one block, so tests can swap in a misbehaving one."""

    def __init__(self, block=None, width: int = 16, depth: int = 2) -> None:
        make = block or (lambda: nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()))
        super().__init__(lambda i: make(), width, depth)


def _fit_tiny(module, batch_size=4, loader=None, precision="32-true", **trainer):
    L.Trainer(strategy=_snake(2), precision=precision, max_steps=1, **trainer_kwargs(**trainer)).fit(
        module, loader or _loader(4, batch_size))


def test_blocks_with_running_statistics_are_refused():
    class BatchNormBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(16)

        def forward(self, x):
            return self.norm(x.transpose(1, 2)).transpose(1, 2)

    with pytest.raises(ValueError, match=r"blocks\[0\].norm has buffers .*running_mean.*recompute"):
        _fit_tiny(TinyStack(BatchNormBlock))


class IdsDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.x, self.y = token_data(n, SMALL_GPT.context_len, 64)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "id": f"sample-{i}"}


class IdsStack(TinyStack):
    def pre_stage(self, batch):
        assert len(batch["id"]) == batch["x"].shape[0], batch["id"]  # one id per sample of the micro-batch
        return self.embed(batch["x"])

    def compute_loss(self, outputs, batch):
        return F.cross_entropy(outputs.flatten(0, 1), batch["y"].flatten())


def test_per_sample_lists_are_split_with_the_tensors():
    _fit_tiny(IdsStack(), loader=DataLoader(IdsDataset(4), batch_size=4))


def test_a_non_tensor_list_of_the_wrong_length_names_its_key():
    from snake_strategy.contract import split_micro_batches

    batch = {"x": torch.zeros(4, 3), "tags": ["a", "b", "c"]}
    with pytest.raises(ValueError, match=r"batch\['tags'\] is a list of 3 non-tensor values in a batch of 4"):
        split_micro_batches(batch, 2)


def test_unused_block_parameter_trains_like_plain_lightning():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.unused = nn.Linear(16, 16)  # never called: torch's AdamW skips it (grad None)

        def forward(self, x):
            return x + torch.tanh(self.lin(x))

    def run(strategy, batch_size, accumulate):
        torch.manual_seed(0)
        module = TinyStack(WithUnused)
        L.Trainer(strategy=strategy, precision="64-true", max_steps=2, accumulate_grad_batches=accumulate,
                  **trainer_kwargs()).fit(module, _loader(8, batch_size))
        return _params(module)

    plain, snake = run("auto", 2, 2), run(_snake(2), 4, 1)
    assert max_abs_diff(plain, snake) < 1e-10


def test_a_model_with_nothing_to_train_is_refused_with_the_reason():
    # Frozen parameters train (tests/hf/test_finetune.py); a model that is frozen everywhere has nothing to do.
    module = TinyStack()
    module.requires_grad_(False)
    with pytest.raises(ValueError, match="every parameter has requires_grad=False: there is nothing to train"):
        _fit_tiny(module)


def test_a_block_returning_a_tuple_names_the_block():
    class TupleBlock(nn.Linear):
        def __init__(self):
            super().__init__(16, 16)

        def forward(self, x):
            return (super().forward(x), None)

    with pytest.raises(ValueError, match=r"blocks\[0\] returned a tuple.*return the hidden Tensor alone"):
        _fit_tiny(TinyStack(TupleBlock))


def test_pre_stage_returning_a_list_names_pre_stage():
    class ListPre(TinyStack):
        def pre_stage(self, batch):
            return [self.embed(batch[0])]

    with pytest.raises(ValueError, match="pre_stage must return the hidden Tensor or a tuple"):
        _fit_tiny(ListPre())


# ---------------------------------------------------------------------------------------- crashes: teardown after ENOSPC
def test_enospc_in_checkpoint_writes_releases_everything_and_a_retry_works(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    full = {"on": False}

    def disk(direction, num_bytes):
        if full["on"] and direction == "write":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class FillUp(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            full["on"] = True  # the step's asynchronous checkpoint writes hit a full disk

    storage = {"ssd_dir": str(ssd), "weights": "ssd", "optimizer": "ssd", "checkpoints": {"ssd": 1.0},
               "checkpoint_host_ends": 0}
    strategy = GreedySnakeStrategy(storage=storage, schedule={"num_micro_batches": 2}, hooks=EngineHooks(
        before_ssd_transfer=disk))
    with pytest.raises(OSError, match="No space left"):
        L.Trainer(strategy=strategy, max_steps=1, callbacks=[FillUp()], **trainer_kwargs()).fit(_model(), _loader(4, 4))
    assert list(ssd.iterdir()) == []  # no state files, no lock: everything released
    full["on"] = False
    L.Trainer(strategy=_snake(2, storage=storage), max_steps=1, **trainer_kwargs()).fit(_model(), _loader(4, 4))


def test_free_space_check_counts_ssd_activation_checkpoints(tmp_path, monkeypatch):
    import shutil
    import types

    from snake_strategy.storage import ssd_directory

    storage = {"ssd_dir": str(tmp_path / "ssd"), "weights": "ssd", "optimizer": "ssd", "checkpoints": {"ssd": 1.0},
               "checkpoint_host_ends": 0}
    free_bytes = 2 * 2**20  # the states (~0.6 MB) fit, the 4 MB of checkpoints do not

    def disk_usage(path):
        return types.SimpleNamespace(total=2**40, used=2**40 - free_bytes, free=free_bytes)

    monkeypatch.setattr(ssd_directory, "shutil", types.SimpleNamespace(disk_usage=disk_usage, rmtree=shutil.rmtree))
    big = torch.randint(0, 64, (2, 4096 + 1))  # long sequences: 2 x 4096 x 32 x 4 bytes per checkpoint
    loader = DataLoader(TensorDataset(big[:, :-1], big[:, 1:]), batch_size=2)
    module = GPTModule(snake_strategy.gpt.GPTConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=4,
                                                    context_len=4096))
    with pytest.raises(ValueError, match="activation checkpoints"):
        L.Trainer(strategy=_snake(2, storage=storage), max_steps=1, **trainer_kwargs()).fit(module, loader)


# ---------------------------------------------------------------------------------------- a directory for plain Lightning
def test_a_greedysnake_directory_with_a_plain_strategy(tmp_path):
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)
    module2 = _model()
    L.Trainer(strategy=_snake(2), max_steps=2, callbacks=[ckpt], **trainer_kwargs(enable_checkpointing=True)).fit(
        module2, _loader(8, 4))
    directory = tmp_path / "ck" / "last.ckpt"
    assert directory.is_dir()
    loaded = GPTModule.load_from_checkpoint(directory, map_location="cpu")
    for name, value in _params(module2).items():
        assert torch.equal(_params(loaded)[name], value), name
    with pytest.raises(ValueError, match="is a greedysnake checkpoint directory; consolidate it"):
        L.Trainer(max_steps=3, **trainer_kwargs()).fit(_model(), _loader(8, 4), ckpt_path=str(directory))


def test_host_budget_check_does_not_change_dropout_masks():
    """The first step's budget check runs pre_stage once to size the checkpoints; it must not consume
    the RNG stream the step's embedding dropout draws from."""
    import dataclasses

    from tests.helpers import run_snake

    config = dataclasses.replace(SMALL_GPT, dropout=0.1)
    free, _ = run_snake(config, 2, 2, 2, "64-true", only_last=True)
    budgeted, _ = run_snake(config, 2, 2, 2, "64-true", storage={"host_budget_bytes": 2**30}, only_last=True)
    assert max_abs_diff(free[0], budgeted[0]) == 0.0
