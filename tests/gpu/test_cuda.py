"""The CUDA path, on a CUDA device only (`pytest -m cuda`; skipped elsewhere). Never run yet: see the
GPU page (docs/guide/gpu.md).

- the copy stream really orders copies against compute (a copy into a buffer that a slow kernel still
  reads waits for that kernel's event; compute waits for a copy before reading what it wrote) and
  really overlaps a kernel;
- activation checkpoints round-trip through pinned host buffers on the copy stream;
- the recompute reproduces the forward on CUDA: dropout masks, and SDPA's kernel choice with and
  without grad;
- training on the GPU equals plain Lightning on the GPU (fp32).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s at ~2 GHz, long enough to race against


def _streams():
    from snake_strategy.storage.streams import CudaCopyStream, copy_stream

    copies = copy_stream(torch.device("cuda"))
    assert isinstance(copies, CudaCopyStream)
    return copies


def test_copy_into_a_buffer_waits_for_the_kernel_reading_it():
    copies = _streams()
    buffer = torch.ones(2**20, device="cuda")
    new = torch.full((2**20,), 7.0).pin_memory()
    torch.cuda._sleep(SLEEP_CYCLES)  # compute is busy ...
    before = buffer * 2  # ... then reads the buffer
    released = copies.record()
    copied = copies.copy_async(buffer, new, after=released)  # must not overwrite before the read
    copies.wait_event(copied)
    after = buffer * 2  # must see the copy
    torch.cuda.synchronize()
    assert torch.equal(before, torch.full_like(before, 2.0))
    assert torch.equal(after, torch.full_like(after, 14.0))


def test_copies_overlap_a_kernel_and_need_no_device_synchronize():
    copies = _streams()
    host = torch.randn(64 * 2**20).pin_memory()  # 256 MiB
    dev = torch.empty_like(host, device="cuda")
    torch.cuda._sleep(4 * SLEEP_CYCLES)  # the compute stream is busy for ~0.4 s
    busy = copies.record()
    copied = copies.copy_async(dev, host)  # no `after`: independent of compute
    copied.wait()  # the host waits for the copy alone
    assert not busy.done(), "the copy waited for the kernel: it did not run on its own stream"
    copies.wait_event(copied)
    assert torch.equal(dev.cpu(), host)


def test_checkpoints_round_trip_through_pinned_buffers(tmp_path):
    from snake_strategy.activations import ActivationStore
    from snake_strategy.config import StorageConfig
    from snake_strategy.storage import IOEngine, SsdDirectory, TrafficCounters

    storage = StorageConfig(checkpoints={"host": 0.5, "ssd": 0.5}, checkpoint_host_ends=1)
    io, ssd = IOEngine(2), SsdDirectory(str(tmp_path))
    store = ActivationStore(storage, 4, 2, 2, torch.device("cuda"), TrafficCounters(), io, ssd)
    try:
        made = {}
        for m in range(4):
            torch.cuda._sleep(SLEEP_CYCLES // 4)  # the tensor is produced late: the D2H must wait for it
            made[m] = torch.randn(3, 16, 32, device="cuda") * (m + 1)
            store.put(1, m, made[m])
        for m in range(4):
            got = store.get(1, m)
            assert got.is_cuda and torch.equal(got, made[m]), m
            store.drop(1, m)
        store.clear()
        # reused pinned buffers must not leak the previous step's bytes
        again = torch.randn(3, 16, 32, device="cuda")
        store.put(1, 0, again)
        assert torch.equal(store.get(1, 0), again)
        store.clear()
    finally:
        io.close()
        ssd.close()


def _block(dropout: float, dtype: torch.dtype):
    from snake_strategy.gpt import Block, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, d_model=256, num_layers=1, num_heads=4, context_len=128, dropout=dropout)
    return Block(cfg).to("cuda", dtype).train()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_reproduces_the_forward(dropout, dtype):
    """What the engine does: the forward without grad records the RNG state; the backward recomputes
    with grad from it. The recomputed output must be the forward's, bit for bit: same dropout masks
    (attention and residual) and the same SDPA kernel with and without grad."""
    from snake_strategy.engine.step.runner import _replayed, _rng_state

    device = torch.device("cuda")
    block = _block(dropout, dtype)
    x = torch.randn(4, 128, 256, device=device, dtype=dtype)
    state = _rng_state(device)
    with torch.no_grad():
        forward = block(x)
    with _replayed(state, device), torch.enable_grad():
        recomputed = block(x.detach().requires_grad_(True))
    assert torch.equal(recomputed.detach(), forward)
    recomputed.sum().backward()  # the recompute's graph is usable


def test_training_on_the_gpu_matches_plain_lightning(tmp_path):
    from tests.helpers import SMALL_GPT, max_abs_diff, run_reference, run_snake

    gpu = {"accelerator": "gpu"}
    reference = run_reference(SMALL_GPT, 4, 4, 2, "32-true", trainer_extra=gpu)
    for storage in ({"weights": "device", "optimizer": "device", "gradients": "device", "checkpoints": "device"},
                    {"ssd_dir": str(tmp_path), "weights": "ssd", "optimizer": "ssd", "gradients": "host",
                     "checkpoints": {"host": 0.5, "ssd": 0.5}, "checkpoint_host_ends": 1}):
        states, _ = run_snake(SMALL_GPT, 4, 4, 2, "32-true", storage=storage, trainer_extra=gpu)
        for got, want in zip(states, reference):
            assert max_abs_diff(got, want) < 1e-5, storage
