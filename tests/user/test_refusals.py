"""User errors are refused before work is done, as ValueErrors that name the setting to change: the model
contract, storage, the batch and the trainer, precision, configs and their values (before any training step
runs), an empty batch (by its index), and blocks or pre_stage returning the wrong type (at setup, before
any weight is materialized)."""
from __future__ import annotations

import dataclasses
import importlib
import types

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from snake_strategy import (GreedySnakePrecision, GreedySnakeStrategy, Progress, ScheduleConfig, StorageConfig,
                            TierShares)
from snake_strategy.gpt import GPTModule
from snake_strategy.schedule import build_tasks
from snake_strategy.storage import ssd_directory
from tests.helpers import SMALL_GPT, StackModule, fit_with, token_data, token_loader, trainer_kwargs


class Seen(L.Callback):
    """How far a fit got, also when it raised: batches started, steps done, the phases that reported progress."""

    def __init__(self) -> None:
        self.batches, self.steps, self.phases = 0, 0, set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1

    def on_train_batch_end(self, *args) -> None:
        self.steps += 1


def fit(module: L.LightningModule, loader: DataLoader | None = None, *, strategy=None, steps: int = 2,
        **trainer_extra) -> Seen:
    """Fit ``module`` for at most ``steps`` steps (raises what fit raises; ``fit.last`` says how far it got).
    The default strategy: 2 micro-batches and a progress listener."""
    seen, events = Seen(), []
    fit.last = seen
    strategy = strategy or GreedySnakeStrategy(schedule={"num_micro_batches": 2},
                                               progress=Progress(log=False, listeners=[events.append]))
    try:
        fit_with(strategy, module, loader if loader is not None else _loader(), steps=steps, callbacks=[seen],
                 record=None, trainer_extra=trainer_extra)
    finally:
        seen.phases = {e.phase for e in events}
    return seen


def _loader(num_samples: int = 8, batch_size: int = 4) -> DataLoader:
    return token_loader(num_samples, batch_size, SMALL_GPT.context_len, SMALL_GPT.vocab_size)


def _stack(block=None, depth: int = 2) -> StackModule:
    torch.manual_seed(0)
    make = block or (lambda: nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()))
    return StackModule(lambda i: make(), depth=depth)


# ---------------------------------------------------------------------------------------- the model contract
class PlainModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(SMALL_GPT.context_len, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0].float()).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_module_without_contract():
    with pytest.raises(ValueError) as err:
        fit(PlainModule())
    message = str(err.value)
    for piece in ("PlainModule", "`blocks`", "pre_stage", "post_stage", "compute_loss"):
        assert piece in message, message
    assert fit.last.batches == 0


def test_contract_by_registry_name():
    with pytest.raises(ValueError, match="pre_stage"):
        fit(PlainModule(), strategy="greedysnake")


# ---------------------------------------------------------------------------------------- storage
def test_unwritable_ssd_dir(tmp_path):
    # chmod does not stop root; a path below a regular file fails for everyone.
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    bad = afile / "ssd"
    strategy = GreedySnakeStrategy(storage={"weights": "ssd", "ssd_dir": str(bad)},
                                   schedule={"num_micro_batches": 2})
    with pytest.raises(ValueError) as err:
        fit(GPTModule(SMALL_GPT), strategy=strategy)
    message = str(err.value)
    assert "storage.ssd_dir" in message and str(bad) in message, message
    assert fit.last.batches == 0


def test_ssd_dir_is_a_file(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="storage.ssd_dir"):
        ssd_directory.SsdDirectory(str(afile))


def test_free_space_check_runs_before_training(tmp_path, monkeypatch):
    import shutil

    def tiny_disk(path):
        return types.SimpleNamespace(total=2**20, used=2**20 - 1000, free=1000)

    monkeypatch.setattr(ssd_directory, "shutil", types.SimpleNamespace(disk_usage=tiny_disk, rmtree=shutil.rmtree))
    ssd_dir = tmp_path / "ssd"
    strategy = GreedySnakeStrategy(storage={"weights": "ssd", "optimizer": "ssd", "ssd_dir": str(ssd_dir)},
                                   schedule={"num_micro_batches": 2})
    with pytest.raises(ValueError) as err:
        fit(GPTModule(SMALL_GPT), strategy=strategy)
    message = str(err.value)
    assert "storage.ssd_dir" in message and "GiB free" in message, message
    assert "GiB free (1000 bytes)" in message  # the exact numbers, readable for small sizes too
    assert fit.last.batches == 0
    # Nothing was left behind by the half-built engine.
    assert [p for p in ssd_dir.rglob("*") if p.is_file()] == []


# ---------------------------------------------------------------------------------------- the batch and trainer
def test_batch_not_divisible_by_micro_batches():
    strategy = GreedySnakeStrategy(schedule={"num_micro_batches": 2})
    with pytest.raises(ValueError) as err:
        fit(GPTModule(SMALL_GPT), _loader(5, 5), strategy=strategy)
    message = str(err.value)
    assert "num_micro_batches=2" in message and "5" in message, message


def test_failed_step_removes_ssd_files(tmp_path):
    ssd_dir = tmp_path / "ssd"
    strategy = GreedySnakeStrategy(storage={"weights": "ssd", "optimizer": "ssd", "gradients": "ssd",
                                            "ssd_dir": str(ssd_dir)},
                                   schedule={"num_micro_batches": 2})
    with pytest.raises(ValueError, match="num_micro_batches"):
        fit(GPTModule(SMALL_GPT), _loader(5, 5), strategy=strategy)
    assert not ssd_dir.exists()  # the run created it: removed with everything in it (issue 9)


class FailingLoss(GPTModule):
    """Raises in the loss of the second backward task of the second step (mid-schedule)."""

    calls = 0

    def compute_loss(self, outputs, batch):
        FailingLoss.calls += 1
        if FailingLoss.calls == 4:
            raise RuntimeError("loss exploded")
        return super().compute_loss(outputs, batch)


def test_exception_mid_step_propagates_and_removes_ssd_files(tmp_path):
    ssd_dir = tmp_path / "ssd"
    FailingLoss.calls = 0
    strategy = GreedySnakeStrategy(storage={"weights": "ssd", "optimizer": "ssd", "gradients": "ssd",
                                            "checkpoints": "ssd", "checkpoint_host_ends": 0,
                                            "ssd_dir": str(ssd_dir)},
                                   schedule={"num_micro_batches": 2})
    with pytest.raises(RuntimeError, match="loss exploded"):
        fit(FailingLoss(SMALL_GPT), strategy=strategy)
    assert fit.last.batches == 2
    assert [p for p in ssd_dir.rglob("*") if p.is_file()] == []


class ManualModule(GPTModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False


def test_manual_optimization():
    with pytest.raises(ValueError, match="automatic optimization"):
        fit(ManualModule(SMALL_GPT))
    assert fit.last.batches == 0


def test_accumulate_grad_batches():
    with pytest.raises(ValueError) as err:
        fit(GPTModule(SMALL_GPT), accumulate_grad_batches=2)
    assert "accumulate_grad_batches" in str(err.value) and "num_micro_batches" in str(err.value)
    assert fit.last.batches == 0


def test_unknown_gradient_clip_algorithm_refused():
    from snake_strategy.engine import EngineRuntime, SnakeEngine
    from snake_strategy.planning.run_plan import RunPlan
    plan = RunPlan(snake_strategy.StorageConfig(), snake_strategy.ScheduleConfig(kind="vertical"), {}, 0, 0)
    with pytest.raises(ValueError, match="gradient_clip_algorithm"):
        SnakeEngine(None, None, plan, EngineRuntime(None, torch.device("cpu"), clip=("l1", 1.0)))


class _OptimizerModule(GPTModule):
    """The small GPT with the optimizer ``make(parameters)`` from configure_optimizers."""

    def __init__(self, config, make) -> None:
        super().__init__(config)
        self._make = make

    def configure_optimizers(self):
        return self._make(self.parameters())


class CoupledSGD(torch.optim.Optimizer):
    """SGD whose step is scaled by the gradient norm of ALL its parameters: state coupling parameters."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            total = torch.sqrt(sum((p.grad ** 2).sum() for p in params))
            for p in params:
                p.add_(p.grad / (1 + total), alpha=-group["lr"])


class _Boxed(torch.Tensor):
    """A tensor subclass, as torchao keeps its quantized optimizer states."""


class BoxedStateSGD(torch.optim.Optimizer):
    """SGD with momentum kept in a tensor subclass."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.Tensor._make_subclass(_Boxed, torch.zeros_like(p))
                state["buf"].mul_(0.9).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


@pytest.mark.parametrize("make,words", [
    (lambda ps: BoxedStateSGD(ps), ["BoxedStateSGD", "tensor subclass", "FusedAdamW8bit"]),
    (lambda ps: torch.optim.LBFGS(ps, lr=0.1), ["LBFGS", "closure"]),
    (lambda ps: torch.optim.SparseAdam(list(ps), lr=0.1), ["SparseAdam", "sparse"]),
    (lambda ps: CoupledSGD(ps), ["CoupledSGD", "couples parameters"]),
])
def test_optimizers_that_cannot_be_stepped_exactly_are_refused(make, words):
    """Refused before step 1, naming the optimizer, why, and the fix."""
    with pytest.raises(ValueError) as err:
        fit(_OptimizerModule(SMALL_GPT, make))
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "configure_optimizers" in str(err.value) or "Use an optimizer" in str(err.value)
    assert fit.last.batches == 0


# ---------------------------------------------------------------------------------------- precision
def test_unsupported_precision_at_trainer_construction():
    with pytest.raises(ValueError) as err:
        L.Trainer(strategy="greedysnake", precision="16-true", **trainer_kwargs())
    assert "Trainer(precision='16-true')" in str(err.value) and "strategy='greedysnake'" in str(err.value)


def test_unsupported_precision_16_true_with_strategy_instance():
    with pytest.raises(ValueError, match=r"precision='16-true'"):
        L.Trainer(strategy=GreedySnakeStrategy(), precision="16-true", **trainer_kwargs())


def test_precision_plugin_refuses_unknown_precisions():
    with pytest.raises(ValueError) as err:
        GreedySnakePrecision("transformer-engine")
    assert "precision='transformer-engine'" in str(err.value) and "bf16-true" in str(err.value)


def test_16_mixed_through_the_plugin_instance():
    plugin = GreedySnakePrecision("16-mixed")
    trainer = L.Trainer(strategy=GreedySnakeStrategy(precision_plugin=plugin), **trainer_kwargs())
    assert trainer.strategy.precision_plugin.precision == "16-mixed"
    assert trainer.strategy.precision_plugin.dtypes.loss_scaling


def test_16_mixed_on_cpu_is_downgraded_by_lightning():
    # Lightning rewrites precision="16-mixed" to "bf16-mixed" on CPU (with a warning) before any
    # strategy sees it, so greedysnake cannot refuse it there: it trains in bf16-mixed.
    with pytest.warns(UserWarning, match="bf16-mixed"):
        trainer = L.Trainer(strategy="greedysnake", precision="16-mixed", **trainer_kwargs())
    assert isinstance(trainer.strategy.precision_plugin, GreedySnakePrecision)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed", "bf16-true"])
def test_supported_precisions_construct(precision):
    trainer = L.Trainer(strategy="greedysnake", precision=precision, **trainer_kwargs())
    assert trainer.strategy.precision_plugin.precision == precision


# ---------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("kwargs,match", [
    ({"device": 0.5, "host": 0.2, "ssd": 0.2}, "add up to"),
    ({"host": 0.5}, "add up to"),
    ({"device": -0.1, "host": 1.1}, r"device=-0.1 must lie in \[0, 1\]"),
    ({"host": 0.0, "ssd": 1.5}, r"ssd=1.5 must lie"),
])
def test_bad_tier_split(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TierShares(**kwargs)


@pytest.mark.parametrize("value,match", [
    ({"ssd": 0.7, "device": 0.5}, "storage.weights"),
    ({"nvme": 1.0}, r"storage.weights has unknown tiers \['nvme'\]"),
    ("disk", r"storage.weights='disk' is not a tier"),
    (0.5, "storage.weights must be a tier name or a mapping"),
])
def test_bad_storage_weights(value, match):
    with pytest.raises(ValueError, match=match):
        StorageConfig(weights=value)
    with pytest.raises(ValueError, match=match):
        GreedySnakeStrategy(storage={"weights": value})


def test_bad_storage_fields():
    with pytest.raises(ValueError, match="storage has unknown fields"):
        GreedySnakeStrategy(storage={"ssd_path": "/tmp"})
    with pytest.raises(ValueError, match="storage.checkpoint_host_ends"):
        StorageConfig(checkpoint_host_ends=-1)
    with pytest.raises(ValueError, match="storage.num_io_threads"):
        StorageConfig(num_io_threads=0)


def test_bad_schedule_kind():
    with pytest.raises(ValueError, match=r"schedule.kind='zigzag'"):
        ScheduleConfig(kind="zigzag")
    with pytest.raises(ValueError, match=r"schedule.kind='zigzag'"):
        GreedySnakeStrategy(schedule={"kind": "zigzag"})
    with pytest.raises(ValueError, match="zigzag"):
        build_tasks("zigzag", 2, 2)


@pytest.mark.parametrize("field,value", [("num_micro_batches", 0), ("blocks_per_unit", 0)])
def test_bad_schedule_sizes(field, value):
    with pytest.raises(ValueError, match=f"schedule.{field}={value}"):
        ScheduleConfig(**{field: value})


@pytest.mark.parametrize("kwargs,match", [
    ({"alpha": 0.6}, r"schedule.alpha=0.6 must lie in \[0, 0.5\]"),
    ({"alpha": -0.1}, r"schedule.alpha=-0.1"),
    ({"kind": "horizontal", "batched_backward": True}, r"schedule.batched_backward=true needs schedule.kind='vertical'"),
    ({"split_backward": True, "batched_backward": True}, r"split_backward=true and schedule.batched_backward=true"),
    ({"prefetch_depth": -1}, r"schedule.prefetch_depth=-1 must be >= 0"),
])
def test_bad_overlap_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(**kwargs)


def test_mismatched_batching_refuses_dropout_before_any_update():
    # The recompute of a batched backward cannot replay masks drawn by unbatched forwards.
    config = dataclasses.replace(SMALL_GPT, dropout=0.1)
    strategy = GreedySnakeStrategy(schedule={"kind": "vertical", "num_micro_batches": 2, "batched_backward": True})
    with pytest.raises(ValueError, match="random numbers.*batched_forward / batched_backward"):
        fit(GPTModule(config), strategy=strategy)
    assert fit.last.batches == 1  # refused inside the first step's backward, before any update


def test_bad_config_type():
    with pytest.raises(ValueError, match="schedule must be a ScheduleConfig or a mapping"):
        GreedySnakeStrategy(schedule=3)


# ---------------------------------------------------------------------------------------- registration
def test_registered_after_import():
    assert "greedysnake" in StrategyRegistry
    trainer = L.Trainer(strategy="greedysnake", **trainer_kwargs())
    assert isinstance(trainer.strategy, GreedySnakeStrategy)


def test_import_twice_does_not_raise():
    importlib.reload(snake_strategy)
    importlib.reload(snake_strategy)
    assert "greedysnake" in StrategyRegistry
    assert StrategyRegistry["greedysnake"]["strategy"] is snake_strategy.GreedySnakeStrategy


# ---------------------------------------------------------------------------------------- issue 9: config values
INT_FIELDS = [(ScheduleConfig, "schedule", "num_micro_batches"), (ScheduleConfig, "schedule", "blocks_per_unit"),
              (ScheduleConfig, "schedule", "prefetch_depth"), (StorageConfig, "storage", "checkpoint_host_ends"),
              (StorageConfig, "storage", "num_io_threads"), (StorageConfig, "storage", "host_budget_bytes")]


@pytest.mark.parametrize("cls,group,name", INT_FIELDS)
def test_integral_floats_are_whole_numbers(cls, group, name):
    """YAML / arithmetic give 2.0 for 2. Before: stored as a float, a TypeError later (range(2.0))."""
    value = getattr(cls(**{name: 2.0}), name)
    assert value == 2 and type(value) is int


@pytest.mark.parametrize("cls,group,name", INT_FIELDS)
@pytest.mark.parametrize("bad", [2.5, True, "2"])
def test_non_integral_values_name_the_field(cls, group, name, bad):
    with pytest.raises(ValueError, match=rf"{group}\.{name}=.* must be a whole number"):
        cls(**{name: bad})


def test_fractional_micro_batches_before_any_step():
    with pytest.raises(ValueError, match="schedule.num_micro_batches=2.5 must be a whole number"):
        GreedySnakeStrategy(schedule={"num_micro_batches": 2.5})
    assert fit(GPTModule(SMALL_GPT), strategy=GreedySnakeStrategy(schedule={"num_micro_batches": 2.0})).batches == 2


def test_ssd_dir_expands_home_and_variables(tmp_path, monkeypatch):
    """Before: "~/x" made a directory literally named "~" in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SNAKE_SCRATCH", str(tmp_path / "scratch"))
    assert StorageConfig(ssd_dir="~/x").ssd_dir == str(tmp_path / "home" / "x")
    assert StorageConfig(ssd_dir="$SNAKE_SCRATCH/run1").ssd_dir == str(tmp_path / "scratch" / "run1")
    monkeypatch.chdir(tmp_path)
    strategy = GreedySnakeStrategy(storage={"ssd_dir": "~/ssd", "weights": "ssd"}, schedule={"num_micro_batches": 2})
    fit(GPTModule(SMALL_GPT), strategy=strategy)
    assert not (tmp_path / "~").exists()


# ---------------------------------------------------------------------------------------- an empty batch
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
        fit(_stack(), loader, steps=3)
    assert fit.last.steps == 1  # the first batch trained; the empty one was refused before the engine ran


# ---------------------------------------------------------------------------------------- the output contract at setup
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
        fit(module, _loader(), steps=1)
    assert "materialize" not in fit.last.phases and fit.last.steps == 0


def test_a_malformed_pre_stage_is_refused_before_materializing():
    class ListPre(StackModule):
        def pre_stage(self, batch):
            return [self.embed(batch[0])]

    torch.manual_seed(0)
    with pytest.raises(ValueError, match="pre_stage must return the hidden Tensor or a tuple"):
        fit(ListPre(lambda i: nn.Linear(16, 16)), _loader(), steps=1)
    assert "materialize" not in fit.last.phases


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
        fit(MetaBuilt(), _loader(), steps=1)
    assert "materialize" not in fit.last.phases


def test_a_block_that_cannot_run_on_meta_is_left_to_the_first_batch():
    """Best effort: a block meta cannot run (here: it reads a value with .item()) trains as before."""

    class ItemBlock(nn.Linear):
        def __init__(self) -> None:
            super().__init__(16, 16)

        def forward(self, x):
            return super().forward(x) * (1.0 + 0.0 * float(x.detach().abs().max().item()))

    fit(_stack(ItemBlock), _loader(), steps=1)
    assert "materialize" in fit.last.phases and fit.last.steps == 1
