"""The contract's block outputs: a hand-written MoE whose loss adds a load-balancing term over every block's
gate probabilities (``loss_reads_block_outputs = True``, each block returns ``(hidden, gate)``). The strategy
keeps each block's output from the forward, gives the loss's gradient back to the block's backward through
the recompute (or the kept graph), and trains exactly as plain Lightning (float64, atol 1e-10) in every
schedule, with units of several blocks and with frozen lower blocks; a block that breaks the contract is
refused before any update, by name."""
import pytest
import torch
import lightning as L
from torch import nn

from tests.helpers import assert_steps_close, fit_lightning, fit_snake, max_abs_diff
from tests.moe.models import MoEStack, routed_loader

STEPS, MICRO, MICRO_SIZE = 4, 2, 2
SIT_OUT = {1: 0}
HOST = {"weights": "host", "optimizer": "host", "gradients": "host"}
SSD = {"weights": "ssd", "optimizer": "ssd", "gradients": "host"}


class FrozenBottom(MoEStack):
    """The first block frozen: no backward reaches it, its gate still enters the loss's value."""

    def configure_model(self) -> None:
        super().configure_model()
        self.blocks[0].requires_grad_(False)


def _module(cls=MoEStack, balance=0.5):
    return lambda: cls(depth=4, num_experts=3, balance=balance)


def _reference(cls=MoEStack, balance=0.5):
    loader = routed_loader(STEPS, MICRO * MICRO_SIZE, MICRO_SIZE, SIT_OUT, num_experts=3)
    return fit_lightning(_module(cls, balance), loader, steps=STEPS, accumulate=MICRO, precision="64-true").states


def _snake(tmp_path, storage=HOST, schedule=None, cls=MoEStack):
    loader = routed_loader(STEPS, MICRO * MICRO_SIZE, MICRO * MICRO_SIZE, SIT_OUT, num_experts=3)
    return fit_snake(_module(cls), loader, steps=STEPS, precision="64-true",
                     storage={**storage, "ssd_dir": str(tmp_path / "ssd")},
                     schedule={"num_micro_batches": MICRO, **(schedule or {})}).states


SCHEDULES = {
    "vertical": {"kind": "vertical", "alpha": 0.5},
    "horizontal": {"kind": "horizontal"},
    "batched": {"kind": "vertical", "batched_forward": True, "batched_backward": True},
    "split": {"kind": "vertical", "split_backward": True},
    "two_blocks_a_unit": {"kind": "vertical", "blocks_per_unit": 2},
    "auto": {"kind": "auto"},
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_equals_plain_lightning(schedule, tmp_path):
    ref = _reference()
    plain = _reference(balance=0.0)
    assert max_abs_diff(ref[-1], plain[-1]) > 1e-3, "the balancing term changes the training"
    got = _snake(tmp_path, SSD if schedule == "vertical" else HOST, SCHEDULES[schedule])
    assert_steps_close(got, ref, "64-true", steps=STEPS)


def test_frozen_lower_blocks(tmp_path):
    ref = _reference(FrozenBottom)
    got = _snake(tmp_path, SSD, {"kind": "vertical", "alpha": 0.25}, cls=FrozenBottom)
    assert torch.equal(got[-1]["blocks.0.router.weight"], ref[0]["blocks.0.router.weight"])
    assert_steps_close(got, ref, "64-true", steps=STEPS)


def test_validation_loss_reads_the_block_outputs(tmp_path):
    loader = routed_loader(2, 4, 4, {}, num_experts=3)

    def validate(strategy):
        torch.manual_seed(0)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, precision="64-true",
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            default_root_dir=str(tmp_path))
        return trainer.validate(_module()(), loader)[0]["val_loss"]

    from snake_strategy import GreedySnakeStrategy
    expected = validate("auto")
    got = validate(GreedySnakeStrategy(storage={"ssd_dir": str(tmp_path / "ssd")}, schedule={"num_micro_batches": 2}))
    assert abs(got - expected) < 1e-10


class HiddenOnly(nn.Module):
    def forward(self, hidden, route):
        return hidden


class WrongOutput(nn.Module):
    def forward(self, hidden, route):
        return hidden, hidden.sum()


@pytest.mark.parametrize("block,message", [(HiddenOnly, r"blocks\[3\] returned a Tensor.*\(hidden, output\)"),
                                           (WrongOutput, r"blocks\[3\] returned an output of shape \(\).*dim 0")])
def test_a_block_that_breaks_the_contract_is_refused(block, message, tmp_path):
    class Broken(MoEStack):
        def configure_model(self) -> None:
            if not hasattr(self, "blocks"):
                super().configure_model()
                self.blocks.append(block())

    loader = routed_loader(1, MICRO * MICRO_SIZE, MICRO * MICRO_SIZE, {}, num_experts=3)
    with pytest.raises(ValueError, match=message):
        fit_snake(Broken(num_experts=3, balance=0.5), loader, steps=1, storage={"ssd_dir": str(tmp_path / "ssd")},
                  schedule={"num_micro_batches": MICRO})
