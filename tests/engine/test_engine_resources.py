"""The engines' shared base (engine/base.py): what an engine opens it releases exactly once, also when its
construction stops half-way; and the weights it hands back (``TrainedWeights``) are what it says they are."""
from __future__ import annotations

import threading

import pytest
import torch

import snake_strategy
from snake_strategy.engine import DtypePolicy, EngineHooks, EngineRuntime, EvalEngine, SnakeEngine
from snake_strategy.gpt import GPTConfig, GPTModule
from snake_strategy.planning.run_plan import resolve
from snake_strategy.planning.time_model import HardwareProfile
from snake_strategy.precision import GreedySnakePrecision

CFG = GPTConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, context_len=8)
FP32 = DtypePolicy(torch.float32, torch.float32)
SSD = {"weights": "ssd", "optimizer": "ssd", "gradients": "ssd"}


def _module(frozen_block: bool = False) -> GPTModule:
    module = GPTModule(CFG)
    with torch.device("meta"):
        module.configure_model()
    if frozen_block:  # a frozen block: its parameters come back as stored, not from a master copy
        module.blocks[1].requires_grad_(False)
    return module


def _engine(ssd_dir, dtypes=FP32, hooks=None, frozen_block=False, evaluating=False):
    module = _module(frozen_block)
    optimizer = None if evaluating else module.configure_optimizers()
    plan = resolve(module, optimizer, snake_strategy.StorageConfig(ssd_dir=str(ssd_dir), **SSD),
                   snake_strategy.ScheduleConfig(kind="vertical"), dtypes, torch.device("cpu"), HardwareProfile())
    runtime = EngineRuntime(dtypes, torch.device("cpu"), hooks=hooks)
    if evaluating:
        return EvalEngine(module, plan, runtime)
    return SnakeEngine(module, optimizer, plan, runtime)


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


@pytest.mark.parametrize("evaluating", [False, True])
def test_a_failure_half_way_through_construction_releases_everything(tmp_path, evaluating):
    """The SSD directory (with its lock) and the I/O threads exist when materialization fails at its third
    SSD write: every one is released; a retry in the same process gets the same directory."""
    before = _threads()
    writes = []

    def fail_third_write(direction: str, num_bytes: int) -> None:
        writes.append(direction)
        if len(writes) == 3:
            raise OSError("the disk went away")

    with pytest.raises(OSError, match="the disk went away"):
        _engine(tmp_path / "ssd", hooks=EngineHooks(before_ssd_transfer=fail_third_write), evaluating=evaluating)
    assert len(writes) >= 3
    assert _threads() <= before
    assert not (tmp_path / "ssd").exists()
    engine = _engine(tmp_path / "ssd", evaluating=evaluating)  # the lock went with the directory
    assert (tmp_path / "ssd").exists() and _threads() > before
    engine.close()
    engine.close()  # each resource was released once: nothing is left to release, nothing raises
    assert _threads() <= before
    assert not (tmp_path / "ssd").exists()


@pytest.mark.parametrize("precision, frozen_block, evaluating", [
    ("32-true", False, False), ("32-true", True, False), ("bf16-mixed", True, False), ("bf16-mixed", False, True)])
def test_weight_specs_describe_the_weights_handed_back(tmp_path, precision, frozen_block, evaluating):
    """``weight_specs`` (what the weights file is sized and laid out from, read without I/O) names every
    parameter of the module once, with the dtype and shape ``named_weights`` then yields for it."""
    dtypes = GreedySnakePrecision(precision, half_weights=precision != "32-true").dtypes
    engine = _engine(tmp_path / "ssd", dtypes, frozen_block=frozen_block, evaluating=evaluating)
    try:
        specs = engine.weight_specs()
        yielded = [(name, value.dtype, value.shape) for name, value in engine.named_weights()]
        assert specs == yielded
        assert sorted(name for name, _, _ in specs) == sorted(name for name, _ in engine.module.named_parameters())
    finally:
        engine.close()
