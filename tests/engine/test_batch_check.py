"""Batched passes on blocks that mix samples are refused at the first step, before any update (issue 25,
item 1): the run's first batched task runs its unit over the micro-batches concatenated and per
micro-batch, and refuses when they differ (engine/step/batch_check.py)."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from tests.helpers import SMALL_GPT, StackModule, fit_snake, max_abs_diff, run_reference, run_snake, token_loader


class MixingBlock(nn.Module):
    """A BatchNorm-like block written by hand: its output depends on the other samples of the batch."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h):
        return h + torch.tanh(self.lin(h - h.mean(0)))


class IndependentBlock(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h):
        return h + torch.tanh(self.lin(h - h.mean(-1, keepdim=True)))


class Steps(L.Callback):
    def __init__(self) -> None:
        self.done = 0

    def on_train_batch_end(self, *args) -> None:
        self.done += 1


def _fit(module: L.LightningModule, schedule: dict, steps: int = 2) -> Steps:
    counter = Steps()
    fit_snake(module, token_loader(8 * steps, 8), steps=steps, schedule={"num_micro_batches": 4, **schedule},
              precision="64-true", callbacks=[counter], record=None)
    return counter


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("schedule", [
    {"kind": "vertical", "batched_forward": True, "batched_backward": True},
    {"kind": "vertical", "batched_forward": True},
    {"kind": "vertical", "batched_backward": True},  # the first batched task is the top unit's fused backward
], ids=["both", "forward", "backward"])
def test_batched_passes_over_mixing_blocks_are_refused_before_any_update(schedule):
    torch.manual_seed(0)
    module = StackModule(lambda i: MixingBlock(), depth=3)
    before = _params(module)
    with pytest.raises(ValueError, match=r"schedule.batched_forward=.*mix samples.*batched_forward=False") as err:
        _fit(module, schedule)
    assert "the planner's choice" not in str(err.value)  # the flags were the user's, not the planner's
    assert max_abs_diff(before, _params(module)) == 0.0  # nothing was updated


def test_independent_samples_declared_on_a_mixing_module_is_caught():
    """schedule.kind=auto batches because the module says its samples are independent: they are not."""

    class Claims(StackModule):
        independent_samples = True

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"the planner's choice: the module declares independent_samples=True.*mix samples"):
        _fit(Claims(lambda i: MixingBlock(), depth=3), {})


def test_unbatched_passes_over_mixing_blocks_still_train():
    torch.manual_seed(0)
    assert _fit(StackModule(lambda i: MixingBlock(), depth=3), {"kind": "vertical"}).done == 2


def test_blocks_that_keep_samples_apart_pass_the_check_and_stay_exact():
    """The check does not refuse what is exact: per-feature statistics, and the GPT with dropout (checked
    in eval mode, so the step's masks are untouched: equal to the unbatched recompute's masks)."""
    torch.manual_seed(0)
    assert _fit(StackModule(lambda i: IndependentBlock(), depth=3),
                {"kind": "vertical", "batched_forward": True, "batched_backward": True}).done == 2
    ref = run_reference(SMALL_GPT, 2, 4, 2, "64-true")
    got, _ = run_snake(SMALL_GPT, 2, 4, 2, "64-true",
                       schedule_extra={"batched_forward": True, "batched_backward": True})
    assert len(got) == len(ref) == 2
    for a, b in zip(got, ref):
        assert max_abs_diff(a, b) < 1e-10
