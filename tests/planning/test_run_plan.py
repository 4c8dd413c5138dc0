"""The planner drives the run: "auto" settings (the defaults) become concrete ones at setup, explicit
settings are kept, the choice is public (``strategy.plan``), and the run stays exact (fp64 atol 1e-10)."""
import dataclasses

import lightning as L
import pytest
import torch

import snake_strategy
from snake_strategy.planning import run_plan
from snake_strategy.planning.run_prediction import example_batch
from snake_strategy.config import ScheduleConfig, StorageConfig, TierShares
from snake_strategy.engine import EngineRuntime, SnakeEngine
from snake_strategy.gpt import GPTModule
from snake_strategy.planning.memory_model import host_plan
from snake_strategy.planning.time_model import HardwareProfile
from snake_strategy.precision import DtypePolicy, GreedySnakePrecision
from tests.helpers import SMALL_GPT, run_reference, run_snake

STEPS, MICRO, MICRO_SIZE = 3, 4, 2
FP64 = DtypePolicy(torch.float64, torch.float64)


class MixedSamplesGPT(GPTModule):
    """The same model, without the declaration that its blocks keep samples apart."""

    independent_samples = False


def _close(got, ref):
    assert len(got) == len(ref) and got
    for a, b in zip(got, ref):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-10, msg=name)


def _resolve(module_cls=GPTModule, storage=None, schedule=None, config=SMALL_GPT):
    module = module_cls(config)
    module.configure_model()
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    return run_plan.resolve(module, optimizer, storage or StorageConfig(placement="auto"),
                            schedule or ScheduleConfig(num_micro_batches=MICRO), FP64, torch.device("cpu"),
                            HardwareProfile())


def test_the_default_strategy_is_auto():
    strategy = snake_strategy.GreedySnakeStrategy()
    assert strategy.schedule.kind == "auto" and strategy.schedule.unset()
    assert strategy.storage.placement == "auto" and strategy.storage.unset()
    assert snake_strategy.GreedySnakeStrategy(storage="auto", schedule="auto").requested == strategy.requested


def test_default_run_is_planned_reported_and_exact():
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true")
    got, strategy = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true", schedule_kind="auto")
    _close(got, ref)
    plan = strategy.plan
    s = plan.schedule
    assert not s.unset() and not plan.storage.unset()
    # GPT blocks keep samples apart: batched passes; 4 units: alpha = 3 / (3 + 12).
    assert (s.kind, s.batched_forward, s.batched_backward, s.split_backward) == ("vertical", True, True, False)
    assert s.alpha == pytest.approx(0.2) and s.prefetch_depth == 1
    assert all(getattr(plan.storage, state) == TierShares() for state in ("weights", "optimizer", "checkpoints"))
    assert "independent samples" in plan.reasons["batched_backward"]
    assert plan.prediction is not None and plan.prediction.roofline_s > 0  # filled at the first step
    # checked against the first steady step, and the next ones (the median of those so far)
    c = plan.as_dict()["calibration"]
    assert [check["step"] for check in c["checks"]] == [2, 3, 4][:len(c["checks"])] and c["checks"]
    assert "s/step (" in plan.describe() and f"step {c['step']}" in plan.describe()
    assert plan.as_dict()["schedule"]["kind"] == "vertical"
    assert strategy.schedule is s and strategy.storage is plan.storage  # the run's concrete settings


def test_explicit_settings_are_kept():
    plan = _resolve(schedule=ScheduleConfig(num_micro_batches=MICRO, alpha=0.1, batched_forward=False,
                                            prefetch_depth=3),
                    storage=StorageConfig(placement="auto", weights="ssd"))
    s = plan.schedule
    assert (s.alpha, s.batched_forward, s.batched_backward, s.prefetch_depth) == (0.1, False, False, 3)
    assert plan.storage.weights == TierShares(host=0.0, ssd=1.0)  # given
    assert plan.storage.optimizer == TierShares()  # placed: the rest fits the host
    assert plan.reasons["alpha"] == plan.reasons["weights"] == "given"
    assert plan.reasons["optimizer"].startswith("host")
    # An explicit kind keeps the fixed defaults for what is unset: no planner.
    fixed = ScheduleConfig(kind="vertical")
    assert (fixed.alpha, fixed.batched_backward, fixed.prefetch_depth) == (0.25, False, 1)


def test_blocks_that_may_mix_samples_run_unbatched():
    s = _resolve(MixedSamplesGPT).schedule
    assert (s.batched_forward, s.batched_backward, s.split_backward) == (False, False, run_plan.SPLIT_BACKWARD_WINS)
    # Asking for one batched pass gets both (a random block needs the same grouping in the recompute).
    s = _resolve(MixedSamplesGPT, schedule=ScheduleConfig(num_micro_batches=MICRO, batched_backward=True)).schedule
    assert (s.batched_forward, s.batched_backward) == (True, True)


def test_a_tight_budget_moves_state_to_the_ssd_and_stays_within_it(tmp_path):
    # Wide enough that the activations (sized at the first step) fit the planner's reserve.
    wide = dataclasses.replace(SMALL_GPT, d_model=128)
    needed = _resolve(storage=StorageConfig(placement="auto", host_budget_bytes=2**30), config=wide).host_bytes
    budget = needed  # all on the host would leave nothing for the activations
    tight = _resolve(storage=StorageConfig(placement="auto", host_budget_bytes=budget, ssd_dir=str(tmp_path)),
                     config=wide)
    assert tight.storage.weights.ssd > 0 or tight.storage.optimizer.ssd > 0
    assert tight.host_bytes <= budget * (1 - run_plan.ACTIVATION_RESERVE_SHARE)
    assert tight.schedule.prefetch_depth == (2 if tight.storage.weights.ssd > 0 else 1)
    assert "exceeds" in tight.reasons["weights"]
    # Not even the working set fits: the refusal says what the placement's figure is a share of, and whence.
    with pytest.raises(ValueError, match=r"cannot hold the working set .*The placement gets 75% of the host budget "
                                         r"0\.00 GiB .*bounded by storage\.host_budget_bytes"):
        _resolve(storage=StorageConfig(placement="auto", host_budget_bytes=4096, ssd_dir=str(tmp_path)), config=wide)
    # The run itself: exact, inside the budget (checked again with the activations at the first step).
    ref = run_reference(wide, STEPS, MICRO, MICRO_SIZE, "64-true")
    ssd_dir = str(tmp_path / "run")
    got, strategy = run_snake(wide, STEPS, MICRO, MICRO_SIZE, "64-true", schedule_kind="auto",
                              storage={"placement": "auto", "host_budget_bytes": budget, "ssd_dir": ssd_dir})
    _close(got, ref)
    assert strategy.plan.storage == dataclasses.replace(tight.storage, ssd_dir=ssd_dir)


def test_the_engine_refuses_settings_left_to_the_planner():
    module = GPTModule(SMALL_GPT)
    module.configure_model()
    optimizer = torch.optim.AdamW(module.parameters())
    plan = run_plan.RunPlan(StorageConfig(), ScheduleConfig(), {}, 0, 0)  # made by hand, not resolved
    with pytest.raises(ValueError, match=r"left to the planner.*run_plan.resolve"):
        SnakeEngine(module, optimizer, plan, EngineRuntime(GreedySnakePrecision().dtypes, torch.device("cpu")))


def test_bad_placement_is_refused():
    with pytest.raises(ValueError, match=r"storage.placement='magic'"):
        StorageConfig(placement="magic")


def test_the_prediction_is_made_at_setup_and_refined_at_the_first_step():
    """A map-style DataLoader given to fit: the floor is known before the first step (from a batch collated
    from its first samples), then recomputed with what the first step measured. The units whose forward
    graph "auto" keeps (no recompute) are expected before step 1 from the timed unit's graph size: the
    first step keeps those units, and the prediction before step 1 already counted them."""
    import lightning as L

    seen = {}

    class Watch(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen["setup"] = trainer.strategy.prediction

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seen.setdefault("step1", trainer.strategy.prediction)

    _, strategy = run_snake(SMALL_GPT, 1, MICRO, MICRO_SIZE, "64-true", schedule_kind="auto", callbacks=[Watch()])
    assert seen["setup"] is not None and seen["setup"].roofline_s > 0
    assert strategy.plan.setup_prediction == seen["setup"]  # kept as it was made
    # what the timing behind it cost is reported with it
    assert strategy.plan.setup_timing_s > 0 and strategy.plan.as_dict()["setup_timing_s"] == strategy.plan.setup_timing_s
    assert f"predicted before step 1 {seen['setup'].roofline_s:.3f} s/step (its timing took" in strategy.plan.describe()
    # every unit below the last keeps its graph here, as expected before step 1: no recompute counted in either
    assert strategy.plan.kept_units == list(range(SMALL_GPT.num_layers - 1))
    assert seen["step1"].compute_s == pytest.approx(seen["setup"].compute_s)


def test_no_example_batch_from_an_iterable_dataset():
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(8)

    class Trainer:  # only what example_batch reads
        class fit_loop:
            class _data_source:
                instance = DataLoader(Stream(), batch_size=4)

    assert example_batch(Trainer) is None
    Trainer.fit_loop._data_source.instance = DataLoader(list(range(8)), batch_size=4)
    assert example_batch(Trainer).tolist() == [0, 1, 2, 3]


class _RunningAlpha(L.Callback):
    """What the engine runs with: its alpha and its own memory model of the plan (no checkpoints)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        self.alpha, self.host_plan = engine.alpha, host_plan(engine.memory_inputs())


@pytest.mark.parametrize("speculation", [None, "off"])
def test_parked_gradients_are_sized_with_the_alpha_that_runs(speculation):
    """Norm clipping (Trainer's gradient_clip_val): resolve decides the alpha that runs, and the plan's host
    bytes are the engine's own memory model of the run. With speculation (the default) the planner's
    alpha runs and the rollback state is counted; with speculation off whole updates are deferred, so
    alpha is 1 and every unit's whole gradient is parked. (Before, the plan sized the parked gradients
    with the nominal alpha while the engine parked whole units: over the budget on gpt_1b.)"""
    log = _RunningAlpha()
    extra = {"speculation": speculation} if speculation else {}
    _, strategy = run_snake(SMALL_GPT, 1, MICRO, MICRO_SIZE, "64-true", schedule_kind="auto", schedule_extra=extra,
                            callbacks=[log], trainer_extra={"gradient_clip_val": 1.0})
    plan = strategy.plan
    assert log.alpha == plan.schedule.alpha
    assert plan.host_bytes == sum(log.host_plan.values()), (plan.host_bytes, log.host_plan)
    module = GPTModule(SMALL_GPT)
    module.configure_model()
    trainable = sum(p.numel() for p in module.blocks.parameters())
    if speculation == "off":
        assert log.alpha == 1.0 and plan.step_mode == "deferred" and "rollback_state" not in log.host_plan
        assert log.host_plan["gradients"] >= trainable * 8  # every unit's whole gradient (page-padded units)
    else:
        assert log.alpha == pytest.approx(0.2) and plan.step_mode == "speculative"
        assert log.host_plan["rollback_state"] == plan.rollback_bytes > 0 and plan.storage.rollback == "host"
        assert log.host_plan["gradients"] < trainable * 8 * 0.5


def test_describe_shows_the_alpha_and_step_mode_that_run():
    log = _RunningAlpha()
    _, strategy = run_snake(SMALL_GPT, 1, MICRO, MICRO_SIZE, "64-true", schedule_kind="auto", callbacks=[log],
                            trainer_extra={"gradient_clip_val": 1.0})
    text = strategy.plan.describe()
    assert f"alpha {log.alpha}," in text and "optimizer step speculative (rollback state" in text, text
    plan = _resolve(schedule=ScheduleConfig(num_micro_batches=MICRO, alpha=0.25, speculation="off"))
    assert "alpha 0.25, optimizer step overlapped" in plan.describe()  # no clipping: nothing deferred
    clipped = run_plan.resolve(*_resolve_args(ScheduleConfig(num_micro_batches=MICRO, alpha=0.25, speculation="off")),
                               clip=("norm", 1.0))
    assert clipped.schedule.alpha == 1.0 and "alpha 1.0, optimizer step deferred" in clipped.describe()
    assert clipped.reasons["alpha"].startswith("1: norm clipping")
    fp16 = run_plan.resolve(*_resolve_args(ScheduleConfig(num_micro_batches=MICRO),
                                           dataclasses.replace(FP64, loss_scaling=True)))
    assert fp16.schedule.alpha == pytest.approx(0.2) and fp16.step_mode == "speculative"
    value = run_plan.resolve(*_resolve_args(ScheduleConfig(num_micro_batches=MICRO)), clip=("value", 1.0))
    assert value.step_mode == "overlapped" and value.rollback_bytes == 0
    # Under norm clipping the steps are predicted deferring (early norms clip); under fp16 loss scaling alone,
    # speculated (overflows are rare).
    norm = run_plan.resolve(*_resolve_args(ScheduleConfig(num_micro_batches=MICRO)), clip=("norm", 1.0))
    assert norm.deferring and "predicted deferring" in norm.describe()
    assert not fp16.deferring and "predicted speculated" in fp16.describe()
    assert not value.deferring and not clipped.deferring


class _Deferring(L.Callback):
    """What the plan predicts the steps to be after each step, beside what the step was."""

    def __init__(self) -> None:
        self.predicted, self.speculated = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.predicted.append(trainer.strategy.plan.deferring)
        self.speculated.append(trainer.strategy.engine.last_step.speculation)


@pytest.mark.parametrize("max_norm", [1e-6, 1e6])
def test_the_prediction_follows_whether_the_steps_defer(max_norm):
    """Under norm clipping the prediction takes the steps to defer; from the first steady step on it follows
    what they did: a max_norm every norm exceeds keeps them deferring, one no norm reaches has them speculate
    (step 1 speculates either way and is not a steady step)."""
    log = _Deferring()
    _, strategy = run_snake(SMALL_GPT, 3, MICRO, MICRO_SIZE, "64-true", schedule_kind="auto", callbacks=[log],
                            trainer_extra={"gradient_clip_val": max_norm})
    assert strategy.plan.step_mode == "speculative" and strategy.plan.prediction is not None
    if max_norm < 1:
        assert log.speculated == [True, False, False] and log.predicted == [True, True, True]
    else:
        assert log.speculated == [True, True, True] and log.predicted == [True, False, False]


def _resolve_args(schedule, dtypes=None):
    module = GPTModule(SMALL_GPT)
    module.configure_model()
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    return (module, optimizer, StorageConfig(placement="auto"), schedule, dtypes or FP64, torch.device("cpu"),
            HardwareProfile())


def test_a_storage_mapping_that_places_nothing_is_planned(tmp_path):
    """``storage={"ssd_dir": ...}`` (where the SSD tier goes, nothing else) leaves placement to the planner;
    a mapping that names a state keeps the manual default for the others; ``placement`` always wins."""
    placed = snake_strategy.GreedySnakeStrategy(storage={"ssd_dir": str(tmp_path), "host_budget_bytes": 2**30})
    assert placed.requested[0].placement == "auto" and placed.requested[0].weights is None
    named = snake_strategy.GreedySnakeStrategy(storage={"ssd_dir": str(tmp_path), "weights": "ssd"})
    assert named.requested[0].placement == "manual" and named.requested[0].optimizer.host == 1.0
    told = snake_strategy.GreedySnakeStrategy(storage={"ssd_dir": str(tmp_path), "placement": "manual"})
    assert told.requested[0].placement == "manual"
