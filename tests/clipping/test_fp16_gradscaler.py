"""16-mixed against plain torch's fp16 recipe, per step: fp16 autocast on the CPU, ``torch.amp.GradScaler``
(init scale 2^16, growth factor 2, backoff 0.5, growth interval 2000), the same model, data, micro-batches and
``torch.optim.AdamW`` from the same ``configure_optimizers``. Dynamic loss scaling skips an overflowing step
exactly, with the overlap on; gradient clipping (the Trainer's settings) acts after ``scaler.unscale_``, as
``clip_grad_norm_`` / ``clip_grad_value_`` do. The clipping tests are black-box comparisons: only the
Trainer's clip settings and the parameters are read.

Why norm clipping is compared with an adaptive tolerance after step 0: the
clip factor is a rounding-level function of how the global norm is summed. Plain torch given the SAME
clip with its norm summed in float64 (an equally exact computation) moves 4 of the matmul weights'
fp16 copies (what autocast multiplies with) across a rounding boundary at step 0 (3.7e-9 apart), and
from step 1 on drifts from torch's own result by 3.5e-5 .. 4.7e-5 (lr 1e-3), the one-ulp fp16
amplification; greedysnake stays within 2.2e-6 of that float64-norm reference at every step. So after
step 0 the bound is a multiple of torch's distance from itself, measured in the test, with a FLOOR: on
CPUs whose float32 norm lands on the same clip factors as the float64 one (an AMD EPYC) torch's two
results agree bitwise, the measured distance is 0, and yet a third exact summation order (greedysnake's)
may still cross one of those fp16 rounding boundaries. The floor is that one-ulp amplification's size.
The two bugs this guards against are 20-1000x larger: the norm of the loss-scaled gradients (9.9e-4 at
step 0) and the value clamp before unscaling (4.0e-4 at step 0).
"""
import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from snake_strategy.gpt import GPTModule
from snake_strategy.precision import GreedySnakePrecision
from tests.helpers import (FP16_ATOL, FP16_GPT, OVERFLOW_FACTOR, SMALL_GPT, ScaledLossGPT, fit_snake,
                           fp16_clip_reference, fp16_scaled_backward, max_abs_diff, token_data, token_loader)

STEPS, MICRO, MICRO_SIZE, LR = 4, 4, 2, 1e-3
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
              # the reference's micro-batching:
              schedule={"kind": "vertical", "num_micro_batches": MICRO, "alpha": 0.25},
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


# ---------------------------------------------------------------------------------------------- clipping
STEP0_ATOL = 1e-8  # measured: 3.7e-9 (norm), 1.2e-10 (value); one step moves the weights by 1e-3
# One fp16 ulp of a weight copy crossed by one summation order and not by another moves later Adam steps
# by this much (measured 3.5e-5 .. 4.7e-5 at lr 1e-3, Intel Xeon Sapphire Rapids): Adam's step is about
# lr whatever the gradient's size, so a tiny change of a tiny gradient is not damped by its size.
FP16_ULP_DRIFT = 0.05 * LR
CLIPS = {"norm": 0.05, "value": 1e-3}  # both trigger: the global norm is ~1.3, many elements exceed 1e-3


def _reference(x, y, algorithm: str | None, value: float, norm_in_float64: bool = False):
    """Plain torch, the module's own AdamW; the parameters after every step and the pre-clip norms."""
    return fp16_clip_reference(x, y, FP16_GPT, STEPS, MICRO, MICRO_SIZE, LR, algorithm, value, norm_in_float64)


def _snake(x, y, algorithm: str, value: float) -> list[dict[str, torch.Tensor]]:
    return fit_snake(lambda: GPTModule(FP16_GPT, learning_rate=LR),
                     DataLoader(TensorDataset(x, y), batch_size=MICRO * MICRO_SIZE),
                     steps=STEPS, schedule={"kind": "vertical", "num_micro_batches": MICRO},
                     precision_plugin=GreedySnakePrecision("16-mixed"),
                     trainer_extra={"gradient_clip_val": value, "gradient_clip_algorithm": algorithm}).states


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_fp16_clipping_matches_gradscaler_unscale_clip(algorithm):
    value = CLIPS[algorithm]
    x, y = token_data(STEPS * MICRO * MICRO_SIZE, FP16_GPT.context_len, FP16_GPT.vocab_size)
    ref, norms = _reference(x, y, algorithm, value)
    unclipped, _ = _reference(x, y, None, value)
    got = _snake(x, y, algorithm, value)
    assert len(got) == len(ref) == len(unclipped) == STEPS
    assert max_abs_diff(ref[-1], unclipped[-1]) > 0.5 * LR  # the clip changed training (6.8e-4 at step 0 for
    # norm; 1.5e-8 for value: Adam's first step is about lr x sign(g) whatever the clamp; 2.3e-3 at step 3)
    if algorithm == "norm":
        assert all(n > value for n in norms), norms
    assert max_abs_diff(got[0], ref[0]) < STEP0_ATOL
    if algorithm == "value":  # element-wise: no norm, nothing to amplify
        for step, (a, b) in enumerate(zip(got, ref)):
            assert max_abs_diff(a, b) < STEP0_ATOL, step
        return
    same_clip, _ = _reference(x, y, algorithm, value, norm_in_float64=True)
    for step in range(1, STEPS):
        own_drift = max_abs_diff(same_clip[step], ref[step])  # torch against itself, one summation order apart
        assert own_drift < 1e-3 * LR * 100, (step, own_drift)  # 0 where both orders give the same factors
        bound = 4 * max(own_drift, FP16_ULP_DRIFT) + STEP0_ATOL
        assert max_abs_diff(got[step], ref[step]) <= bound, (step, own_drift)
