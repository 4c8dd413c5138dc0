"""Optimizers that keep values outside ``self.state[p]``: a counter on the object or in a param group is carried
as plain Lightning carries it (the optimizer object itself takes every step, and each step's copies start
from what it holds); what depends on the gradients, or changes before the closure runs, is refused before
step 1 naming what it is."""
import pytest
import torch

from tests.helpers import assert_steps_close, fit_lightning, fit_snake
from tests.moe.models import MoEStack, routed_loader

STEPS, MICRO, MICRO_SIZE = 4, 2, 2


def _descend(optimizer: torch.optim.Optimizer, rate) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-rate(group))


class CounterOnSelf(torch.optim.SGD):
    """The step size decays with a counter kept on the optimizer object."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.t = 0

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.t += 1
        _descend(self, lambda group: group["lr"] / self.t)


class CounterInGroup(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            group["t"] = group.get("t", 0) + 1
        _descend(self, lambda group: group["lr"] / group["t"])


class GradientStatisticOnSelf(torch.optim.SGD):
    """Halves its step once it has seen a gradient, a flag kept on the object (set from the gradients)."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        scale = 0.5 if getattr(self, "seen_gradient", False) else 1.0
        _descend(self, lambda group: group["lr"] * scale)
        if any(p.grad is not None for group in self.param_groups for p in group["params"]):
            self.seen_gradient = True


class CounterBeforeClosure(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):
        self.t = getattr(self, "t", 0) + 1
        if closure is not None:
            with torch.enable_grad():
                closure()
        _descend(self, lambda group: group["lr"] / self.t)


def _loader(batch_size: int):
    return routed_loader(STEPS, MICRO * MICRO_SIZE, batch_size, {1: 0})


@pytest.mark.parametrize("cls", [CounterOnSelf, CounterInGroup])
def test_counters_are_carried_exactly(cls, tmp_path):
    make = lambda: MoEStack(optimizer=lambda p: cls(p, lr=0.1))  # noqa: E731
    ref = fit_lightning(make, _loader(MICRO_SIZE), steps=STEPS, accumulate=MICRO, precision="64-true").states
    got = fit_snake(make, _loader(MICRO * MICRO_SIZE), steps=STEPS, precision="64-true",
                    storage={"optimizer": "ssd", "ssd_dir": str(tmp_path / "ssd")},
                    schedule={"num_micro_batches": MICRO, "alpha": 0.5}).states
    assert_steps_close(got, ref, "64-true", steps=STEPS)


@pytest.mark.parametrize("cls, names", [(GradientStatisticOnSelf, "attribute 'seen_gradient'"),
                                        (CounterBeforeClosure, "attribute 't'")])
def test_what_cannot_be_carried_is_refused_before_step_1(cls, names, tmp_path):
    module = MoEStack(optimizer=lambda p: cls(p, lr=0.1))
    with pytest.raises(ValueError, match="self.state") as err:
        fit_snake(module, _loader(MICRO * MICRO_SIZE), steps=STEPS, storage={"ssd_dir": str(tmp_path / "ssd")},
                  schedule={"num_micro_batches": MICRO})
    assert cls.__name__ in str(err.value) and names in str(err.value), str(err.value)
