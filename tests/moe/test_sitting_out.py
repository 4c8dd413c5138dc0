"""Parameters that sit whole steps out: a hand-written MoE (tests/moe/models.py) whose experts get no sample in
some steps, against plain Lightning with the same optimizer, element-wise (float64, atol 1e-10). torch skips a
parameter whose ``.grad`` is None: no update, no decay, no state change, no step count (Adam's bias correction
and Adagrad's lr decay count each parameter's own steps). Every optimizer path is covered: fused Adam (with
non-default betas and eps), element-wise classes (NAdam, amsgrad, Adagrad), per tensor (Adafactor), and the
non-layer state (a head-side parameter that never gets a gradient)."""
import os

import pytest
import torch

from tests.helpers import assert_bitwise, assert_steps_close, fit_lightning, fit_snake, max_abs_diff
from tests.moe.models import MoEStack, routed_loader

STEPS, MICRO, MICRO_SIZE = 5, 2, 2
SIT_OUT = {0: 1, 1: 1, 3: 0}  # expert 1 sits steps 0 and 1 out, expert 0 step 3
HOST = {"weights": "host", "optimizer": "host", "gradients": "host"}
SSD = {"weights": "ssd", "optimizer": "ssd", "gradients": "host"}

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    # Non-default betas and eps: the fused path must take the group's, not the defaults.
    "adam_l2": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.05),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=0.1),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "maximize": lambda p: torch.optim.AdamW(p, lr=1e-2, maximize=True),
}


def _module(name: str):
    return lambda: MoEStack(optimizer=OPTIMIZERS[name])


def _reference(name: str, steps: int = STEPS, trainer_extra: dict | None = None) -> list[dict]:
    loader = routed_loader(steps, MICRO * MICRO_SIZE, MICRO_SIZE, SIT_OUT)
    return fit_lightning(_module(name), loader, steps=steps, accumulate=MICRO, precision="64-true",
                         trainer_extra=trainer_extra).states


def _snake(name: str, tmp_path, storage=HOST, schedule=None, **kw):
    loader = routed_loader(kw.pop("steps", STEPS), MICRO * MICRO_SIZE, MICRO * MICRO_SIZE, SIT_OUT)
    return fit_snake(_module(name), loader, steps=len(loader), precision="64-true",
                     storage={**storage, "ssd_dir": str(tmp_path / "ssd")},
                     schedule={"num_micro_batches": MICRO, **(schedule or {})}, **kw)


def _sat_out(ref: list[dict]) -> None:
    """The data does what the test says: expert 1 of every block did not move in steps 0-1, then moved."""
    name = "blocks.0.experts.1.0.weight"
    assert torch.equal(ref[0][name], ref[1][name]), "expert 1 sits steps 0 and 1 out"
    assert not torch.equal(ref[1][name], ref[2][name]), "expert 1 trains at step 2"
    assert torch.equal(ref[0]["unused.weight"], ref[-1]["unused.weight"]), "the unused head-side layer never moves"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_path_skips_what_sat_out(name, tmp_path):
    """Vertical, the state on the SSD, the alpha split: both halves of a unit's step skip the same parameters."""
    ref = _reference(name)
    _sat_out(ref)
    got = _snake(name, tmp_path, storage=SSD, schedule={"kind": "vertical", "alpha": 0.5}).states
    assert max_abs_diff(ref[0], ref[-1]) > 1e-3, "the optimizer moves the parameters"
    assert_steps_close(got, ref, "64-true", steps=STEPS)


@pytest.mark.parametrize("schedule", [{"kind": "horizontal", "alpha": 0.0}, {"kind": "vertical", "alpha": 1.0},
                                      {"kind": "vertical", "batched_forward": True, "batched_backward": True},
                                      {"kind": "auto"}], ids=["horizontal", "all_deferred", "batched", "auto"])
def test_every_schedule(schedule, tmp_path):
    ref = _reference("adamw")
    got = _snake("adamw", tmp_path, schedule=schedule).states
    assert_steps_close(got, ref, "64-true", steps=STEPS)


def test_norm_clipping_counts_what_plain_lightning_counts(tmp_path):
    """A clip that triggers: the norm is over the gradients that exist (a parameter that sat out adds nothing)."""
    extra = dict(gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    ref = _reference("adamw", trainer_extra=extra)
    got = _snake("adamw", tmp_path, storage=SSD, schedule={"alpha": 0.5}, trainer_extra=extra).states
    assert_steps_close(got, ref, "64-true", steps=STEPS)


def test_resume_across_a_step_an_expert_sat_out_is_bitwise(tmp_path):
    """Epochs of 2 steps in which expert 1 sits the first out; a checkpoint after step 4 (expert 1 has taken 2
    steps, the others 4), at an epoch's end, so the resumed run sees the same batches: the per-parameter counts
    come back, and the run continues bitwise."""
    def run(ssd, steps, **kw):
        loader = routed_loader(2, MICRO * MICRO_SIZE, MICRO * MICRO_SIZE, {0: 1})
        return fit_snake(_module("adamw"), loader, steps=steps, precision="64-true",
                         storage={**SSD, "ssd_dir": str(tmp_path / ssd)}, schedule={"num_micro_batches": MICRO,
                                                                                  "alpha": 0.5}, **kw)

    straight = run("a", 6).states[-1]
    run("b", 4, ckpt_dir=tmp_path / "ckpts", ckpt_every=4)
    (saved,) = os.listdir(tmp_path / "ckpts")
    resumed = run("c", 6, ckpt_path=str(tmp_path / "ckpts" / saved))
    assert resumed.trainer.global_step == 6
    assert_bitwise(resumed.states[-1], straight)


class BareScale(torch.nn.Module):
    """A learned scale created with its value in the constructor and no reset_parameters (hand-written RMSNorm
    style)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(width))

    def forward(self, hidden, route):
        return hidden * self.scale


def test_a_meta_built_parameter_nothing_initialises_is_refused(tmp_path):
    """configure_model runs on the meta device: a parameter whose value only its constructor gave (no
    reset_parameters, not in init_module_weights) would start from garbage. Refused before step 1, named."""

    class Scaled(MoEStack):
        def configure_model(self) -> None:
            if not hasattr(self, "blocks"):
                super().configure_model()
                self.blocks.append(BareScale(self.width))

    loader = routed_loader(1, MICRO * MICRO_SIZE, MICRO * MICRO_SIZE, {})
    with pytest.raises(ValueError, match=r"'blocks\.3\.scale'.*reset_parameters") as err:
        fit_snake(Scaled(), loader, steps=1, storage={"ssd_dir": str(tmp_path / "ssd")},
                  schedule={"num_micro_batches": MICRO})
    assert "nothing initialised it" in str(err.value)
