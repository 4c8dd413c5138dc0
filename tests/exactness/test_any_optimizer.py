"""Any optimizer from configure_optimizers: greedysnake against plain Lightning with the same optimizer, the
same two param groups and the same LR schedule, element-wise.

float64: atol 1e-10, as Adam (only the summation order of the micro-batch gradients differs). Adafactor
normalises each update by its own running mean square, so on a parameter whose true gradient is zero (the
attention's key bias: softmax ignores it) it turns the summation order's rounding noise into O(1e-10) steps;
there the bound is the spread of plain Lightning itself between two micro-batch splits of the same data
(``own_spread``: 3.8e-10 after step 1, measured), never below 1e-10. bitsandbytes' 8-bit AdamW steps no
float64: float32, where a rounding difference of the gradient can move a moment to the next 8-bit code; its
bound is likewise its own spread under plain Lightning (2.8e-5 after step 4, measured; the engine's difference
was 1.2e-5), never below 1e-5.
"""
import importlib.util

import lightning as L
import pytest
import torch

from snake_strategy.gpt import GPTModule
from tests.helpers import (SMALL_GPT, TOLERANCES, assert_steps_close, fit_lightning, fit_snake, max_abs_diff,
                           run_reference, run_snake, token_loader)

STEPS, MICRO, MICRO_SIZE = 5, 4, 2
SSD = {"weights": "ssd", "optimizer": "ssd", "gradients": "host"}
HOST = {"weights": "host", "optimizer": "host", "gradients": "host"}
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


def _groups(module, lr):
    params = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": lr / 2}]


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(_groups(m, 0.05), lr=0.05),  # no momentum: no state at all
    "sgd_nesterov": lambda m: torch.optim.SGD(_groups(m, 0.05), lr=0.05, momentum=0.9, nesterov=True),
    "sgd_dampening": lambda m: torch.optim.SGD(_groups(m, 0.05), lr=0.05, momentum=0.9, dampening=0.1),
    "adam_amsgrad": lambda m: torch.optim.Adam(_groups(m, 1e-3), lr=1e-3, amsgrad=True),
    "adamax": lambda m: torch.optim.Adamax(_groups(m, 2e-3), lr=2e-3),
    "nadam": lambda m: torch.optim.NAdam(_groups(m, 2e-3), lr=2e-3),
    "radam": lambda m: torch.optim.RAdam(_groups(m, 2e-3), lr=2e-3),
    "rmsprop": lambda m: torch.optim.RMSprop(_groups(m, 1e-3), lr=1e-3, momentum=0.9, centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(_groups(m, 0.05), lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
    "adadelta": lambda m: torch.optim.Adadelta(_groups(m, 1.0), lr=1.0),
    "asgd": lambda m: torch.optim.ASGD(_groups(m, 0.05), lr=0.05, t0=2),
    "adafactor": lambda m: torch.optim.Adafactor(_groups(m, 0.02), lr=0.02),
    "muon": lambda m: torch.optim.Muon(_groups(m, 0.02)[:1], lr=0.02, weight_decay=0.01),
}
NOISE_AMPLIFYING = {"adafactor", "adamw8bit"}
ELEMENTWISE = ["sgd_nesterov", "sgd_dampening", "adam_amsgrad", "adamax", "nadam", "radam", "rmsprop", "adagrad",
               "adadelta", "asgd"]
PER_TENSOR = ["adafactor", "muon"]


def module_class(name: str) -> type:
    """The small GPT whose configure_optimizers returns optimizer ``name`` under a per-step LR schedule;
    Muon steps 2-D matrices only, so there the 1-D parameters (LayerNorm gains, biases) are frozen."""

    class Module(GPTModule):
        def configure_model(self) -> None:
            if hasattr(super(), "configure_model"):
                super().configure_model()
            if name == "muon":
                for p in self.parameters():
                    if p.dim() < 2:
                        p.requires_grad_(False)

        def configure_optimizers(self):
            if name == "muon":
                for p in self.parameters():
                    if p.dim() < 2:
                        p.requires_grad_(False)
            optimizer = {"adamw8bit": _adamw8bit, "fused_adamw8bit": _fused_adamw8bit,
                         "fast_adamw8bit": _fast_adamw8bit}.get(name, OPTIMIZERS.get(name))(self)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.3 * step))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    Module.__name__ = f"GPT_{name}"
    return Module


def _adamw8bit(module):
    import bitsandbytes as bnb
    return bnb.optim.AdamW8bit(_groups(module, 1e-3), lr=1e-3, min_8bit_size=256)


def own_spread(name: str, ref: list[dict], trainer_extra: dict | None = None, precision: str = "64-true") -> float | None:
    """The bound for ``name``: None (the default tolerance), or for an optimizer in NOISE_AMPLIFYING twice plain
    Lightning's own largest difference between its MICRO x MICRO_SIZE micro-batches and the same samples one
    at a time, in micro-batches of 2 x MICRO_SIZE, and as one batch (only the gradients' summation order
    differs), floored at the default atol. Twice: the reference and the run under test are both one summation
    order among others, so each within the spread d of the orders leaves them up to 2d apart. One order's distance is a sample, not
    the bound: on an AVX-512 CPU greedysnake's Adafactor landed 7.5e-10 from plain's, 1.2x the largest of
    three sampled orders (4.9e-10 to 6.3e-10; docs/dev/LOG.md, 2026-12-06)."""
    if name not in NOISE_AMPLIFYING:
        return None
    samples = MICRO * MICRO_SIZE
    spread = 0.0
    for micro_size in (1, 2 * MICRO_SIZE, samples):  # the orders besides the reference's MICRO x MICRO_SIZE
        loader = token_loader(STEPS * samples, micro_size, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
        other = fit_lightning(lambda: module_class(name)(SMALL_GPT, learning_rate=1e-3), loader, steps=STEPS,
                              precision=precision, accumulate=samples // micro_size, trainer_extra=trainer_extra).states
        spread = max(spread, max(max_abs_diff(a, b) for a, b in zip(ref, other)))
    return max(TOLERANCES[precision]["atol"], 2 * spread)


def _fused_adamw8bit(module):
    from snake_strategy.optimizers import FusedAdamW8bit
    return FusedAdamW8bit(_groups(module, 1e-3), lr=1e-3, min_8bit_size=256)


def _fast_adamw8bit(module):
    from snake_strategy.optimizers import FastAdamW8bit
    return FastAdamW8bit(_groups(module, 1e-3), lr=1e-3, min_8bit_size=256)


def _run_both(name, precision, tmp_path, storage, **snake_kw):
    cls = module_class(name)
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, module_cls=cls)
    got, strategy = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, module_cls=cls,
                              storage=dict(storage, ssd_dir=str(tmp_path / "ssd")), **snake_kw)
    return got, ref, strategy


@pytest.mark.parametrize("name", ELEMENTWISE + PER_TENSOR)
def test_every_optimizer_matches_plain_lightning(name, tmp_path):
    """Vertical, every state on the SSD, the alpha split (the forward part stepped at the next forward)."""
    got, ref, strategy = _run_both(name, "64-true", tmp_path, SSD, schedule_extra={"alpha": 0.5})
    assert max_abs_diff(ref[0], ref[-1]) > 1e-4, "the optimizer moves the parameters"
    assert_steps_close(got, ref, "64-true", steps=STEPS, atol=own_spread(name, ref))


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
@pytest.mark.parametrize("name", ["sgd_dampening", "nadam", "adafactor", "muon"])
def test_schedules_and_host_placement(name, kind, tmp_path):
    got, ref, _ = _run_both(name, "64-true", tmp_path, HOST, schedule_kind=kind, schedule_extra={"alpha": 0.0})
    assert_steps_close(got, ref, "64-true", steps=STEPS, atol=own_spread(name, ref))


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
def test_bitsandbytes_adamw8bit_matches_plain_lightning(kind, tmp_path):
    """The user's own 8-bit class, its uint8 state and per-block scales on the SSD; float32 (bitsandbytes
    steps no float64)."""
    layout = _Layout()
    got, ref, _ = _run_both("adamw8bit", "32-true", tmp_path, SSD, schedule_kind=kind, schedule_extra={"alpha": 0.5},
                            callbacks=[layout])
    assert_steps_close(got, ref, "32-true", steps=STEPS, atol=own_spread("adamw8bit", ref, precision="32-true"))
    unit = layout.units[0]
    # The state as bitsandbytes keeps it: uint8 moments (1 byte per parameter, page-rounded) and fp32 scales.
    assert unit["state1.uint8_ssd"] == unit["state2.uint8_ssd"] > 0 and unit["absmax1_ssd"] > 0, unit
    assert unit["state1.uint8_ssd"] < unit["train_end"] * 4 / 3, unit


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
def test_fused_adamw8bit_matches_plain_lightning(kind, tmp_path):
    """The opt-in FusedAdamW8bit: its uint8 codes and scales on the SSD, the same numbers as plain Lightning
    with the same class (fp64: measured 5.5e-16 from it)."""
    layout = _Layout()
    got, ref, _ = _run_both("fused_adamw8bit", "64-true", tmp_path, SSD, schedule_kind=kind,
                            schedule_extra={"alpha": 0.5}, callbacks=[layout])
    assert max_abs_diff(ref[0], ref[-1]) > 1e-4
    assert_steps_close(got, ref, "64-true", steps=STEPS)
    unit = layout.units[0]
    assert unit["exp_avg_codes_ssd"] == unit["exp_avg_sq_codes_ssd"] > 0 and unit["exp_avg_absmax_ssd"] > 0, unit


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
def test_fast_adamw8bit_matches_plain_lightning(kind, tmp_path):
    """The opt-in FastAdamW8bit (its compiled step, or the eager one where no compiler is found: one choice
    per process, so both runs take the same): int8/uint8 codes and per-block maxima on the SSD, the same
    numbers as plain Lightning with the same class."""
    layout = _Layout()
    got, ref, _ = _run_both("fast_adamw8bit", "64-true", tmp_path, SSD, schedule_kind=kind,
                            schedule_extra={"alpha": 0.5}, callbacks=[layout])
    assert max_abs_diff(ref[0], ref[-1]) > 1e-4
    assert_steps_close(got, ref, "64-true", steps=STEPS)
    unit = layout.units[0]
    assert unit["exp_avg_codes_ssd"] == unit["exp_avg_sq_codes_ssd"] > 0 and unit["exp_avg_absmax_ssd"] > 0, unit


class _Layout(L.Callback):
    """Keeps the engine's per-unit storage (public ``engine.storage_layout``) at the end of training."""

    def on_train_end(self, trainer, pl_module) -> None:
        self.units = trainer.strategy.engine.storage_layout()


@pytest.mark.parametrize("name", ["sgd_nesterov", "adafactor"])
@pytest.mark.parametrize("clip", ["speculative", "deferred"])
def test_norm_clipping(name, clip, tmp_path):
    """Norm clipping that triggers: speculative steps rolled back, and the deferred step."""
    cls = module_class(name)
    extra = dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true", module_cls=cls, trainer_extra=extra)
    schedule = {"alpha": 0.5, "speculation": "on" if clip == "speculative" else "off"}
    got, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true", module_cls=cls, trainer_extra=extra,
                       storage=dict(SSD, ssd_dir=str(tmp_path / "ssd")), schedule_extra=schedule)
    assert_steps_close(got, ref, "64-true", steps=STEPS, atol=own_spread(name, ref, extra))


def test_the_plan_times_the_optimizers_own_step(tmp_path):
    """The prediction's optimizer term is the user's class's measured rate (Muon's Newton-Schulz iterations:
    far below the fused Adam kernel that the machine probe measures and the default profile assumes)."""
    from snake_strategy.planning.machine import probe_hardware
    fused_rate = probe_hardware(str(tmp_path)).optimizer_params_per_s
    cls = module_class("muon")
    run = fit_snake(lambda: cls(SMALL_GPT, learning_rate=1e-3),
                    token_loader(16, 8, SMALL_GPT.context_len, SMALL_GPT.vocab_size), steps=1, record=None,
                    hardware="probe", storage={"ssd_dir": str(tmp_path / "ssd")}, schedule={"num_micro_batches": 4})
    muon_rate = run.strategy.hardware_profile.optimizer_params_per_s
    assert muon_rate < fused_rate / 5, (muon_rate, fused_rate)
    assert "Muon: momentum_buffer float32" in run.strategy.plan.describe()
    # Without a probe the default profile's optimizer rate (fused Adam's constant) is replaced all the same.
    from snake_strategy.planning.time_model import HardwareProfile
    default = fit_snake(lambda: cls(SMALL_GPT, learning_rate=1e-3),
                        token_loader(16, 8, SMALL_GPT.context_len, SMALL_GPT.vocab_size), steps=1, record=None,
                        storage={"ssd_dir": str(tmp_path / "ssd2")}, schedule={"num_micro_batches": 4})
    assert default.strategy.hardware_profile.optimizer_params_per_s < HardwareProfile().optimizer_params_per_s / 5
