"""The optimizer's state as the plan counts it: bytes per parameter against values known from each class's
own state (not from the engine), for classes of every kind and slot count."""
import importlib.util

import pytest
import torch

from snake_strategy.optimizers import inspect_optimizer, step_kind

SHAPES = [(0, (256, 512)), (0, (512,))]  # one matrix and one vector in group 0


def _spec(make):
    params = [torch.nn.Parameter(torch.zeros(s)) for _, s in SHAPES]
    optimizer = make(params)
    return inspect_optimizer(optimizer, step_kind(optimizer), SHAPES, torch.float32)


@pytest.mark.parametrize("make, slots, bytes_per_param", [
    (lambda p: torch.optim.AdamW(p), 2, 8.0),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1, 4.0),
    (lambda p: torch.optim.SGD(p, lr=0.1), 0, 0.0),
    (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), 3, 12.0),
    (lambda p: torch.optim.Adam(p, amsgrad=True), 3, 12.0),
], ids=["adamw", "sgd_momentum", "sgd", "rmsprop_centered_momentum", "amsgrad"])
def test_bytes_per_parameter_known_values(make, slots, bytes_per_param):
    spec = _spec(make)
    assert len(spec.slots) == slots, spec.slots
    assert spec.bytes_per_elem(SHAPES) == pytest.approx(bytes_per_param)


def test_factored_state_is_sized_by_its_own_shapes():
    """Adafactor keeps a row and a column vector per matrix and a full variance per vector: 4 x (256 + 512)
    bytes for the matrix and 4 x 512 for the vector, over 256 x 512 + 512 parameters."""
    spec = _spec(lambda p: torch.optim.Adafactor(p))
    numel = 256 * 512 + 512
    assert spec.bytes_per_elem(SHAPES) == pytest.approx(4 * (256 + 512 + 512) / numel)
    matrix = dict((key, shape) for key, shape, _ in spec.state_of(0, (256, 512)).tensors)
    assert matrix == {"row_var": (256, 1), "col_var": (1, 512)}, matrix


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_8bit_state_is_counted_in_its_own_dtype():
    """FusedAdamW8bit: two uint8 codes per parameter plus one fp32 scale per 256 values of each moment, so
    2 + 2 x 4 / 256 = 2.03 B per parameter on matrices (vectors under 4096 elements stay fp32 moments)."""
    from snake_strategy.optimizers import FusedAdamW8bit
    spec = _spec(lambda p: FusedAdamW8bit(p, min_8bit_size=4096))
    matrix = spec.bytes_per_elem([SHAPES[0]])
    assert matrix == pytest.approx(2 + 2 * 4 / 256, rel=1e-3)
    assert {str(s.dtype) for s in spec.slots} >= {"torch.uint8", "torch.float32"}
