"""trainer.validate / test / predict with strategy="greedysnake": before fit, after fit and from a directory
checkpoint, for the GPT and a tiny HF Llama. Metrics and predictions equal strategy="auto" on the same
weights (float64, atol 1e-10); evaluation writes no byte to the SSD and reads no optimizer state.
"""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from snake_strategy.checkpoint.consolidate import CheckpointWeights
from snake_strategy.engine.evaluation import EvalEngine
from snake_strategy.gpt import GPTModule
from tests.helpers import SMALL_GPT, fit_with, token_data, trainer_kwargs

MICRO, MICRO_SIZE, STEPS = 2, 2, 2
NUM_EVAL = 10  # eval batches of 4, 4 and 2 samples: a short last batch
MODELS = ["gpt", "llama"]


@pytest.fixture(autouse=True)
def _fp64_by_default(float64_default):
    """Every test here builds its models in fp64 (conftest.float64_default)."""


class Model:
    """One model kind: how to build a fresh module and its train/eval loaders."""

    def __init__(self, kind: str, tmp_path) -> None:
        self.kind = kind
        if kind == "llama":
            pytest.importorskip("transformers")
            from tests.hf.models import hf_model

            hf_model("llama").save_pretrained(tmp_path / "start")
            self.start = tmp_path / "start"

    def module(self) -> L.LightningModule:
        if self.kind == "gpt":
            torch.manual_seed(0)  # the init runs in configure_model, inside the first Trainer call
            return GPTModule(SMALL_GPT, learning_rate=1e-2)
        from snake_strategy.hf import HFCausalLM

        return HFCausalLM(self.start, learning_rate=1e-2, weight_decay=0.01)

    def dataset(self, num: int, seed: int):
        if self.kind == "gpt":
            return TensorDataset(*token_data(num, SMALL_GPT.context_len, SMALL_GPT.vocab_size, seed=seed))
        from tests.hf.models import Samples, batches

        return Samples(batches(num, 1, seed=seed))

    def train_loader(self) -> DataLoader:
        return DataLoader(self.dataset(STEPS * MICRO * MICRO_SIZE, 1), batch_size=MICRO * MICRO_SIZE)

    def eval_loader(self) -> DataLoader:
        return DataLoader(self.dataset(NUM_EVAL, 2), batch_size=MICRO * MICRO_SIZE)

    def loaded(self, state: dict[str, torch.Tensor]) -> L.LightningModule:
        """A fresh module holding ``state`` (for the strategy="auto" reference)."""
        module = self.module()
        module.configure_model()
        missing, unexpected = module.load_state_dict(state, strict=False)
        assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
        return module


class StepOutputs(L.Callback):
    """What validation_step and test_step returned, per batch (the losses at full precision; the logged
    metrics are reduced to float32 by Lightning's logger, too coarse for atol 1e-10)."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = {"validate": [], "test": []}

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.outputs["validate"].append(outputs.detach().clone())

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.outputs["test"].append(outputs.detach().clone())


class EvalTraffic(StepOutputs):
    """Also the engine's bytes moved by each eval loop (snapshot at its start and end), and its kind."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: dict[str, dict[str, int]] = {}
        self.engines: list[type] = []
        self.prefetched: dict[str, list[int]] = {}  # units whose weights were fetched ahead, last batch

    def _start(self, trainer) -> None:
        self.engines.append(type(trainer.strategy.engine))
        self._before = trainer.strategy.engine.counters.snapshot()

    def _end(self, trainer, stage: str) -> None:
        after = trainer.strategy.engine.counters.snapshot()
        self.prefetched[stage] = [f.unit for f in trainer.strategy.engine.trace.last.fetches if f.prefetched]
        self.num_units = trainer.strategy.engine.num_units
        self.moved[stage] = {"/".join(k): v - self._before.get(k, 0) for k, v in after.items()
                             if v - self._before.get(k, 0)}

    def on_validation_start(self, trainer, pl_module):
        self._start(trainer)

    def on_validation_end(self, trainer, pl_module):
        self._end(trainer, "validate")

    def on_test_start(self, trainer, pl_module):
        self._start(trainer)

    def on_test_end(self, trainer, pl_module):
        self._end(trainer, "test")

    def on_predict_start(self, trainer, pl_module):
        self._start(trainer)

    def on_predict_end(self, trainer, pl_module):
        self._end(trainer, "predict")


def snake_strategy_for(tmp_path, name: str, blocks_per_unit: int = 1) -> snake_strategy.GreedySnakeStrategy:
    return snake_strategy.GreedySnakeStrategy(
        storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path / f"ssd_{name}")},
        schedule={"kind": "vertical", "num_micro_batches": MICRO, "alpha": 0.25, "blocks_per_unit": blocks_per_unit})


def evaluate(trainer: L.Trainer, module, loader, ckpt_path=None) -> dict:
    """Metrics of validate and test, their per-batch step outputs, and the predictions."""
    recorder = next(cb for cb in trainer.callbacks if isinstance(cb, StepOutputs))
    recorder.outputs = {"validate": [], "test": []}
    return {"validate": trainer.validate(module, loader, ckpt_path=ckpt_path, verbose=False)[0],
            "test": trainer.test(module, loader, ckpt_path=ckpt_path, verbose=False)[0],
            "predict": trainer.predict(module, loader, ckpt_path=ckpt_path), "steps": recorder.outputs}


def auto_evaluate(model: Model, module) -> dict:
    trainer = L.Trainer(strategy="auto", precision="64-true", callbacks=[StepOutputs()],
                        **trainer_kwargs(limit_val_batches=None))
    return evaluate(trainer, module, model.eval_loader())


def assert_same(got: dict, expected: dict) -> None:
    for stage in ("validate", "test"):
        assert len(got["steps"][stage]) == len(expected["steps"][stage]) == 3
        for a, b in zip(got["steps"][stage], expected["steps"][stage]):
            assert a.dtype == b.dtype
            # GPTModule.compute_loss takes its softmax in float32 by design; its float64 logits are
            # compared at atol 1e-10 through the predictions below.
            torch.testing.assert_close(a, b, rtol=0 if a.dtype == torch.float64 else 1e-6,
                                       atol=1e-10 if a.dtype == torch.float64 else 0)
        assert got[stage].keys() == expected[stage].keys()
        for key, value in expected[stage].items():  # float32 after Lightning's reduction
            assert got[stage][key] == pytest.approx(value, rel=1e-6, abs=0), (stage, key)
    assert len(got["predict"]) == len(expected["predict"]) == 3
    for a, b in zip(got["predict"], expected["predict"]):
        assert a.dtype == b.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def assert_read_only(traffic: EvalTraffic) -> None:
    """Each eval loop read the weights from the SSD and wrote nothing anywhere, with the eval-only engine."""
    assert set(traffic.moved) == {"validate", "test", "predict"}
    for stage, moved in traffic.moved.items():
        assert not {k: v for k, v in moved.items() if k.endswith("/write")}, (stage, moved)
        assert moved.get("ssd/weights/read", 0) > 0, (stage, moved)
        assert set(moved) <= {"ssd/weights/read", "host/weights/read", "device/weights/read"}, (stage, moved)
        # Unit 0 is fetched on demand, every later unit ahead of use by the prefetch thread.
        assert traffic.prefetched[stage] == list(range(1, traffic.num_units)), (stage, traffic.prefetched)
    assert traffic.engines == [EvalEngine] * 3


def refuse_optimizers(module) -> None:
    def refuse():
        raise AssertionError("configure_optimizers must not be called for evaluation")

    module.configure_optimizers = refuse


@pytest.mark.parametrize("kind", MODELS)
def test_eval_before_fit_equals_auto(kind, tmp_path):
    model = Model(kind, tmp_path)
    traffic = EvalTraffic()
    strategy = snake_strategy_for(tmp_path, "eval")
    trainer = L.Trainer(strategy=strategy, precision="64-true", callbacks=[traffic],
                        **trainer_kwargs(limit_val_batches=None))
    module = model.module()
    refuse_optimizers(module)
    got = evaluate(trainer, module, model.eval_loader())
    assert_read_only(traffic)
    assert strategy.eval_traffic == traffic.moved["predict"]
    assert strategy.engine is None
    assert_same(got, auto_evaluate(model, model.module()))


@pytest.mark.parametrize("kind", MODELS)
def test_eval_after_fit_and_from_checkpoint_equal_auto(kind, tmp_path):
    model = Model(kind, tmp_path)
    traffic = EvalTraffic()
    ckpts = tmp_path / "ckpts"
    trainer = L.Trainer(strategy=snake_strategy_for(tmp_path, "fit"), precision="64-true", max_steps=STEPS,
                        callbacks=[traffic, L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts),
                                                                                 every_n_train_steps=STEPS)],
                        **trainer_kwargs(limit_val_batches=None, enable_checkpointing=True))
    module = model.module()
    before = auto_evaluate(model, model.module())
    trainer.fit(module, model.train_loader())
    trained = {k: v.detach().clone() for k, v in module.state_dict().items()}

    # After fit, with the same trainer: the module's trained weights, streamed read-only.
    got = evaluate(trainer, module, model.eval_loader())
    assert_read_only(traffic)
    expected = auto_evaluate(model, model.loaded(trained))
    assert_same(got, expected)
    assert abs(expected["validate"]["val_loss"] - before["validate"]["val_loss"]) > 1e-4  # the weights trained
    for name, value in module.state_dict().items():  # evaluation gave the same weights back
        assert torch.equal(value, trained[name]), name

    # From the directory checkpoint, into a fresh module: its master weights only. The moment files are
    # removed first: evaluation never opens them. Two blocks per unit here, one in the checkpoint: the
    # weights are matched by name.
    (ckpt,) = ckpts.iterdir()
    for moments in ckpt.glob("units/*.exp_avg*.bin"):
        moments.unlink()
    traffic = EvalTraffic()
    fresh = model.module()
    refuse_optimizers(fresh)
    trainer = L.Trainer(strategy=snake_strategy_for(tmp_path, "ckpt", blocks_per_unit=2), precision="64-true",
                        callbacks=[traffic],
                        **trainer_kwargs(limit_val_batches=None))
    from_ckpt = evaluate(trainer, fresh, model.eval_loader(), ckpt_path=str(ckpt))
    assert_read_only(traffic)
    assert_same(from_ckpt, expected)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_eval_with_guarded_module_asks_for_a_checkpoint(tmp_path):
    """Trained weights too large for the host budget are not given back (the module is guarded):
    evaluating the module alone would evaluate nothing, so it is refused with the fix named."""
    model = Model("gpt", tmp_path)
    module = model.module()
    trainer = L.Trainer(strategy=snake_strategy_for(tmp_path, "fit"), precision="64-true", max_steps=1,
                        **trainer_kwargs())
    trainer.fit(module, model.train_loader())
    snake_strategy.weights_handback.install_weight_guard(module, "no weights")
    with pytest.raises(ValueError, match="ckpt_path=<a greedysnake checkpoint directory"):
        trainer.validate(module, model.eval_loader(), verbose=False)


def test_checkpoint_weights_refuses_a_foreign_model(tmp_path):
    model = Model("gpt", tmp_path)
    ckpts = tmp_path / "ckpts"
    trainer = L.Trainer(strategy=snake_strategy_for(tmp_path, "fit"), precision="64-true", max_steps=1,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=1)],
                        **trainer_kwargs(enable_checkpointing=True))
    trainer.fit(model.module(), model.train_loader())
    (ckpt,) = ckpts.iterdir()
    weights = CheckpointWeights(ckpt)
    assert weights.tensor("blocks.0.qkv.weight").shape[1] == SMALL_GPT.d_model
    with pytest.raises(ValueError, match="has no parameter 'blocks.9.x'"):
        weights.tensor("blocks.9.x")
    with pytest.raises(ValueError, match="has shape"):
        weights.tensor("blocks.0.qkv.weight", (1, 2))
    weights.close()


class ValidationBatchSizes(StepOutputs):
    """Also the batch size each block-0 call saw during validation (a forward pre-hook on the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.validating = False

    def on_fit_start(self, trainer, pl_module):
        pl_module.blocks[0].register_forward_pre_hook(
            lambda block, args, kwargs: self.sizes.append(args[0].shape[0]) if self.validating else None,
            with_kwargs=True)

    def on_validation_start(self, trainer, pl_module):
        self.validating = True

    def on_validation_end(self, trainer, pl_module):
        self.validating = False


@pytest.mark.parametrize("kind", MODELS)
def test_validation_inside_fit_is_micro_batched_and_equals_plain_lightning(kind, tmp_path):
    """The val loop inside fit runs each val batch as num_micro_batches micro-batches (the training
    engine's memory plan counts one micro-batch's workspace), and its losses equal plain Lightning's."""
    model = Model(kind, tmp_path)

    def fit(strategy, batch_size, accumulate, recorder):
        loader = DataLoader(model.dataset(STEPS * MICRO * MICRO_SIZE, 1), batch_size=batch_size)
        fit_with(strategy, model.module, loader,
                 steps=STEPS, precision="64-true", accumulate=accumulate, callbacks=[recorder], record=None,
                 val_loader=model.eval_loader(), trainer_extra={"limit_val_batches": None})
        return recorder.outputs["validate"]

    expected = fit("auto", MICRO_SIZE, MICRO, StepOutputs())
    recorder = ValidationBatchSizes()
    got = fit(snake_strategy_for(tmp_path, "fit"), MICRO * MICRO_SIZE, 1, recorder)
    assert len(got) == len(expected) == 3
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0 if a.dtype == torch.float64 else 1e-6,
                                   atol=1e-10 if a.dtype == torch.float64 else 0)
    # Eval batches of 4, 4 and 2 samples, MICRO = 2 micro-batches each.
    assert recorder.sizes == [2, 2, 2, 2, 1, 1]
