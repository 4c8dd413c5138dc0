"""Gradient clipping under the optimizer overlap equals plain Lightning's clipping, on steps where it
really triggers (float64: atol 1e-10; float32: rtol/atol 1e-5)."""
import lightning as L
import pytest
import torch

from tests.helpers import SMALL_GPT, assert_params_close, assert_steps_close, run_reference, run_snake

STEPS, MICRO, MICRO_SIZE = 4, 4, 2


class NormLog(L.Callback):
    def __init__(self):
        self.norms, self.factors = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = trainer.strategy.engine.last_step.as_dict()
        self.norms.append(stats["grad_norm"])
        self.factors.append(stats["clip_factor"])


# Under norm clipping the overlap's alpha has no effect (every unit's whole update is deferred until
# the global norm is known), so one alpha covers it.
@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
@pytest.mark.parametrize("precision", ["64-true", "32-true"])
def test_norm_clipping_is_exact_with_overlap(precision, kind, tmp_path):
    alpha = 0.25
    clip = {"gradient_clip_val": 0.3, "gradient_clip_algorithm": "norm"}
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, lr=1e-2, trainer_extra=clip)
    log = NormLog()
    got, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, lr=1e-2, schedule_kind=kind,
                       storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path)},
                       schedule_extra={"alpha": alpha}, callbacks=[log], trainer_extra=clip)
    # Clipping really triggered on every step (the norm exceeds 0.3), so the factor mattered.
    assert len(log.norms) == len(log.factors) == STEPS, (log.norms, log.factors)
    assert all(n > 0.3 for n in log.norms), log.norms
    assert all(f < 0.999 for f in log.factors), log.factors
    assert_steps_close(got, ref, precision, steps=STEPS)


def test_norm_clipping_without_intermediate_reads(tmp_path):
    """Nothing flushes the deferred updates between steps: the exact path is the real one."""
    clip = {"gradient_clip_val": 0.3}
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true", lr=1e-2, trainer_extra=clip)
    got, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true", lr=1e-2, only_last=True,
                       storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path)},
                       schedule_extra={"alpha": 0.25}, trainer_extra=clip)
    assert len(got) == 1 and len(ref) == STEPS, (len(got), len(ref))
    assert_params_close(got[0], ref[-1], "64-true")


@pytest.mark.parametrize("precision", ["64-true", "32-true"])
def test_value_clipping_is_exact(precision, tmp_path):
    clip = {"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value"}
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, trainer_extra=clip)
    got, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision,
                       storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(tmp_path)},
                       schedule_extra={"alpha": 0.25}, trainer_extra=clip)
    unclipped = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision)
    assert len(unclipped) == STEPS and ref[-1].keys() == unclipped[-1].keys()
    # The clip changed the result (it triggered), and greedysnake matches the clipped reference.
    assert max((a - b).abs().max().item() for a, b in zip(ref[-1].values(), unclipped[-1].values())) > 1e-4
    assert_steps_close(got, ref, precision, steps=STEPS)


class TorchNorm(L.Callback):
    """The global norm plain Lightning clips with: torch's, over the parameters' unclipped gradients."""

    def __init__(self):
        self.norms, self.float64_combined = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # before Lightning clips
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))
        # The same per-parameter norms (each in the gradient's dtype), combined in float64.
        per_parameter = torch.stack([torch.linalg.vector_norm(g.reshape(-1)) for g in grads])
        self.float64_combined.append(float(per_parameter.double().square().sum().sqrt()))


@pytest.mark.parametrize("precision", ["64-true", "32-true"])
def test_the_global_norm_is_torchs(precision, tmp_path):
    """The engine's global norm (per-parameter norms in the gradients' dtype, engine/step/gradients.py) is the
    one ``clip_grad_norm_`` computes on the same step-1 gradients, up to how the norms are combined."""
    torch_norm = TorchNorm()
    run_reference(SMALL_GPT, 1, MICRO, MICRO_SIZE, precision, lr=1e-2, callbacks=[torch_norm],
                  trainer_extra={"gradient_clip_val": 0.3})
    log = NormLog()
    run_snake(SMALL_GPT, 1, MICRO, MICRO_SIZE, precision, lr=1e-2, callbacks=[log],
              storage={"optimizer": "ssd", "ssd_dir": str(tmp_path)}, schedule_extra={"alpha": 0.25},
              trainer_extra={"gradient_clip_val": 0.3})
    assert len(torch_norm.norms) == len(log.norms) == 1
    rtol = 1e-12 if precision == "64-true" else 1e-6  # fp32: the norms' combination, fp64 here, fp32 in torch
    assert log.norms[0] == pytest.approx(torch_norm.norms[0], rel=rtol, abs=0)


def test_the_fp32_global_norm_combines_the_per_parameter_norms_in_float64(tmp_path):
    """32-true: the engine's global norm is torch's per-parameter fp32 norms combined in float64, to 1e-9
    (measured: equal). One micro-batch, so the gradients are Lightning's bit for bit; summing the norms'
    squares in fp32 and casting the sum moves it by 2.8e-8 here (the rtol 1e-6 against torch's own fp32
    combination cannot tell the two apart)."""
    micro, micro_size = 1, MICRO * MICRO_SIZE
    torch_norm = TorchNorm()
    run_reference(SMALL_GPT, 1, micro, micro_size, "32-true", lr=1e-2, callbacks=[torch_norm],
                  trainer_extra={"gradient_clip_val": 0.3})
    log = NormLog()
    run_snake(SMALL_GPT, 1, micro, micro_size, "32-true", lr=1e-2, callbacks=[log],
              storage={"optimizer": "ssd", "ssd_dir": str(tmp_path)}, trainer_extra={"gradient_clip_val": 0.3})
    assert len(torch_norm.float64_combined) == len(log.norms) == 1
    assert log.norms[0] == pytest.approx(torch_norm.float64_combined[0], rel=1e-9, abs=0)
