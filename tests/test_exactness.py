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


def _assert_close(a, b, precision, what):
    assert a.keys() == b.keys()
    for name in a:
        if precision == "64-true":
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-10, msg=f"{what} {name}")
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=f"{what} {name}")


@pytest.mark.parametrize("batched_backward,batched_forward", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5])
@pytest.mark.parametrize("precision", ["64-true", "32-true"])
def test_optimizer_overlap_is_exact(precision, alpha, batched_backward, batched_forward, tmp_path):
    """The optimizer overlap runs undisturbed for 5 steps (nothing reads the weights until the end),
    with an LR schedule that changes every step, weights and moments on SSD."""
    module_kw = dict(warmup_steps=2, max_steps=STEPS)
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, **module_kw)
    storage = dict(STORAGES["ssd"], ssd_dir=str(tmp_path / "ssd"))
    got, strategy = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, precision, storage=storage,
                              schedule_extra={"alpha": alpha, "batched_backward": batched_backward,
                                              "batched_forward": batched_forward},
                              only_last=True, **module_kw)
    assert len(got) == 1
    _assert_close(got[0], ref[-1], precision, f"alpha={alpha} batched_backward={batched_backward}")


def test_forward_parts_are_really_deferred():
    """With alpha > 0 each unit has a non-empty forward part, so the deferral above is exercised."""
    from snake_strategy.planning.memory import forward_split
    from snake_strategy.gpt import Block
    numel = sum(p.numel() for p in Block(SMALL_GPT).parameters())
    assert 0 < forward_split(numel, 0.25) < numel
    assert forward_split(numel, 0.0) == 0


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
def test_validation_between_steps_flushes_and_stays_exact(kind, tmp_path):
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true", warmup_steps=1, max_steps=STEPS)
    storage = dict(STORAGES["ssd"], ssd_dir=str(tmp_path / "ssd"))
    got, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true", storage=storage, schedule_kind=kind,
                       schedule_extra={"alpha": 0.5}, only_last=True, validate_every_step=True,
                       warmup_steps=1, max_steps=STEPS)
    _assert_close(got[0], ref[-1], "64-true", "with validation")


def test_offloading_is_bitwise_identical_to_device_storage(tmp_path):
    """Moving state to the SSD and back changes no bit: device and ssd storage give identical runs."""
    on_device, _ = run_snake(SMALL_GPT, 3, MICRO, MICRO_SIZE, "32-true", storage=STORAGES["device"])
    storage = dict(STORAGES["ssd"], ssd_dir=str(tmp_path / "ssd"), checkpoints={"ssd": 1.0}, checkpoint_host_ends=0)
    on_ssd, _ = run_snake(SMALL_GPT, 3, MICRO, MICRO_SIZE, "32-true", storage=storage)
    for a, b in zip(on_device, on_ssd):
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_chunked_optimizer_steps_are_exact(tmp_path):
    """Units larger than the worker's chunk are stepped in several chunks (as 4B-parameter units are)."""
    from snake_strategy.gpt import Block

    assert sum(p.numel() for p in Block(SMALL_GPT).parameters()) > 3 * 4096
    ref = run_reference(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true")
    storage = dict(STORAGES["ssd"], ssd_dir=str(tmp_path / "ssd"), optimizer_chunk_elems=4096)
    got, _ = run_snake(SMALL_GPT, STEPS, MICRO, MICRO_SIZE, "64-true", storage=storage,
                       schedule_extra={"alpha": 0.25}, only_last=True)
    _assert_close(got[0], ref[-1], "64-true", "chunked")
