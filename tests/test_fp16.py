"""16-mixed: dynamic loss scaling; an overflowing step is skipped exactly, with the overlap on."""
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from snake_strategy.gpt import GPTModule
from snake_strategy.precision import GreedySnakePrecision
from tests.helpers import SMALL_GPT, token_data, trainer_kwargs

POISONED_STEP, POISONED_MICRO = 2, 1


class PoisonedGPT(GPTModule):
    """Puts an inf into one micro-batch's loss (hence its gradient) at one step."""

    def compute_loss(self, outputs, batch):
        loss = super().compute_loss(outputs, batch)
        if self.trainer.global_step == POISONED_STEP and int(batch[0][0, 0]) == self._poison_token:
            loss = loss * float("inf")
        return loss


class StateLog(L.Callback):
    def __init__(self):
        self.states = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        state = {f"param/{k}": v for k, v in engine.state_dict().items()}
        for u in range(engine.num_units):
            unit = engine.unit_state(u)
            state[f"exp_avg/{u}"] = unit["exp_avg"]
            state[f"exp_avg_sq/{u}"] = unit["exp_avg_sq"]
        nonlayer = engine.nonlayer_state()
        for i, name in enumerate(nonlayer["names"]):
            state[f"exp_avg/{name}"] = nonlayer["exp_avg"][i]
            state[f"exp_avg_sq/{name}"] = nonlayer["exp_avg_sq"][i]
        self.states.append((state, engine.scaler.scale, engine.step_count, dict(engine.last_step_stats)))


def test_overflow_skips_exactly_that_step(tmp_path):
    x, y = token_data(5 * 8, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    torch.manual_seed(0)
    module = PoisonedGPT(SMALL_GPT, learning_rate=1e-2)
    module._poison_token = int(x[POISONED_STEP * 8 + POISONED_MICRO * 2, 0])
    strategy = snake_strategy.GreedySnakeStrategy(
        storage={"ssd_dir": str(tmp_path), "weights": "ssd", "optimizer": "ssd"},
        schedule={"num_micro_batches": 4, "alpha": 0.25}, precision_plugin=GreedySnakePrecision("16-mixed"))
    log = StateLog()
    trainer = L.Trainer(strategy=strategy, max_steps=5, callbacks=[log], **trainer_kwargs())
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=8))
    (before, scale_before, count_before, _), (after, scale_after, count_after, stats) = log.states[1], log.states[2]
    assert stats.get("skipped") is True
    assert scale_after == scale_before / 2 and count_after == count_before
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name  # weights and moments bitwise unchanged
    # Training goes on with the lowered scale and really updates again.
    final, final_scale, final_count, final_stats = log.states[-1]
    assert final_scale == scale_after and final_count == count_after + 2 and not final_stats.get("skipped")
    assert any(not torch.equal(final[k], after[k]) for k in after if k.startswith("param/"))
    assert all(torch.isfinite(v).all() for v in final.values())


def test_fp16_without_overflow_tracks_fp32(tmp_path):
    """Loss scaling changes nothing but rounding: 16-mixed stays close to the fp32 run."""
    x, y = token_data(3 * 8, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    finals = []
    for plugin in (GreedySnakePrecision("16-mixed"), GreedySnakePrecision("32-true")):
        torch.manual_seed(0)
        log = StateLog()
        strategy = snake_strategy.GreedySnakeStrategy(schedule={"num_micro_batches": 4}, precision_plugin=plugin)
        trainer = L.Trainer(strategy=strategy, max_steps=3, callbacks=[log], **trainer_kwargs())
        trainer.fit(GPTModule(SMALL_GPT, learning_rate=1e-3), train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=8))
        finals.append(log.states[-1][0])
    for name in finals[0]:
        if name.startswith("param/"):
            torch.testing.assert_close(finals[0][name], finals[1][name], rtol=0, atol=5e-3, msg=name)
