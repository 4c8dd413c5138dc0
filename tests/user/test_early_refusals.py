"""Refusals that come before work is done (issue 25, items 4 and 5): an empty batch names its index, and
blocks or pre_stage returning the wrong type are refused at setup, before any weight is materialized."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from snake_strategy import GreedySnakeStrategy, Progress
from tests.helpers import StackModule, token_data, trainer_kwargs


class Steps(L.Callback):
    def __init__(self) -> None:
        self.done = 0

    def on_train_batch_end(self, *args) -> None:
        self.done += 1


def _fit(module: L.LightningModule, loader: DataLoader, steps: int = 1, precision: str = "32-true"):
    """Fit with a progress listener: returns (phases that reported, steps done), also when fit raises."""
    events, counter = [], Steps()
    strategy = GreedySnakeStrategy(schedule={"num_micro_batches": 2}, progress=Progress(log=False, listeners=[events.append]))
    trainer = L.Trainer(strategy=strategy, precision=precision, max_steps=steps, callbacks=[counter], **trainer_kwargs())
    try:
        trainer.fit(module, loader)
    finally:
        _fit.phases, _fit.steps = {e.phase for e in events}, counter.done


def _loader(num_samples: int = 8, batch_size: int = 4, collate_fn=None) -> DataLoader:
    x, y = token_data(num_samples, 16, 64)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, collate_fn=collate_fn)


def _stack(block=None, depth: int = 2) -> StackModule:
    torch.manual_seed(0)
    make = block or (lambda: nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()))
    return StackModule(lambda i: make(), depth=depth)


# ---------------------------------------------------------------------------------------- item 4: empty batch
def test_an_empty_batch_is_refused_naming_its_index():
    """A collate_fn that filters every sample out of the second batch: plain Lightning steps on it with a
    NaN loss; greedysnake refuses it by index instead of an IndexError deep in the runner."""
    x, y = token_data(12, 16, 64)
    x[:, 0] = x[:, 0] % 63
    x[4:8, 0] = 63  # the second batch's samples carry the marker the collate_fn filters out

    def filtering(samples):
        kept = [s for s in samples if int(s[0][0]) != 63]
        return (torch.empty(0, 16, dtype=x.dtype), torch.empty(0, 16, dtype=y.dtype)) if not kept \
            else torch.utils.data.default_collate(kept)

    loader = DataLoader(TensorDataset(x, y), batch_size=4, collate_fn=filtering)
    with pytest.raises(ValueError, match=r"training batch 1 of epoch 0 holds 0 samples.*drop_last"):
        _fit(_stack(), loader, steps=3)
    assert _fit.steps == 1  # the first batch trained; the empty one was refused before the engine ran


# ---------------------------------------------------------------------------------------- item 5: output contract at setup
class TupleBlock(nn.Linear):
    def __init__(self) -> None:
        super().__init__(16, 16)

    def forward(self, x):
        return super().forward(x), None


@pytest.mark.parametrize("depth", [1, 3])
def test_a_tuple_returning_block_is_refused_before_materializing(depth):
    module = _stack(depth=depth)
    module.blocks[-1] = TupleBlock()
    with pytest.raises(ValueError, match=rf"blocks\[{depth - 1}\] returned a tuple.*return the hidden Tensor alone"):
        _fit(module, _loader())
    assert "materialize" not in _fit.phases and _fit.steps == 0


def test_a_malformed_pre_stage_is_refused_before_materializing():
    class ListPre(StackModule):
        def pre_stage(self, batch):
            return [self.embed(batch[0])]

    torch.manual_seed(0)
    with pytest.raises(ValueError, match="pre_stage must return the hidden Tensor or a tuple"):
        _fit(ListPre(lambda i: nn.Linear(16, 16)), _loader())
    assert "materialize" not in _fit.phases


def test_a_model_built_on_meta_is_checked_without_memory():
    """The strategy builds configure_model() on meta: the check runs on meta too (no weight exists yet)."""

    class MetaBuilt(StackModule):
        def __init__(self):
            L.LightningModule.__init__(self)
            self.lr = 1e-3

        def configure_model(self):
            if hasattr(self, "blocks"):
                return
            self.embed = nn.Embedding(64, 16)
            self.blocks = nn.ModuleList([nn.Linear(16, 16), TupleBlock()])
            self.head = nn.Linear(16, 64)

    with pytest.raises(ValueError, match=r"blocks\[1\] returned a tuple"):
        _fit(MetaBuilt(), _loader())
    assert "materialize" not in _fit.phases


def test_a_block_that_cannot_run_on_meta_is_left_to_the_first_batch():
    """Best effort: a block meta cannot run (here: it reads a value with .item()) trains as before."""

    class ItemBlock(nn.Linear):
        def __init__(self) -> None:
            super().__init__(16, 16)

        def forward(self, x):
            return super().forward(x) * (1.0 + 0.0 * float(x.detach().abs().max().item()))

    _fit(_stack(ItemBlock), _loader())
    assert "materialize" in _fit.phases and _fit.steps == 1
