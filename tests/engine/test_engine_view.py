"""The one typed view of a running engine (engine/view.py): both engines implement ``EngineView``, it is
reached through ``running_engine`` from a Trainer, a strategy or the module, and what it yields is the model
(every parameter once, by its module name, the values plain Lightning would hold)."""
from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

import snake_strategy
from snake_strategy.engine import EngineView, EvalEngine, SnakeEngine, StepStats, running_engine
from snake_strategy.gpt import GPTModule
from tests.helpers import SMALL_GPT, assert_params_close, fit_snake, run_reference, token_loader, trainer_kwargs


class _Look(L.Callback):
    def __init__(self) -> None:
        self.seen: dict[str, object] = {}

    def on_train_end(self, trainer, pl_module):
        engine = running_engine(trainer)
        self.seen["same_door"] = engine is running_engine(pl_module) is running_engine(trainer.strategy)
        self.seen["kind"] = type(engine)
        self.seen["is_view"] = isinstance(engine, EngineView)
        self.seen["named"] = {name: value.clone() for name, value in engine.named_weights()}
        self.seen["trainable"] = dict(engine.trainable_named_weights())
        self.seen["last_step"] = engine.last_step

    def on_validation_start(self, trainer, pl_module):
        if trainer.state.fn == "validate":
            engine = running_engine(pl_module)
            self.seen["eval_kind"] = type(engine)
            self.seen["eval_named"] = dict(engine.named_weights())


def test_both_engines_are_the_typed_view_and_yield_the_trained_model():
    steps, micro, size = 2, 2, 2
    reference = run_reference(SMALL_GPT, steps, micro, size, "64-true")[-1]
    look = _Look()
    loader = token_loader(steps * micro * size, micro * size, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    run = fit_snake(lambda: GPTModule(SMALL_GPT, learning_rate=1e-3), loader, steps=steps, precision="64-true",
                    schedule={"kind": "vertical", "num_micro_batches": micro},
                    storage={"placement": "manual", "weights": "host"}, callbacks=[look], record=None)
    trainer, module = run.trainer, run.module
    assert look.seen["same_door"] and look.seen["is_view"] and look.seen["kind"] is SnakeEngine
    named = look.seen["named"]
    assert named.keys() == reference.keys()  # every parameter once, by its module name
    assert_params_close(named, reference, "64-true")
    assert look.seen["trainable"].keys() == {n for n, p in module.named_parameters() if p.requires_grad}
    stats = look.seen["last_step"]
    assert isinstance(stats, StepStats) and stats.train_s > 0 and stats.step_traffic() == {
        **{k: stats.traffic.get(k, 0) + stats.optimizer_traffic.get(k, 0)
           for k in set(stats.traffic) | set(stats.optimizer_traffic)}}
    # After fit the engine is closed: nothing runs, the module holds the weights.
    assert running_engine(trainer) is None and running_engine(module) is None

    trainer = L.Trainer(strategy=snake_strategy.GreedySnakeStrategy(
        schedule={"kind": "vertical", "num_micro_batches": micro}), precision="64-true", callbacks=[look],
        **trainer_kwargs(limit_val_batches=1))
    trainer.validate(module, dataloaders=DataLoader(loader.dataset, batch_size=micro * size))
    assert look.seen["eval_kind"] is EvalEngine
    for name, value in reference.items():
        torch.testing.assert_close(look.seen["eval_named"][name], value, rtol=0, atol=1e-10, msg=name)
