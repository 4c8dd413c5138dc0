"""16-mixed: dynamic loss scaling; an overflowing step is skipped exactly, with the overlap on.

The reference is independent of the strategy: plain torch with fp16 autocast on the CPU and
``torch.amp.GradScaler`` (init scale 2^16, growth factor 2, backoff 0.5, growth interval 2000), the
same model, data, micro-batches and ``torch.optim.AdamW`` from the same ``configure_optimizers``.
"""

import lightning as L
import pytest
import torch

from snake_strategy.gpt import GPTModule
from snake_strategy.precision import GreedySnakePrecision
from tests.helpers import (FP16_ATOL, FP16_GPT, OVERFLOW_FACTOR, SMALL_GPT, ScaledLossGPT, fit_snake,
                           fp16_scaled_backward, token_data, token_loader)

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
        self.states.append((state, engine.scaler.scale, engine.step_count, engine.last_step.as_dict()))


def test_overflow_skips_exactly_that_step(tmp_path):
    loader = token_loader(5 * 8, 8, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    torch.manual_seed(0)
    module = PoisonedGPT(SMALL_GPT, learning_rate=1e-2)
    module._poison_token = int(loader.dataset.tensors[0][POISONED_STEP * 8 + POISONED_MICRO * 2, 0])
    log = StateLog()
    fit_snake(module, loader, steps=5, storage={"ssd_dir": str(tmp_path), "weights": "ssd", "optimizer": "ssd"},
              schedule={"num_micro_batches": 4, "alpha": 0.25}, precision_plugin=GreedySnakePrecision("16-mixed"),
              callbacks=[log], record=None)
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


STEPS, MICRO, MICRO_SIZE, LR = 4, 4, 2, 1e-3


def _gradscaler_reference(x, y, steps, overflow_step, growth_interval=2000):
    """Plain torch: fp16 autocast + GradScaler + the module's own AdamW. Returns the initial state, the
    state after every step, the scale each step used and whether each step was skipped."""
    torch.manual_seed(0)
    module = ScaledLossGPT(FP16_GPT, learning_rate=LR)
    module.configure_model()
    optimizer = module.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=growth_interval)
    init = {n: p.detach().clone() for n, p in module.named_parameters()}
    states, scales, skipped = [], [], []
    for step in range(steps):
        module.loss_factor = OVERFLOW_FACTOR if step == overflow_step else 1.0
        fp16_scaled_backward(module, scaler, x, y, step, MICRO, MICRO_SIZE)
        scales.append(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scaler.get_scale() < scales[-1])
        optimizer.zero_grad()
        states.append({n: p.detach().clone() for n, p in module.named_parameters()})
    return init, states, scales, skipped


class _Fp16Log(L.Callback):
    def __init__(self, overflow_step):
        self.overflow_step = overflow_step
        self.states, self.stats = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.loss_factor = OVERFLOW_FACTOR if batch_idx == self.overflow_step else 1.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        self.states.append(engine.state_dict())
        self.stats.append(engine.last_step.as_dict())


@pytest.mark.parametrize("overflow_step", [None, 1], ids=["no_overflow", "overflow_at_step_1"])
def test_fp16_matches_gradscaler_reference(tmp_path, overflow_step):
    x, y = token_data(STEPS * MICRO * MICRO_SIZE, FP16_GPT.context_len, FP16_GPT.vocab_size)
    init, ref, ref_scales, ref_skipped = _gradscaler_reference(x, y, STEPS, overflow_step)
    assert len(ref) == STEPS and ref_skipped == [s == overflow_step for s in range(STEPS)], ref_skipped
    log = _Fp16Log(overflow_step)
    fit_snake(lambda: ScaledLossGPT(FP16_GPT, learning_rate=LR),
              token_loader(STEPS * MICRO * MICRO_SIZE, MICRO * MICRO_SIZE, FP16_GPT.context_len, FP16_GPT.vocab_size),
              steps=STEPS, storage={"ssd_dir": str(tmp_path), "weights": "ssd", "optimizer": "ssd"},
              schedule={"kind": "vertical", "num_micro_batches": MICRO, "alpha": 0.25},  # the reference's micro-batching
              precision_plugin=GreedySnakePrecision("16-mixed"), callbacks=[log], record=None)
    assert len(log.states) == len(log.stats) == STEPS
    # The same scale for every step, and the same step skipped.
    assert [s["loss_scale"] for s in log.stats] == ref_scales
    assert [bool(s.get("skipped", False)) for s in log.stats] == ref_skipped
    previous_ref, previous_got = init, None
    for step, (got, want) in enumerate(zip(log.states, ref)):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=FP16_ATOL, msg=f"step {step} {name}")
        moved = max((want[k] - previous_ref[k]).abs().max().item() for k in want)
        if ref_skipped[step]:
            assert moved == 0.0  # GradScaler skipped the step ...
            assert all(torch.equal(got[k], previous_got[k]) for k in got)  # ... and so did the strategy
        else:
            assert moved > 1e4 * FP16_ATOL, (step, moved)  # every other step really moves the weights
        previous_ref, previous_got = want, got


class _ScaleLog(L.Callback):
    def __init__(self):
        self.scales, self.skipped = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = trainer.strategy.engine.last_step.as_dict()
        self.scales.append(stats["loss_scale"])
        self.skipped.append(bool(stats.get("skipped", False)))


@pytest.mark.slow
def test_fp16_scale_doubles_after_2000_clean_steps():
    """GradScaler's growth: the scale doubles after growth_interval (2000) consecutive clean steps.

    With the default interval this needs 2001 steps of a tiny model (about 30 s on 2 cores): opt-in with
    --runslow. ``test_fp16_scale_doubles_after_the_growth_interval`` checks a short interval by default.
    """
    from snake_strategy.gpt import GPTConfig

    tiny = GPTConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=1, context_len=16)
    steps = 2001
    # 4 x 16 tokens per step: each logit gradient is at most 2^16 / 64, no fp16 overflow.
    log = _ScaleLog()
    fit_snake(GPTModule(tiny), token_loader(steps * 4, 4, tiny.context_len, tiny.vocab_size), steps=steps,
              schedule={"num_micro_batches": 1}, precision_plugin=GreedySnakePrecision("16-mixed"), callbacks=[log],
              record=None)
    assert len(log.scales) == steps and not any(log.skipped)
    assert log.scales[:2000] == [2.0**16] * 2000
    assert log.scales[2000] == 2.0**17


def test_fp16_scale_doubles_after_the_growth_interval():
    """The same with GreedySnakePrecision(growth_interval=3): doubles after every 3 clean steps, and an
    overflow resets the count (torch.amp.GradScaler's policy)."""
    from snake_strategy.gpt import GPTConfig

    tiny = GPTConfig(vocab_size=8, d_model=8, num_layers=2, num_heads=1, context_len=16)
    steps = 8
    log = _ScaleLog()
    fit_snake(GPTModule(tiny), token_loader(steps * 4, 4, tiny.context_len, tiny.vocab_size), steps=steps,
              schedule={"num_micro_batches": 2}, precision_plugin=GreedySnakePrecision("16-mixed", growth_interval=3),
              callbacks=[log], record=None)
    assert not any(log.skipped)
    assert log.scales == [2.0**16] * 3 + [2.0**17] * 3 + [2.0**18] * 2
