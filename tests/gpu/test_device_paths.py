"""The GPU path's CPU-testable parts: the pinned allocation rule and its accounting in the memory plan,
the staging pool's ordered release, and the copy stream's CPU implementation (events complete, copies
inline). The CUDA behaviour itself is in tests/gpu/test_cuda.py (skipped without a device)."""
from __future__ import annotations

import threading

import pytest
import torch

from snake_strategy.config import StorageConfig
from snake_strategy.planning.memory_model import (WEIGHT_STAGING_BUFFERS, MemoryInputs, checkpoint_tiers, host_plan,
                                                  pinned_host_shares, weight_staging_elems)
from snake_strategy.storage.aligned import PAGE_BYTES, aligned_allocation_bytes, pinned_allocation_bytes
from snake_strategy.storage.pool import BufferPool
from snake_strategy.storage.streams import DONE, CopyStream, Event, copy_stream
from snake_strategy.storage.tiered import tier_bounds

MiB = 2**20


@pytest.mark.parametrize("asked,taken", [(0, 0), (1, 1), (2, 2), (3, 4), (4096, 4096), (4097, 8192),
                                         (64 * MiB, 64 * MiB), (64 * MiB + 1, 128 * MiB), (65 * MiB, 128 * MiB)])
def test_pinned_allocations_round_up_to_a_power_of_two(asked, taken):
    assert pinned_allocation_bytes(asked) == taken


def test_aligned_allocation_bytes():
    # pageable: the page-rounded payload + one page of alignment slack
    assert aligned_allocation_bytes(1, 4) == 2 * PAGE_BYTES
    assert aligned_allocation_bytes(1024, 4) == 2 * PAGE_BYTES
    assert aligned_allocation_bytes(0, 4) == 2 * PAGE_BYTES  # aligned_empty never allocates 0 bytes
    # pinned: no slack (pinned blocks are page-aligned), but the power-of-two rounding
    assert aligned_allocation_bytes(2**24, 4, pin_memory=True) == 64 * MiB
    assert aligned_allocation_bytes(2**24 + 1, 4, pin_memory=True) == 128 * MiB
    assert aligned_allocation_bytes(3 * 2**20, 2, pin_memory=True) == 8 * MiB


def test_pool_counts_real_allocation_sizes():
    pool = BufferPool("t", 2, 1000, torch.float32, torch.device("cpu"))
    assert pool.bytes_allocated == 0
    a = pool.acquire()
    assert a.numel() == 1000 and a.data_ptr() % PAGE_BYTES == 0
    assert pool.bytes_allocated == pool.buffer_bytes == 4096 + PAGE_BYTES
    pool.release(a)
    assert pool.acquire() is a  # reused, not reallocated
    assert pool.bytes_allocated == pool.buffer_bytes
    # what a pinned pool of the same shape would be charged, without allocating it (no CUDA here)
    pinned = BufferPool("p", 2, 3 * 2**20 + 1, torch.float32, torch.device("cpu"), pin_memory=True)
    assert pinned.buffer_bytes == 16 * MiB
    with pytest.raises(AssertionError, match="only host buffers"):
        BufferPool("d", 1, 10, torch.float32, torch.device("meta"), pin_memory=True)


class _Pending(Event):
    """A stand-in for an incomplete CUDA event: records that someone waited on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = 0

    def wait(self) -> None:
        self.waited += 1


def test_pool_hands_out_the_release_event_and_waits_for_it_in_acquire():
    pool = BufferPool("t", 1, 16, torch.float32, torch.device("cpu"))
    a, ready = pool.acquire_ordered()
    assert ready is DONE
    event = _Pending()
    pool.release(a, event)
    b, ready = pool.acquire_ordered()  # a stream writer gets the event to wait on, device-side
    assert b is a and ready is event and event.waited == 0
    pool.release(b, event)
    assert pool.acquire() is a and event.waited == 1  # a host writer waits for it before reuse
    with pytest.raises(AssertionError, match="not out"):
        pool.release(torch.empty(16))


def test_pool_backpressure_is_bounded():
    pool = BufferPool("t", 2, 8, torch.float32, torch.device("cpu"))
    held = [pool.acquire(), pool.acquire()]
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire()))
    t.start()
    t.join(0.2)
    assert not got and pool._allocated == 2  # waits instead of allocating a third
    pool.release(held[0])
    t.join(5)
    assert got == [held[0]] and pool.peak_out == 2


def test_cpu_copy_stream_runs_copies_inline_with_complete_events():
    copies = copy_stream(torch.device("cpu"))
    assert type(copies) is CopyStream
    src, dst = torch.arange(10.0), torch.zeros(10)
    event = copies.copy_async(dst, src, after=copies.record())
    assert event.done() and torch.equal(dst, src)
    event.wait()
    copies.wait_event(event)
    with copies.issuing(after=event) as batch:
        dst.mul_(2)
    assert batch.event.done() and torch.equal(dst, 2 * src)
    copies.synchronize()


def _inputs(storage: StorageConfig, cpu: bool, **kw) -> MemoryInputs:
    return MemoryInputs(unit_params=(3_000_000, 3_000_000, 1_000_000), nonlayer_params=1000, compute_bytes=2,
                        master_bytes=4, device_is_cpu=cpu, storage=storage, **kw)


def test_host_plan_counts_pinned_sizes_on_cuda_only():
    storage = StorageConfig(weights={"host": 0.5, "ssd": 0.5}, master={"host": 1.0}, optimizer={"ssd": 1.0},
                            gradients={"host": 1.0}, checkpoints={"host": 0.5, "ssd": 0.5}, checkpoint_host_ends=1)
    cpu = host_plan(_inputs(storage, True, num_micro=4, checkpoint_bytes=3000))
    cuda = host_plan(_inputs(storage, False, num_micro=4, checkpoint_bytes=3000))
    assert "weight_staging" not in cpu
    units = (3_000_000, 3_000_000, 1_000_000)
    # weights: each unit's host share is one pinned allocation, rounded up to a power of two
    shares = [tier_bounds(n, storage.weights) for n in units]
    assert cuda["weights"] == sum(pinned_allocation_bytes((h - d) * 2 + (-(h - d) * 2) % PAGE_BYTES) for d, h in shares)
    assert cuda["weights"] == 2 * 4 * MiB + 1 * MiB  # 1.5M bf16 (3 MB) -> 4 MiB; 0.5M (1 MB) -> 1 MiB
    assert cuda["weights"] > cpu["weights"]
    assert cuda["master"] == pinned_host_shares(units, storage.master, 4) == 2 * 16 * MiB + 4 * MiB
    assert cuda["optimizer_moments"] == 2 * pinned_host_shares(units, storage.optimizer, 4)
    staging = weight_staging_elems(units, storage.weights)
    assert staging == max(n - h for n, (_, h) in zip(units, shares))
    assert cuda["weight_staging"] == WEIGHT_STAGING_BUFFERS * 4 * MiB
    # checkpoints: 3000 bytes -> one 4 KiB pinned buffer each; of 4 micro-batches the ends stay on the host
    assert checkpoint_tiers(storage, 4) == ["host", "ssd", "ssd", "host"]
    assert cuda["checkpoints"] == 2 * 3 * 4096
    assert cuda["checkpoint_io_buffers"] == (2 + 1) * 4096
    # a unit's weight gradients as autograd returns them are device tensors on CUDA
    assert cuda["weight_gradients"] == 0 and cpu["weight_gradients"] == 3_000_000 * 2
    # nothing else changes between the devices
    same = set(cpu) - {"weights", "master", "optimizer_moments", "gradients", "checkpoints", "checkpoint_io_buffers",
                       "weight_gradients"}
    assert {k: cuda[k] for k in same} == {k: cpu[k] for k in same}


def test_pinned_staging_pool_size_matches_the_plan():
    """The streamer's staging pool on CUDA has exactly the shape memory_model.host_plan charges for."""
    split = StorageConfig(weights={"host": 0.3, "ssd": 0.7}).weights
    units = (123_457, 4096 * 50, 99)
    elems = weight_staging_elems(units, split)
    assert elems == max(n - tier_bounds(n, split)[1] for n in units)
    pool = BufferPool("weight-staging", WEIGHT_STAGING_BUFFERS, elems, torch.bfloat16, torch.device("cpu"),
                      pin_memory=True)
    assert pool.buffer_bytes * pool.capacity == WEIGHT_STAGING_BUFFERS * aligned_allocation_bytes(elems, 2, True)


class _Recorded(Event):
    def __init__(self, log: list, name: str) -> None:
        super().__init__()
        self.name = name
        log.append(("record" if name.startswith("c") else "copied", name))


class RecordingStream(CopyStream):
    """The CPU stream, with every event made distinct and every ordering call logged."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.log: list[tuple] = []
        self._n = 0

    def _event(self, prefix: str) -> Event:
        self._n += 1
        return _Recorded(self.log, f"{prefix}{self._n}")

    def issuing(self, after=None):
        stream = self

        class _Ctx:
            def __enter__(self):
                stream.log.append(("issue", getattr(after, "name", None)))
                self.batch = type("B", (), {"event": DONE})()
                return self.batch

            def __exit__(self, *exc):
                if exc[0] is None:
                    self.batch.event = stream._event("k")
                return False

        return _Ctx()

    def record(self) -> Event:
        return self._event("c")

    def wait_event(self, event: Event) -> None:
        self.log.append(("wait", getattr(event, "name", None)))


def test_weight_fetches_are_ordered_by_events(monkeypatch, tmp_path):
    """The schedule code's ordering on CPU: each fetched unit's copy event is waited on by the compute
    stream before use, and a reused buffer is written only after the compute event of its release."""
    import snake_strategy.engine.stream.streamer as weights_module
    from tests.helpers import SMALL_GPT, run_snake

    streams: list[RecordingStream] = []

    def make(device):
        streams.append(RecordingStream(device))
        return streams[-1]

    monkeypatch.setattr(weights_module, "copy_stream", make)
    storage = {"ssd_dir": str(tmp_path), "weights": "ssd", "optimizer": "ssd", "gradients": "host"}
    _, strategy = run_snake(SMALL_GPT, 2, 2, 1, "32-true", storage=storage)
    log = streams[0].log
    issues = [entry for entry in log if entry[0] == "issue"]
    waits = [entry[1] for entry in log if entry[0] == "wait"]
    copied = [entry[1] for entry in log if entry[0] == "copied"]
    assert issues and len(waits) == len(issues) == len(copied)
    assert all(name in copied for name in waits)  # the compute stream waits on copy events only
    # every buffer beyond the pool's first allocations is rewritten only after the event of its release
    # (compute's last read of it, or the copy of a prefetch drained unused)
    capacity = 1 + strategy.schedule.prefetch_depth
    assert all(after is not None for _, after in issues[capacity:])
    assert any(after.startswith("c") for _, after in issues[capacity:])
    # each wait comes after the copy it waits for
    position = {entry[1]: i for i, entry in enumerate(log) if entry[0] in ("copied", "record")}
    assert all(position[name] < i for i, entry in enumerate(log) if entry[0] == "wait" for name in [entry[1]])


def test_checkpoint_store_pinned_path_bookkeeping(monkeypatch, tmp_path):
    """The CUDA branch of the activation store (host checkpoints copied into reusable pinned buffers),
    run on CPU with pinning faked: values, counters and buffer reuse are right."""
    import snake_strategy.activations as activations
    from snake_strategy.storage import IOEngine, SsdDirectory, TrafficCounters
    from snake_strategy.storage.aligned import aligned_empty

    monkeypatch.setattr(activations, "aligned_empty", lambda n, dtype, pin_memory=False: aligned_empty(n, dtype))
    storage = StorageConfig(checkpoints={"host": 0.5, "ssd": 0.5}, checkpoint_host_ends=1)
    io, ssd = IOEngine(2), SsdDirectory(str(tmp_path))
    counters = TrafficCounters()
    store = activations.ActivationStore(storage, 4, 2, 2, torch.device("cpu"), counters, io, ssd)
    store._pin = True  # the CUDA branch
    try:
        seen_buffers = set()
        for step in range(2):
            made = {m: torch.randn(3, 8, 4) + 10 * step + m for m in range(4)}
            for m in range(4):
                store.put(1, m, made[m])
            assert set(store._pinned) == {(1, 0), (1, 3)}  # the host ends; the middle went to the SSD
            seen_buffers |= {b.data_ptr() for b, _ in store._pinned.values()}
            for m in range(4):
                assert torch.equal(store.get(1, m), made[m])
                store.drop(1, m)
            assert not store._pinned and len(store._pinned_spare) == 2
            store.clear()
        assert len(seen_buffers) == 2  # the second step reused the first step's pinned buffers
        snapshot = counters.snapshot()
        assert snapshot[("host", "checkpoints", "write")] == snapshot[("host", "checkpoints", "read")] == 2 * 2 * 384
    finally:
        io.close()
        ssd.close()
