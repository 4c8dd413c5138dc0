"""A parameter that sits a step out costs no optimizer I/O: its master weights and optimizer state are neither
read nor written, on any tier, and ``StepStats.optimizer_skipped_bytes`` counts them. An MoE with eight experts
per block, where some steps route every sample to one expert, moves measurably fewer optimizer bytes in those
steps, and still trains exactly as plain Lightning (float64, atol 1e-10)."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

from snake_strategy.engine.view import running_engine
from tests.helpers import assert_steps_close, fit_lightning, fit_snake
from tests.moe.models import MoEStack

WIDTH, DEPTH, EXPERTS, VOCAB, SEQ = 64, 2, 8, 32, 6
STEPS, MICRO, MICRO_SIZE = 4, 2, 4  # 8 samples a step: one per expert in the dense steps
SPARSE = {1, 3}  # in these steps every sample goes to expert 0: the other seven sit the step out
# One expert: Linear(64, 128) and Linear(128, 64) with biases.
EXPERT_ELEMS = WIDTH * 2 * WIDTH + 2 * WIDTH + 2 * WIDTH * WIDTH + WIDTH
ADAMW_FP64_BYTES = 8 * 3  # master value + exp_avg + exp_avg_sq per element


def loader(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    samples = STEPS * MICRO * MICRO_SIZE
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=g)
    route = torch.arange(samples) % EXPERTS
    for step in SPARSE:
        route[step * MICRO * MICRO_SIZE:(step + 1) * MICRO * MICRO_SIZE] = 0
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:], route), batch_size=batch_size, shuffle=False)


class StepFigures(L.Callback):
    def __init__(self) -> None:
        self.skipped, self.moment_reads = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = running_engine(trainer).last_step
        self.skipped.append(step.optimizer_skipped_bytes)
        # Only the worker reads the moments (the master is the weights store, which the forward reads too).
        self.moment_reads.append(sum(v for k, v in step.step_traffic().items()
                                     if k.endswith(("exp_avg/read", "exp_avg_sq/read"))))


def model():
    return MoEStack(width=WIDTH, depth=DEPTH, vocab=VOCAB, num_experts=EXPERTS)


def snake(tmp_path, storage):
    figures = StepFigures()
    # alpha 0: every unit is stepped within its own step, so each step reports its own skipped bytes.
    run = fit_snake(model, loader(MICRO * MICRO_SIZE), steps=STEPS, precision="64-true",
                    storage={**storage, "ssd_dir": str(tmp_path / "ssd")},
                    schedule={"kind": "vertical", "num_micro_batches": MICRO, "alpha": 0.0}, callbacks=[figures])
    return run.states, figures


def reference():
    return fit_lightning(model, loader(MICRO_SIZE), steps=STEPS, accumulate=MICRO, precision="64-true").states


def test_sat_out_experts_are_not_read_or_written_on_the_host(tmp_path):
    """On the host (stepped in place on a CPU run) every skipped byte is counted exactly: seven experts per block,
    in the sparse steps only."""
    got, figures = snake(tmp_path, {"weights": "host", "optimizer": "host", "gradients": "host"})
    assert_steps_close(got, reference(), "64-true")
    idle = (EXPERTS - 1) * DEPTH * EXPERT_ELEMS * ADAMW_FP64_BYTES
    assert figures.skipped == [idle if step in SPARSE else 0 for step in range(STEPS)]


@pytest.mark.parametrize("optimizer_share", ["ssd", "split"])
def test_sat_out_experts_cost_no_ssd_traffic(optimizer_share, tmp_path):
    """On the SSD, whose transfers are whole 4096-element pages, all but the partial pages at a run's ends are
    skipped; the sparse steps read at least that much less, and the training stays exact."""
    optimizer = "ssd" if optimizer_share == "ssd" else {"host": 0.5, "ssd": 0.5}
    got, figures = snake(tmp_path, {"weights": "ssd", "optimizer": optimizer, "gradients": "host"})
    assert_steps_close(got, reference(), "64-true")
    idle = (EXPERTS - 1) * DEPTH * EXPERT_ELEMS * ADAMW_FP64_BYTES
    for step in range(STEPS):
        if step in SPARSE:
            assert 0.75 * idle <= figures.skipped[step] <= idle, (step, figures.skipped[step], idle)
            moments_skipped = figures.skipped[step] * 2 // 3  # two of the three 8-byte values per element
            # The SSD counters round each transfer up to whole pages: equal to within those roundings.
            assert figures.moment_reads[step - 1] - figures.moment_reads[step] == pytest.approx(moments_skipped, rel=0.01)
        else:
            assert figures.skipped[step] == 0
