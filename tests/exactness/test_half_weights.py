"""Half-precision weight storage in bf16-mixed / 16-mixed (engine/state/half_weights.py).

- The numbers are autocast's: training with the matmul weights stored in half equals training with fp32
  compute weights (``half_weights=False``) bit for bit, and plain Lightning within the bf16-mixed
  tolerance of tests/exactness/test_precisions.py.
- The weight bytes halve: every fetch reads the half vector (plus the small fp32 tail from the host), as
  the public counters show, and the planner's predicted bytes still equal them.
- A block that would use a half-stored weight outside an autocast matmul is refused before any update.
"""
import lightning as L
import pytest
import torch
from torch import nn

from snake_strategy import GreedySnakePrecision
from snake_strategy.gpt import GPTModule
from snake_strategy.schedule import weight_fetches
from snake_strategy.storage import round_up
from tests.helpers import (SMALL_GPT, AlignedStack, assert_bitwise, fit_resumable, fit_snake, max_abs_diff,
                           token_loader)

STEPS, MICRO, MICRO_SIZE, LR = 3, 4, 2, 1e-3
SSD = {"weights": "ssd", "optimizer": "ssd", "master": "ssd"}


class Grab(L.Callback):
    """Per-step counters and the unit geometry while the engine is alive."""

    def __init__(self):
        self.traffic, self.units, self.tasks, self.dtypes, self.tails = [], None, None, None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        self.traffic.append(dict(engine.last_step.traffic))
        self.units = engine.storage_layout()
        self.tasks = list(engine.trace.last.tasks)
        self.dtypes = {u.weights.dtype for u in engine.units}
        self.tails = [u.tail.numel * 4 if u.tail is not None else 0 for u in engine.units]


def train(tmp_path, half, precision="bf16-mixed", module=None, storage=SSD, steps=STEPS, micro=MICRO,
          context=SMALL_GPT.context_len, vocab=SMALL_GPT.vocab_size, alpha=0.25):
    grab = Grab()
    run = fit_snake(module if module is not None else (lambda: GPTModule(SMALL_GPT, learning_rate=LR)),
                    token_loader(steps * micro * MICRO_SIZE, micro * MICRO_SIZE, context, vocab), steps=steps,
                    storage=dict(storage, ssd_dir=str(tmp_path / f"ssd-{half}-{precision}")),
                    schedule={"num_micro_batches": micro, "alpha": alpha}, callbacks=[grab],
                    precision_plugin=GreedySnakePrecision(precision, half_weights=half))
    assert len(run.states) == steps
    return run.states, grab


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_half_storage_trains_bitwise_like_fp32_compute_weights(tmp_path, precision):
    half, grab = train(tmp_path, True, precision)
    full, grab_full = train(tmp_path, False, precision)
    assert grab.dtypes == {torch.bfloat16 if precision == "bf16-mixed" else torch.float16}
    assert grab_full.dtypes == {torch.float32}
    for step, (a, b) in enumerate(zip(half, full)):
        for name in a:
            assert a[name].dtype == torch.float32, name  # the module gets the fp32 master values
            assert torch.equal(a[name], b[name]), (step, name, (a[name] - b[name]).abs().max().item())
    moved = max_abs_diff(half[-1], half[0])
    assert moved > 1e-4  # the weights really move


def test_weight_fetches_read_half_the_bytes(tmp_path):
    # 128 x 128 Linear weights without bias: every block parameter is stored in half, no fp32 tail.
    data = dict(context=16, vocab=64, micro=4)
    _, half = train(tmp_path, True, module=AlignedStack(), **data)
    _, full = train(tmp_path, False, module=AlignedStack(), **data)
    fetches = weight_fetches(half.tasks)
    assert len(fetches) == 2 * 4 - 1
    assert half.tails == [0] * 4
    for unit_half, unit_full in zip(half.units, full.units):
        assert unit_half["weights_ssd"] == round_up(128 * 128 * 2) == unit_full["weights_ssd"] // 2
        assert not unit_half["weights_is_master"] and unit_full["weights_is_master"]
    for step in range(STEPS):
        # The master is its own store in half storage: the weights counter is the fetches alone.
        assert half.traffic[step]["ssd/weights/read"] == len(fetches) * round_up(128 * 128 * 2)
    # fp32: the fetches read 2x as much (the same store also serves the optimizer's master reads, which
    # land in this counter when the worker runs before the step ends: at least the fetches are there).
    assert full.traffic[-1]["ssd/weights/read"] >= 2 * half.traffic[-1]["ssd/weights/read"]


def test_gpt_fetches_read_half_vector_plus_host_tail(tmp_path):
    _, grab = train(tmp_path, True)
    fetches = weight_fetches(grab.tasks)
    p = SMALL_GPT.block_params()
    # LayerNorm gains and biases stay fp32 (the tail, on the host); the rest is bf16 on the SSD.
    assert SMALL_GPT.bias
    d, hidden = SMALL_GPT.d_model, SMALL_GPT.mlp_ratio * SMALL_GPT.d_model
    tail_bytes = 4 * (2 * 2 * d + 3 * d + d + hidden + d)
    assert grab.tails == [tail_bytes] * SMALL_GPT.num_layers
    for unit in grab.units:
        assert unit["weights_ssd"] == round_up(p * 2)
    for step in range(STEPS):
        assert grab.traffic[step]["ssd/weights/read"] == sum(grab.units[u]["weights_ssd"] for u in fetches)
        assert grab.traffic[step]["host/weights/read"] == len(fetches) * tail_bytes


class Leaky(nn.Linear):
    def forward(self, x):
        return super().forward(x) + self.weight.mean()


class WeightSumModel(AlignedStack):
    """A block that adds its Linear weight's mean to the output: an op autocast runs in fp32, where a
    weight stored in bf16 would give another result."""

    def __init__(self):
        super().__init__(width=32, depth=2)
        self.blocks = nn.ModuleList(Leaky(32, 32) for _ in range(2))


def test_weight_used_outside_a_matmul_is_refused_before_any_update(tmp_path):
    data = dict(context=8, vocab=64, micro=2, steps=1, storage={"weights": "ssd", "optimizer": "ssd"})
    with pytest.raises(ValueError, match=r"blocks\.0\.weight.*'mean'.*half_weights=False"):
        train(tmp_path, True, module=WeightSumModel(), **data)
    states, _ = train(tmp_path, False, module=WeightSumModel(), **data)
    assert len(states) == 1


def test_frozen_weights_stay_full_precision(tmp_path):
    config = SMALL_GPT

    def frozen_module():
        torch.manual_seed(0)
        module = GPTModule(config, learning_rate=LR)
        module.configure_model()
        for p in module.blocks[0].parameters():
            p.requires_grad_(False)
        for p in [*module.blocks[1].mlp_in.parameters(), *module.blocks[1].mlp_out.parameters()]:
            p.requires_grad_(False)
        return module

    initial = {n: p.detach().clone() for n, p in frozen_module().named_parameters() if not p.requires_grad}
    assert initial
    half, grab = train(tmp_path, True, module=frozen_module())
    full, _ = train(tmp_path, False, module=frozen_module())
    for a, b in zip(half, full):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    for name, value in initial.items():
        assert half[-1][name].dtype == torch.float32
        assert torch.equal(half[-1][name], value), name  # exported exactly as they came in


def test_resume_with_half_storage_is_bitwise_identical(tmp_path):
    # A resume loads the master and refreshes the half vector and the fp32 tail from it.
    def fit(steps, ssd_dir, **kw):
        return fit_resumable(steps, ssd_dir, kind="auto", storage=SSD,
                             precision_plugin=GreedySnakePrecision("bf16-mixed"), **kw).last

    straight = fit(6, tmp_path / "a")
    fit(3, tmp_path / "b", ckpt_dir=tmp_path / "ckpts")
    resumed = fit(6, tmp_path / "c", ckpt_path=str(tmp_path / "ckpts" / "epoch=0-step=3.ckpt"))
    assert_bitwise(resumed, straight)
