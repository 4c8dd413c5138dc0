"""LayerPipe's split backward (``schedule.split_backward``): input gradients per micro-batch, Linear weight
gradients later as one product per call site. Exact against plain Lightning like every schedule:
float64 atol 1e-10, float32 rtol/atol 1e-5 (tests/exactness/test_against_lightning.py's reference and tolerances)."""
import dataclasses

import lightning as L
import pytest
import torch

from snake_strategy.config import ScheduleConfig
from snake_strategy.schedule import BACKWARD_INPUT, WEIGHT_GRAD, build_tasks, unit_run_ahead, weight_fetches
from tests.helpers import (SMALL_GPT, StackModule, assert_steps_close, fit_lightning, fit_snake, max_abs_diff,
                           run_reference, run_snake, token_loader)

STEPS, MICRO, MICRO_SIZE = 3, 4, 2
SSD = {"weights": "ssd", "optimizer": "ssd", "gradients": "host", "checkpoints": {"ssd": 1.0},
       "checkpoint_host_ends": 1}
# Linear call sites in one SMALL_GPT block (qkv, attention output, MLP in, MLP out), 4 blocks.
LINEARS_PER_STEP = 4 * SMALL_GPT.num_layers


class Stats(L.Callback):
    def __init__(self):
        self.steps, self.tasks = [], []

    def on_train_batch_end(self, trainer, *args):
        self.steps.append(trainer.strategy.engine.last_step.as_dict())
        self.tasks.append(list(trainer.strategy.engine.trace.last.tasks))


def test_split_tasks_are_explicit():
    tasks = build_tasks("vertical", 3, 2, split_backward=True)
    assert [repr(t) for t in tasks] == ["F(0,0)", "F(0,1)", "F(1,1)", "F(1,0)",
                                        "BX(2,0)", "BX(2,1)", "W(2,0,1)", "BX(1,1)", "BX(1,0)", "W(1,1,0)",
                                        "BX(0,0)", "BX(0,1)", "W(0,0,1)"]
    # The same weight fetches as the unsplit schedule: W(u) follows its unit's input-gradient tasks.
    assert weight_fetches(tasks) == weight_fetches(build_tasks("vertical", 3, 2))
    # W(2) holds no weights (its buffer is given back): the run-ahead from it is one unit longer.
    w2 = [repr(t) for t in tasks].index("W(2,0,1)")
    assert unit_run_ahead(tasks, w2, 1) == [1, 0] and unit_run_ahead(tasks, w2 - 1, 1) == [1]
    # Frozen lower units: no backward tasks of either kind below first_backward.
    lower = build_tasks("vertical", 3, 2, split_backward=True, first_backward=2)
    assert {t.unit for t in lower if t.kind in (BACKWARD_INPUT, WEIGHT_GRAD)} == {2}


def test_split_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="split_backward=true and schedule.batched_backward=true"):
        ScheduleConfig(kind="vertical", split_backward=True, batched_backward=True)
    with pytest.raises(ValueError, match=r"schedule.split_backward=true needs schedule.kind='vertical'"):
        ScheduleConfig(kind="horizontal", split_backward=True)
    with pytest.raises(ValueError, match="vertical"):
        build_tasks("horizontal", 2, 2, split_backward=True)


@pytest.mark.parametrize("precision,alpha,storage", [("64-true", 0.25, "ssd"), ("64-true", 0.0, "device"),
                                                    ("32-true", 0.25, "ssd")])
def test_split_backward_matches_plain_lightning(precision, alpha, storage, tmp_path):
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, warmup_steps=1, max_steps=STEPS)
    place = dict(SSD, ssd_dir=str(tmp_path)) if storage == "ssd" else {"weights": "device", "optimizer": "device"}
    stats = Stats()
    got, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, storage=place, callbacks=[stats],
                       schedule_extra={"split_backward": True, "alpha": alpha}, only_last=True,
                       warmup_steps=1, max_steps=STEPS)
    assert_steps_close(got, ref[-1:], precision)
    # The split really ran: its tasks, and every Linear weight gradient deferred to one product.
    expected = build_tasks("vertical", SMALL_GPT.num_layers, MICRO, split_backward=True)
    assert stats.tasks == [expected] * STEPS
    assert [s["weight_grad_products"] for s in stats.steps] == [LINEARS_PER_STEP] * STEPS


def test_unsplit_schedules_defer_nothing():
    stats = Stats()
    run_snake(SMALL_GPT, 1, MICRO, MICRO_SIZE, "32-true", callbacks=[stats])
    assert stats.steps[0]["weight_grad_products"] == 0


def test_split_backward_with_norm_clipping(tmp_path):
    clip = {"gradient_clip_val": 0.3, "gradient_clip_algorithm": "norm"}
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true", lr=1e-2, trainer_extra=clip)
    got, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true", lr=1e-2, trainer_extra=clip,
                       storage=dict(SSD, ssd_dir=str(tmp_path)), schedule_extra={"split_backward": True})
    assert_steps_close(got, ref, "64-true")


def test_split_backward_replays_dropout_like_the_unsplit_schedule(tmp_path):
    """Dropout: the input-gradient tasks recompute per micro-batch, as the forward ran, so the masks replay;
    the split run equals the unsplit vertical run with the same masks (fp64)."""
    config = dataclasses.replace(SMALL_GPT, dropout=0.1)
    plain, _ = run_snake(config, STEPS, MICRO, MICRO_SIZE, "64-true")
    split, _ = run_snake(config, STEPS, MICRO, MICRO_SIZE, "64-true", schedule_extra={"split_backward": True})
    assert_steps_close(split, plain, "64-true")
    assert max_abs_diff(split[0], split[-1]) > 1e-3


def test_split_backward_bf16_mixed_matches_plain_lightning(tmp_path):
    """Autocast is reproduced as autocast does it (bf16 products, the weight gradient cast to fp32). The
    deferred product sums the micro-batches inside one bf16 matmul, so the gradient is rounded to bf16 once
    instead of once per micro-batch: the tolerance is the batched backward's in the same precision."""
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "bf16-mixed")
    split, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "bf16-mixed", schedule_extra={"split_backward": True})
    batched, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "bf16-mixed",
                           schedule_extra={"batched_backward": True})
    split_err, batched_err = max_abs_diff(split[-1], ref[-1]), max_abs_diff(batched[-1], ref[-1])
    assert split_err <= max(2 * batched_err, 1e-6), (split_err, batched_err)


@pytest.mark.parametrize("case", ["lora_gpt", "part_of_block", "lower_half"])
def test_split_backward_with_frozen_parameters_and_lora(case, tmp_path):
    """Frozen weights are not deferred (they need no gradient); LoRA's adapters are nn.Linear: deferred."""
    finetune = pytest.importorskip("tests.hf.finetune_cases")  # skipped without peft/transformers
    stats = Stats()
    got, _, _ = finetune.run_snake(case, tmp_path / "ssd", schedule={"split_backward": True}, callbacks=[stats])
    assert_steps_close(got, finetune.reference(case), "64-true")
    assert all(s["weight_grad_products"] > 0 for s in stats.steps)


class OddBlock(torch.nn.Module):
    """A Linear called twice (two call sites of one weight), a weight used in a raw matmul (not F.linear:
    autograd's gradient in BX) and an elementwise gain."""

    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.raw = torch.nn.Parameter(torch.randn(width, width) * 0.1)
        self.gain = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        h = self.fc(torch.tanh(self.fc(x)))
        return x + (h * self.gain) @ self.raw


def test_split_backward_is_exact_for_any_block():
    def model():
        return StackModule(lambda i: OddBlock(16), width=16, depth=3).double()

    def params(run):
        return {n: p.detach() for n, p in run.module.named_parameters()}

    samples = STEPS * MICRO * MICRO_SIZE
    ref = fit_lightning(model, token_loader(samples, MICRO_SIZE, seq_len=8), steps=STEPS, precision="64-true",
                        accumulate=MICRO, record=None)
    stats = Stats()
    got = fit_snake(model, token_loader(samples, MICRO * MICRO_SIZE, seq_len=8), steps=STEPS, precision="64-true",
                    schedule={"kind": "vertical", "num_micro_batches": MICRO, "split_backward": True},
                    callbacks=[stats], record=None)
    assert_steps_close([params(got)], [params(ref)], "64-true")
    assert stats.steps[-1]["weight_grad_products"] == 2 * 3  # fc's two call sites per block; raw is autograd's
