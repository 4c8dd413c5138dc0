"""schedule.keep_activations: units whose forward graph is kept until their backward (no recompute) train
exactly as plain Lightning, on every schedule and storage; "auto" keeps what the host budget holds."""
from __future__ import annotations

import lightning as L
import pytest

import snake_strategy
from snake_strategy import ScheduleConfig
from snake_strategy.gpt import GPTConfig
from snake_strategy.planning.time_model import ModelShape, step_flops
from tests.helpers import max_abs_diff, run_reference, run_snake

CFG = GPTConfig(vocab_size=64, context_len=16, d_model=32, num_heads=4, num_layers=4)
STEPS, MICRO, MICRO_SIZE = 3, 4, 2


class StepStats(L.Callback):
    """The engine's per-step counters, read while it is alive."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(trainer.strategy.engine.last_step.as_dict())


@pytest.fixture
def reference(lightning_reference):
    return lightning_reference(CFG, STEPS, MICRO, MICRO_SIZE, "64-true")


def _ssd(tmp_path):
    # Weights on the SSD go through the buffer pool: the kept graph's saved weights must be read from the
    # buffer the backward fetched, which is generally not the one the forward used.
    return {"ssd_dir": str(tmp_path), "weights": "ssd", "optimizer": "ssd", "gradients": "host"}


@pytest.mark.parametrize("kind,batched", [("vertical", False), ("vertical", True), ("horizontal", False)])
@pytest.mark.parametrize("prefetch_depth", [1, 2])
def test_kept_graphs_match_plain_lightning(reference, kind, batched, prefetch_depth, tmp_path):
    extra = {"keep_activations": 2, "alpha": 0.25, "prefetch_depth": prefetch_depth}
    if batched:
        extra.update(batched_forward=True, batched_backward=True)
    stats = StepStats()
    states, strategy = run_snake(CFG, STEPS, MICRO, MICRO_SIZE, "64-true", storage=_ssd(tmp_path),
                                 schedule_kind=kind, schedule_extra=extra, callbacks=[stats])
    assert len(reference) == len(states) == STEPS
    for ref, got in zip(reference, states):
        assert max_abs_diff(ref, got) < 1e-10
    # 4 units: the last is fused; of units 0-2 the top two keep their graph, unit 0 is recomputed.
    tasks_per_unit = 1 if batched else MICRO
    assert [s["kept_tasks"] for s in stats.steps] == [2 * tasks_per_unit] * STEPS
    assert [s["recomputed_tasks"] for s in stats.steps] == [tasks_per_unit] * STEPS
    assert strategy.plan.kept_units == [1, 2]


def test_keep_every_unit_on_the_host_matches_plain_lightning(reference):
    stats = StepStats()
    states, _ = run_snake(CFG, STEPS, MICRO, MICRO_SIZE, "64-true", schedule_extra={"keep_activations": 99},
                          callbacks=[stats])
    assert len(reference) == len(states) == STEPS
    for ref, got in zip(reference, states):
        assert max_abs_diff(ref, got) < 1e-10
    assert [s["recomputed_tasks"] for s in stats.steps] == [0] * STEPS  # more than there are: all of them


def test_dropout_masks_of_a_kept_graph_are_the_forward_ones(tmp_path):
    """With dropout the vertical order draws other masks than plain Lightning: compare with the recompute,
    which replays the forward's masks. Keeping the graph uses those very masks."""
    cfg = GPTConfig(vocab_size=64, context_len=16, d_model=32, num_heads=4, num_layers=4, dropout=0.2)
    runs = {}
    for keep in (0, 3):
        runs[keep], _ = run_snake(cfg, STEPS, MICRO, MICRO_SIZE, "64-true", storage=_ssd(tmp_path / str(keep)),
                                  schedule_extra={"keep_activations": keep, "batched_forward": True,
                                                  "batched_backward": True})
    assert len(runs[0]) == len(runs[3]) == STEPS
    for a, b in zip(runs[0], runs[3]):
        assert max_abs_diff(a, b) < 1e-12


def test_frozen_lower_units_are_not_candidates():
    """Units below the first trainable one have no backward: nothing to keep there."""
    from snake_strategy.gpt import GPTModule

    class Frozen(GPTModule):
        def configure_model(self) -> None:
            super().configure_model()
            for p in [*self.wte.parameters(), *self.wpe.parameters(), *self.blocks[0].parameters()]:
                p.requires_grad_(False)

    stats = StepStats()
    ref = run_reference(CFG, 2, MICRO, MICRO_SIZE, "64-true", module_cls=Frozen)
    states, strategy = run_snake(CFG, 2, MICRO, MICRO_SIZE, "64-true", schedule_extra={"keep_activations": 99},
                                 module_cls=Frozen, callbacks=[stats])
    assert len(ref) == len(states) == 2
    for a, b in zip(ref, states):
        assert max_abs_diff(a, b) < 1e-10
    assert strategy.plan.kept_units == [1, 2]


def test_bf16_mixed_with_half_weights_is_bitwise_the_recompute():
    runs = {}
    for keep in (0, 3):
        runs[keep], _ = run_snake(CFG, 2, MICRO, MICRO_SIZE, "bf16-mixed",
                                  schedule_extra={"keep_activations": keep, "batched_forward": True,
                                                  "batched_backward": True})
    assert len(runs[0]) == len(runs[3]) == 2  # a run that recorded nothing compares nothing
    for a, b in zip(runs[0], runs[3]):
        assert max_abs_diff(a, b) == 0.0


def test_auto_keeps_what_the_host_budget_holds():
    """A budget that holds the plan plus two and a half units' graphs: auto keeps the top two."""
    _, strategy = run_snake(CFG, 1, MICRO, MICRO_SIZE, "64-true", schedule_kind="auto")
    assert strategy.plan.kept_units == [0, 1, 2]  # the default budget (a share of the machine) holds all
    # The measured graph size of one unit and the rest of the plan, from a run that keeps one explicitly
    # (same placement and schedule as below: all on the host, auto's batched passes).
    seen = {}

    class Plan(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seen.update(trainer.strategy.engine.host_bytes_plan(trainer.strategy.engine.checkpoint_bytes))

    run_snake(CFG, 1, MICRO, MICRO_SIZE, "64-true", storage={"placement": "manual"}, schedule_kind="auto",
              schedule_extra={"keep_activations": 1}, callbacks=[Plan()])
    per_unit = seen.pop("kept_graphs")
    budget = sum(seen.values()) + 2 * per_unit + per_unit // 2
    stats = StepStats()
    states, strategy = run_snake(CFG, 2, MICRO, MICRO_SIZE, "64-true", storage={"host_budget_bytes": budget},
                                 schedule_kind="auto", callbacks=[stats])
    assert strategy.plan.kept_units == [1, 2]
    assert "keep activations 2 units" in strategy.plan.describe()
    assert [s["recomputed_tasks"] for s in stats.steps] == [1, 1]  # auto batches: one task per unit
    assert [s["kept_tasks"] for s in stats.steps] == [2, 2]


def test_an_explicit_count_over_the_budget_is_refused_before_an_update():
    seen = {}

    class Plan(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seen.update(trainer.strategy.engine.host_bytes_plan(trainer.strategy.engine.checkpoint_bytes))

    run_snake(CFG, 1, MICRO, MICRO_SIZE, "64-true", callbacks=[Plan()])
    budget = sum(seen.values()) + 1000  # the plan fits, three units' graphs do not
    with pytest.raises(ValueError, match="keep_activations=3"):
        run_snake(CFG, 1, MICRO, MICRO_SIZE, "64-true", storage={"host_budget_bytes": budget},
                  schedule_extra={"keep_activations": 3})


@pytest.mark.parametrize("settings,match", [
    ({"keep_activations": "most"}, "must be 'auto' or a number"),
    ({"keep_activations": -1}, "must be >= 0"),
    ({"keep_activations": 2, "split_backward": True}, "split_backward"),
    ({"keep_activations": 2, "batched_forward": True, "batched_backward": False}, "group micro-batches alike"),
])
def test_bad_settings_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(kind="vertical", **settings)


def test_defaults():
    assert ScheduleConfig().keep_activations == "auto"
    assert ScheduleConfig(kind="vertical").keep_activations == 0  # the classic schedule, as before
    assert ScheduleConfig(kind="vertical", keep_activations=2.0).keep_activations == 2


def test_kept_units_drop_the_recompute_from_the_predicted_flops():
    shape = ModelShape(num_units=4, params_per_unit=1000, nonlayer_params=0, head_params=0, tokens_per_micro=10,
                       num_micro=2, checkpoint_bytes=0)
    recompute, kept = step_flops(shape), step_flops(ModelShape(**{**shape.__dict__, "kept_units": 3}))
    forward_of_three_units = 3 * 2 * 1000 * 10 * 2
    assert recompute - kept == pytest.approx(forward_of_three_units)


def test_strategy_accepts_keep_activations_from_a_mapping():
    strategy = snake_strategy.GreedySnakeStrategy(schedule={"kind": "vertical", "keep_activations": 2})
    assert strategy.requested[1].keep_activations == 2
