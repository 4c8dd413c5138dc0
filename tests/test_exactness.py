"""Offloading and scheduling must not change the math: greedysnake vs plain Lightning, element-wise.

Reference: strategy="auto", the same micro-batches through accumulate_grad_batches=M, torch.optim.AdamW.
float64: atol 1e-10 (only the summation order of the micro-batch gradients differs).
float32: rtol 1e-5, atol 1e-5 (AdamW divides near-zero gradients' rounding noise by eps).
"""
import pytest
import torch

from tests.helpers import SMALL_GPT, max_abs_diff, run_reference, run_snake

STEPS, MICRO, MICRO_SIZE = 5, 4, 2
STORAGES = {
    "device": {"weights": "device", "optimizer": "device", "gradients": "device", "checkpoints": "device"},
    "ssd": {"weights": "ssd", "optimizer": "ssd", "gradients": "host"},
}


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(precision):
        if precision not in cache:
            cache[precision] = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision)
        return cache[precision]

    return get


@pytest.mark.parametrize("blocks_per_unit", [1, 2])
@pytest.mark.parametrize("storage", ["device", "ssd"])
@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
@pytest.mark.parametrize("precision", ["64-true", "32-true"])
def test_matches_plain_lightning(references, precision, kind, storage, blocks_per_unit, tmp_path):
    ref = references(precision)
    storage_cfg = dict(STORAGES[storage], ssd_dir=str(tmp_path / "ssd"))
    got, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, storage=storage_cfg,
                       schedule_kind=kind, blocks_per_unit=blocks_per_unit)
    assert len(got) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(got, ref)):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype, name
            if precision == "64-true":
                torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-10, msg=f"step {step} {name}")
            else:
                torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=f"step {step} {name}")


def test_parameters_really_move(references):
    ref = references("64-true")
    assert max_abs_diff(ref[0], ref[-1]) > 1e-3
