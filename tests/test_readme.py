"""The guide's contract example (docs/guide/model-contract.md), run as a new user would: it trains under
greedysnake and matches plain Lightning with gradient accumulation. And the docs carry no merge leftovers."""
import re
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from tests.helpers import trainer_kwargs

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONTRACT_PAGE = ROOT / "docs" / "guide" / "model-contract.md"


def _readme_example_class():
    blocks = re.findall(r"```python\n(.*?)```", CONTRACT_PAGE.read_text(), flags=re.S)
    source = next(b for b in blocks if "class TinyMLPStack" in b)
    namespace: dict = {}
    exec(compile(source, str(CONTRACT_PAGE), "exec"), namespace)
    return namespace["TinyMLPStack"]


def _train(strategy, batch_size, accumulate, steps=3):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (steps * 8, 9), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)
    torch.manual_seed(0)
    module = _readme_example_class()(width=16, depth=3)
    trainer = L.Trainer(strategy=strategy, precision="64-true", max_steps=steps,
                        accumulate_grad_batches=accumulate, **trainer_kwargs())
    trainer.fit(module, train_dataloaders=loader)
    return trainer


def test_readme_example_matches_plain_lightning():
    captured = {}

    class Capture(L.Callback):
        def on_train_end(self, trainer, pl_module):
            captured.update(trainer.strategy.engine.state_dict())

    ref = _train("auto", batch_size=2, accumulate=4)
    reference = {n: p.detach() for n, p in ref.lightning_module.named_parameters()}
    strategy = snake_strategy.GreedySnakeStrategy(schedule={"num_micro_batches": 4})
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (24, 9), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    module = _readme_example_class()(width=16, depth=3)
    trainer = L.Trainer(strategy=strategy, precision="64-true", max_steps=3, callbacks=[Capture()],
                        **trainer_kwargs())
    trainer.fit(module, train_dataloaders=loader)
    assert captured.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(captured[name], reference[name], rtol=0, atol=1e-10, msg=name)
    assert max((captured[n] - p).abs().max() for n, p in reference.items()) < 1e-10


def test_registered_name_works():
    assert "greedysnake" in L.pytorch.strategies.StrategyRegistry
    trainer = L.Trainer(strategy="greedysnake", **trainer_kwargs())
    assert isinstance(trainer.strategy, snake_strategy.GreedySnakeStrategy)


def test_no_merge_conflict_left_in_the_docs():
    """A merge left conflict markers in the README's benchmark list once; none may land again."""
    for path in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        lines = path.read_text().splitlines()
        marked = [i + 1 for i, line in enumerate(lines) if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line == "======="]
        assert not marked, f"{path.name}: conflict markers at lines {marked}"
