"""The plan decides, the engines obey: the host bytes ``strategy.plan`` placed the states with are the bytes
the engine allocates for them, in every precision (half-precision weight storage included), and the step
mode, prefetch depth and kept-activation policy the plan reports are the ones the engine runs."""
import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import snake_strategy
from snake_strategy.gpt import GPTModule
from snake_strategy.precision import GreedySnakePrecision
from tests.helpers import SMALL_GPT, fit_snake, token_data, token_loader, trainer_kwargs

MICRO, MICRO_SIZE = 2, 2
STORED = ("weights", "master", "optimizer_moments")


def _in_memory_bytes(t) -> int:
    """Bytes a tiered tensor holds in memory on a CPU run (its device share is host memory there)."""
    return t.host_end * t.dtype.itemsize


def _allocated(engine) -> dict[str, int]:
    """The stored states' bytes as the engine allocated them, unit by unit (the tail with the weights; a
    master copy only where it is not the weights themselves)."""
    out = dict.fromkeys(STORED, 0)
    for unit in engine.units:
        out["weights"] += _in_memory_bytes(unit.weights) + (_in_memory_bytes(unit.tail) if unit.tail is not None else 0)
        if unit.master is not unit.weights:
            out["master"] += _in_memory_bytes(unit.master)
        out["optimizer_moments"] += sum(_in_memory_bytes(t) for t in unit.state.values())
    return out


class _Engine(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        model = engine.host_bytes_plan()  # no checkpoints: the plan is made before their size is known
        for measured in engine.measured_host_items():  # known at the first step, in the budget the plan left
            model.pop(measured)
        self.allocated, self.model = _allocated(engine), sum(model.values())
        self.weight_buffers = engine.weights.pool.capacity
        self.speculated, self.kept_tasks = engine.last_step.speculation, engine.last_step.kept_tasks


def _fit(precision, half_weights=True, schedule=None, clip=None):
    seen = _Engine()
    run = fit_snake(GPTModule(SMALL_GPT), token_loader(MICRO * MICRO_SIZE, MICRO * MICRO_SIZE), steps=1,
                    schedule={"num_micro_batches": MICRO, **(schedule or {})}, callbacks=[seen], record=None,
                    precision_plugin=GreedySnakePrecision(precision, half_weights=half_weights),
                    trainer_extra={"gradient_clip_val": clip} if clip else None)
    return run.strategy.plan, seen


@pytest.mark.parametrize("precision,half_weights", [("32-true", True), ("bf16-mixed", True), ("bf16-mixed", False),
                                                    ("16-mixed", True), ("bf16-true", True)])
def test_the_plans_host_bytes_are_the_engines_allocation(precision, half_weights):
    """Under mixed precision the weights are stored in half with a full-precision tail and a separate master
    copy: the plan must place exactly those bytes, not the compute dtype's."""
    plan, seen = _fit(precision, half_weights)
    assert plan.host_bytes == seen.model  # the same memory model as the engine checks the budget with
    planned = plan.host_items()
    assert {k: planned.get(k, 0) for k in STORED} == seen.allocated
    half = precision.endswith("-mixed") and half_weights
    assert (seen.allocated["master"] > 0) == (half or precision == "bf16-true")


@pytest.mark.parametrize("clip,mode", [(None, "overlapped"), (1e6, "speculative")])
def test_the_engine_runs_the_plans_step_mode_and_prefetch_depth(clip, mode):
    plan, seen = _fit("32-true", clip=clip)
    assert plan.step_mode == mode and seen.speculated == (mode == "speculative")
    assert seen.weight_buffers == 1 + plan.schedule.prefetch_depth


def test_the_plan_reports_the_kept_activation_policy_that_runs():
    """The split backward keeps no graph: the plan says so (not "auto"), with why, and the engine keeps none."""
    plan, seen = _fit("32-true", schedule={"split_backward": True})
    assert plan.schedule.keep_activations == 0 and "split backward" in plan.reasons["keep_activations"]
    assert seen.kept_tasks == 0 and "keep activations 0" in plan.describe()


def test_the_evaluation_plan_is_the_evaluation_engines_allocation():
    x, y = token_data(MICRO * MICRO_SIZE, SMALL_GPT.context_len, SMALL_GPT.vocab_size)
    strategy = snake_strategy.GreedySnakeStrategy(schedule={"num_micro_batches": MICRO})
    seen = {}

    class Eval(L.Callback):
        def on_validation_batch_end(self, trainer, *args):
            engine = trainer.strategy.engine
            seen["weights"] = sum(_in_memory_bytes(u.weights) for u in engine.units)
            seen["model"] = engine.host_bytes_plan()

    module = GPTModule(SMALL_GPT)
    trainer = L.Trainer(strategy=strategy, precision="bf16-mixed", callbacks=[Eval()],
                        **trainer_kwargs(limit_val_batches=1))
    trainer.validate(module, dataloaders=DataLoader(TensorDataset(x, y), batch_size=MICRO * MICRO_SIZE))
    plan = strategy.plan
    assert plan.evaluating and plan.step_mode == "overlapped"
    assert plan.host_items() == seen["model"] and plan.host_bytes == sum(seen["model"].values())
    assert plan.host_items()["weights"] == seen["weights"]


class _WithOptimizer(GPTModule):
    """SMALL_GPT under another optimizer (``make``); its non-layer parameters are small, probed at their shape."""

    make = None

    def configure_optimizers(self):
        return type(self).make(self.parameters())


def _bnb_or_skip():
    pytest.importorskip("bitsandbytes")
    from snake_strategy.optimizers import FusedAdamW8bit
    return FusedAdamW8bit


OPTIMIZERS = {  # slots: 1, 2, 3; per tensor (factored rows and columns); uint8 state with float32 scales
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "rmsprop_centered_momentum": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "adamw8bit": lambda p: _bnb_or_skip()(p, lr=1e-3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_plan_counts_every_slot_of_the_optimizer(name):
    """The optimizer's state as its kind lays it out: the plan's bytes of the slots, of the worker's scratch
    (one piece per slot) and of the non-layer state equal what the engine allocates, for 1, 2 and 3 slots,
    state kept per tensor and 8-bit state."""
    seen = {}

    class Seen(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            engine = trainer.strategy.engine
            seen["allocated"] = _allocated(engine)
            seen["scratch"] = engine.overlap.scratch_bytes
            seen["nonlayer_state"] = engine.nonlayer.state_bytes
            seen["slots"] = len(engine.plan.optimizer.slots)

    module = type("M", (_WithOptimizer,), {"make": staticmethod(OPTIMIZERS[name])})(SMALL_GPT)
    run = fit_snake(module, token_loader(MICRO * MICRO_SIZE, MICRO * MICRO_SIZE), steps=1,
                    storage={"weights": "host", "optimizer": "host", "gradients": "host"},
                    schedule={"num_micro_batches": MICRO, "alpha": 0.5}, callbacks=[Seen()], record=None)
    planned = run.strategy.plan.host_items()
    assert seen["slots"] == {"sgd_momentum": 1, "adamw": 2, "rmsprop_centered_momentum": 3}.get(name, seen["slots"])
    assert planned["optimizer_moments"] == seen["allocated"]["optimizer_moments"]
    assert planned["optimizer_scratch"] == seen["scratch"]
    shape = run.strategy.plan.shape
    assert shape.nonlayer_state_bytes == seen["nonlayer_state"]
