"""The SSD tier: bitwise round trips through TieredTensor, ActivationStore and IOEngine, file lifetime
in the configured directory, and the fallback for filesystems that refuse O_DIRECT."""
from __future__ import annotations

import errno
import fcntl
import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from snake_strategy.activations import ActivationStore
from snake_strategy.config import StorageConfig, TierShares
from snake_strategy.gpt import GPTModule
from snake_strategy.storage import PAGE_BYTES, IOEngine, SsdDirectory, TieredTensor, TrafficCounters, aligned_empty
from snake_strategy.storage import io_engine
from snake_strategy.storage.aligned import padded_bytes
from snake_strategy.storage.tiered import ALIGN_ELEMS
from tests.helpers import SMALL_GPT, fit_lightning, fit_snake, token_loader

CPU = torch.device("cpu")
MIB = 2**20


@pytest.fixture
def ssd(tmp_path):
    directory = SsdDirectory(str(tmp_path / "ssd"))
    io = IOEngine(num_threads=2)
    yield directory, io
    io.close()
    directory.close()


def random_tensor(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=g)
    return torch.randn(numel, generator=g, dtype=torch.float32).to(dtype)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------------------------------- TieredTensor
SPLITS = {
    "ssd": TierShares(device=0.0, host=0.0, ssd=1.0),
    "host_ssd": TierShares(device=0.0, host=0.5, ssd=0.5),
    "all3": TierShares(device=0.3, host=0.3, ssd=0.4),
    "device_ssd": TierShares(device=0.7, host=0.0, ssd=0.3),
    "host": TierShares(device=0.0, host=1.0, ssd=0.0),
}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("num_bytes", [0, 1, 4095, 4096, MIB + 1])
def test_tiered_round_trip_bytes(ssd, split, num_bytes):
    directory, io = ssd
    counters = TrafficCounters()
    t = TieredTensor(f"t{num_bytes}", "weights", num_bytes, torch.uint8, SPLITS[split], CPU, counters, io, directory)
    assert 0 <= t.device_end <= t.host_end <= t.numel == num_bytes
    if t.host_end < num_bytes:
        assert t.host_end % PAGE_BYTES == 0  # the SSD segment starts on a page
    value = random_tensor(num_bytes, torch.uint8, seed=num_bytes)
    t.evict(value)
    out = t.fetch(t.new_buffer())
    assert bitwise_equal(out, value)
    assert bitwise_equal(t.read_full(), value)
    if SPLITS[split].ssd == 1.0 and num_bytes:
        assert t.host_end == t.device_end == 0
        assert t.ssd_bytes == -(-num_bytes // PAGE_BYTES) * PAGE_BYTES
        assert os.path.getsize(t.ssd_path) == t.ssd_bytes
        assert counters.get("ssd", "weights", "write") == t.ssd_bytes
        assert counters.get("ssd", "weights", "read") == 2 * t.ssd_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("split", ["ssd", "host_ssd", "all3"])
@pytest.mark.parametrize("numel", [1, 1023, 1024, 2049, 262_145])
def test_tiered_round_trip_dtypes(ssd, dtype, split, numel):
    directory, io = ssd
    t = TieredTensor("x", "exp_avg", numel, dtype, SPLITS[split], CPU, TrafficCounters(), io, directory)
    value = random_tensor(numel, dtype, seed=numel)
    value[0] = float("nan")  # NaN payload survives bitwise too
    t.evict(value)
    assert bitwise_equal(t.fetch(t.new_buffer()), value)


def test_tiered_evict_from_page_aligned_buffer_and_overwrite(ssd):
    directory, io = ssd
    numel = 3 * 1024 + 5
    t = TieredTensor("y", "gradients", numel, torch.float32, SPLITS["ssd"], CPU, TrafficCounters(), io, directory)
    for seed in range(3):  # the file is rewritten in place; each fetch sees the latest value
        src = aligned_empty(numel, torch.float32)  # takes the zero-copy write path
        src.copy_(random_tensor(numel, torch.float32, seed))
        t.evict(src)
        assert bitwise_equal(t.fetch(t.new_buffer()), random_tensor(numel, torch.float32, seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("split", ["ssd", "host_ssd", "all3"])
def test_tiered_ranges_round_trip_and_leave_the_rest_alone(ssd, dtype, split):
    directory, io = ssd
    align = ALIGN_ELEMS
    numel = 3 * align + 100
    t = TieredTensor("r", "master", numel, dtype, SPLITS[split], CPU, TrafficCounters(), io, directory)
    full = random_tensor(numel, dtype, seed=1)
    t.evict(full)
    expected = full.clone()
    for seed, (lo, hi) in enumerate([(align, 2 * align), (0, align), (2 * align, numel), (0, 2 * align)]):
        part = random_tensor(hi - lo, dtype, seed=100 + seed)
        t.evict(part, lo, hi)
        expected[lo:hi] = part
        got = t.fetch(aligned_empty(hi - lo, dtype), lo, hi)
        assert bitwise_equal(got, part), (lo, hi)
        assert bitwise_equal(t.read_full(), expected), (lo, hi)


def test_tiered_unaligned_ssd_range_is_refused(ssd):
    directory, io = ssd
    t = TieredTensor("u", "master", 2 * ALIGN_ELEMS, torch.float32, SPLITS["ssd"], CPU, TrafficCounters(), io, directory)
    with pytest.raises(AssertionError, match="aligned"):
        t.fetch(aligned_empty(ALIGN_ELEMS, torch.float32), 1, ALIGN_ELEMS + 1)
    with pytest.raises(AssertionError, match="outside"):
        t.fetch(aligned_empty(ALIGN_ELEMS, torch.float32), ALIGN_ELEMS, 3 * ALIGN_ELEMS)


def test_tiered_device_resident_is_handed_out_in_place():
    t = TieredTensor("z", "weights", 100, torch.float32, TierShares(device=1.0, host=0.0), CPU, TrafficCounters())
    assert t.resident
    value = random_tensor(100, torch.float32)
    t.evict(value)
    assert bitwise_equal(t.device_tensor(), value)


def test_tiered_ssd_share_without_directory_is_refused():
    with pytest.raises(AssertionError, match="SsdDirectory"):
        TieredTensor("w", "weights", 10, torch.float32, SPLITS["ssd"], CPU, TrafficCounters())


# ---------------------------------------------------------------------------------------- ActivationStore
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 16, 32), (3, 5, 7)])
def test_activation_store_ssd_round_trip(ssd, dtype, shape):
    directory, io = ssd
    counters = TrafficCounters()
    micro = 3
    store = ActivationStore(StorageConfig(checkpoints=SPLITS["ssd"], checkpoint_host_ends=0), micro, 2, 2, CPU, counters, io, directory)
    assert [store.tier_of(m) for m in range(micro)] == ["ssd"] * micro
    values = {(u, m): random_tensor(int(torch.Size(shape).numel()), dtype, seed=10 * u + m).view(shape)
              for u in range(2) for m in range(micro)}
    for (u, m), v in values.items():
        store.put(u, m, v)
    files = directory.files()
    assert [os.path.relpath(f, directory.path) for f in files] == ["checkpoints/unit00000.bin", "checkpoints/unit00001.bin"]
    assert all(os.path.getsize(f) > 0 for f in files)
    for (u, m), v in reversed(values.items()):
        got = store.get(u, m)
        assert got.shape == v.shape and bitwise_equal(got, v)
    logical = len(values) * values[(0, 0)].numel() * values[(0, 0)].element_size()
    assert counters.get("ssd", "checkpoints", "write") == logical
    assert counters.get("ssd", "checkpoints", "read") == logical
    store.drop(0, 0)
    with pytest.raises(KeyError):
        store.get(0, 0)


def test_activation_store_host_ends_stay_in_memory(ssd):
    directory, io = ssd
    counters = TrafficCounters()
    store = ActivationStore(StorageConfig(checkpoints=SPLITS["ssd"], checkpoint_host_ends=1), 5, 2, 2, CPU, counters, io, directory)
    assert [store.tier_of(m) for m in range(5)] == ["host", "ssd", "ssd", "ssd", "host"]
    values = [random_tensor(64, torch.float32, seed=m).view(4, 16) for m in range(5)]
    for m, v in enumerate(values):
        store.put(0, m, v)
    for m, v in enumerate(values):
        assert bitwise_equal(store.get(0, m), v)
    assert counters.get("ssd", "checkpoints", "write") == 3 * 64 * 4
    assert counters.get("host", "checkpoints", "write") == 2 * 64 * 4


def test_activation_store_rejects_changing_shapes(ssd):
    directory, io = ssd
    store = ActivationStore(StorageConfig(checkpoints=SPLITS["ssd"], checkpoint_host_ends=0), 2, 2, 2, CPU, TrafficCounters(), io, directory)
    store.put(0, 0, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="same shape"):
        store.put(0, 1, torch.zeros(4, 4096))



def test_activation_store_next_step_may_change_shape(ssd):
    directory, io = ssd
    store = ActivationStore(StorageConfig(checkpoints=SPLITS["ssd"], checkpoint_host_ends=0), 2, 2, 2, CPU, TrafficCounters(), io, directory)
    big, small = random_tensor(4 * 2048, torch.float32).view(4, 16, 128), random_tensor(2048, torch.float32).view(1, 16, 128)
    for m in range(2):
        store.put(0, m, big)
    for m in range(2):
        assert bitwise_equal(store.get(0, m), big)
        store.drop(0, m)
    store.clear()  # the step is over
    for m in range(2):
        store.put(0, m, small)
    for m in range(2):
        assert bitwise_equal(store.get(0, m), small)


# ---------------------------------------------------------------------------------------- IOEngine
def test_io_engine_chunks_large_transfers(ssd, monkeypatch):
    directory, _ = ssd
    engine = IOEngine(num_threads=2, chunk_bytes=4 * MIB)
    pieces = []
    real_write = io_engine._write_exact

    def recording_write(fd, offset, buffer):
        pieces.append((offset, buffer.numel()))
        real_write(fd, offset, buffer)

    monkeypatch.setattr(io_engine, "_write_exact", recording_write)
    try:
        size, base = 9 * MIB, 2 * PAGE_BYTES
        fd = directory.open("big.bin", base + size)
        src = aligned_empty(size, torch.uint8)
        src.copy_(random_tensor(size, torch.uint8, seed=9))
        ticket = engine.submit_write(fd, base, padded_bytes(src))
        ticket.wait()
        assert ticket.done()
        assert sorted(pieces) == [(base, 4 * MIB), (base + 4 * MIB, 4 * MIB), (base + 8 * MIB, MIB)]
        dst = aligned_empty(size, torch.uint8)
        engine.submit_read(fd, base, padded_bytes(dst)).wait()
        assert torch.equal(dst, src)
        # The first pages before ``base`` were never written: they still read back as zeros.
        head = aligned_empty(base, torch.uint8)
        engine.submit_read(fd, 0, padded_bytes(head)).wait()
        assert not head.any()
    finally:
        engine.close()


def test_io_engine_rejects_unaligned_chunk_size():
    with pytest.raises(ValueError, match="chunk_bytes"):
        IOEngine(chunk_bytes=PAGE_BYTES + 1)


def test_io_engine_short_read_raises_in_wait(ssd):
    directory, io = ssd
    fd = directory.open("short.bin", PAGE_BYTES)
    buf = aligned_empty(2 * PAGE_BYTES, torch.uint8)
    ticket = io.submit_read(fd, 0, padded_bytes(buf))
    with pytest.raises(OSError, match="short read"):
        ticket.wait()


# ---------------------------------------------------------------------------------------- SsdDirectory
def test_ssd_directory_removes_files_keeps_user_dir(tmp_path):
    user_dir = tmp_path / "ssd"
    user_dir.mkdir()
    (user_dir / "user-file.txt").write_text("mine")
    directory = SsdDirectory(str(user_dir))
    paths = [os.path.join(directory.path, p) for p in ("weights/unit00000.bin", "exp_avg/unit00000.bin")]
    for rel in ("weights/unit00000.bin", "exp_avg/unit00000.bin"):
        directory.open(rel, PAGE_BYTES)
    assert directory.files() == sorted(paths) and all(os.path.exists(p) for p in paths)
    directory.close()
    assert user_dir.is_dir()
    assert sorted(os.listdir(user_dir)) == ["user-file.txt"]  # our files and sub-directories are gone
    assert directory.files() == []
    directory.close()  # idempotent


def test_ssd_directory_temporary_dir_is_removed(tmp_path):
    directory = SsdDirectory(None)
    path = directory.path
    directory.open("weights/a.bin", PAGE_BYTES)
    assert os.path.isdir(path)
    directory.close()
    assert not os.path.exists(path)


def test_ssd_directory_keep_files(tmp_path):
    directory = SsdDirectory(str(tmp_path / "ssd"), keep_files=True)
    directory.open("weights/a.bin", PAGE_BYTES)
    directory.close()
    assert (tmp_path / "ssd" / "weights" / "a.bin").stat().st_size == PAGE_BYTES


def test_ssd_directory_keeps_users_empty_subdirectories(tmp_path):
    user_dir = tmp_path / "ssd"
    (user_dir / "my-empty-dir").mkdir(parents=True)
    directory = SsdDirectory(str(user_dir))
    directory.open("weights/a.bin", PAGE_BYTES)
    directory.close()
    assert (user_dir / "my-empty-dir").is_dir()


def _has_o_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.fixture
def refuse_o_direct(monkeypatch):
    """Make every open() with O_DIRECT fail with EINVAL, as on a filesystem without direct I/O."""
    real_open = os.open
    refused = []

    def open_without_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_without_direct)
    return refused


def test_ssd_directory_o_direct_probe(tmp_path, refuse_o_direct):
    directory = SsdDirectory(str(tmp_path / "ssd"))
    assert refuse_o_direct, "the probe never tried O_DIRECT"
    assert directory.o_direct is False
    fd = directory.open("weights/a.bin", PAGE_BYTES)
    assert not _has_o_direct(fd)
    directory.close()


# ---------------------------------------------------------------------------------------- during training
STORAGE_ALL_SSD = {"weights": "ssd", "optimizer": "ssd", "gradients": "ssd", "checkpoints": "ssd",
                   "checkpoint_host_ends": 0}


def fs_accepts_o_direct(directory: str) -> bool:
    """Independent of the library: can a file in ``directory`` be opened with O_DIRECT and written?"""
    import mmap

    probe = os.path.join(directory, ".test-odirect-probe")
    page = mmap.mmap(-1, PAGE_BYTES)  # page-aligned, as O_DIRECT requires
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [page], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.remove(probe)


def open_files_o_direct(directory: str) -> dict[str, bool]:
    """Every file under ``directory`` this process holds open, and whether its descriptor has O_DIRECT
    (read from /proc/self/fdinfo: what the kernel really does, not what the library says)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            with open(f"/proc/self/fdinfo/{name}") as f:
                flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
        except (OSError, StopIteration):
            continue  # closed meanwhile (the listing's own descriptor, a worker's file)
        if target.startswith(directory + os.sep):
            out[target] = bool(flags & os.O_DIRECT)
    return out


class SsdObserver(L.Callback):
    def __init__(self) -> None:
        self.files: list[list[tuple[str, int, bool]]] = []
        self.path = None
        self.o_direct: set[bool] = set()  # O_DIRECT flags seen on the open state files
        self.slots = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        self.path = engine.ssd.path
        flags = open_files_o_direct(self.path)
        assert set(flags) >= set(engine.ssd_files()), "a state file is not open"
        self.o_direct |= {flags[f] for f in engine.ssd_files()}  # the state files (the lock is open too)
        self.slots = [list(unit.layout.slots) for unit in engine.units]
        # A temporary ssd_dir's files have no name (O_TMPFILE): the kernel's "<dir>/#<inode> (deleted)",
        # sized through their descriptors.
        sizes = engine.ssd.file_sizes()
        self.files.append([(f, sizes[f], os.path.isfile(f) or engine.ssd.anonymous) for f in engine.ssd_files()])


def train(storage: dict, steps: int = 2, micro: int = 3, precision: str = "32-true",
          read_final: bool = True) -> tuple[dict, SsdObserver]:
    observer = SsdObserver()
    final = {}

    class Final(L.Callback):
        def on_train_end(self, trainer, pl_module):
            final.update(trainer.strategy.engine.state_dict())

    fit_snake(lambda: GPTModule(SMALL_GPT, learning_rate=1e-3),
              token_loader(steps * micro, micro, SMALL_GPT.context_len, SMALL_GPT.vocab_size), steps=steps,
              storage=storage, schedule={"num_micro_batches": micro}, precision=precision,
              callbacks=[observer] + ([Final()] if read_final else []), record=None)
    assert final or not read_final
    return final, observer


def test_ssd_files_live_in_ssd_dir_during_training_and_go_after(tmp_path):
    ssd_dir = tmp_path / "ssd"
    ssd_dir.mkdir()  # the user's: it stays (one the run creates is removed, tests/lifecycle/test_files_and_locks.py)
    _, observer = train(dict(STORAGE_ALL_SSD, ssd_dir=str(ssd_dir)))
    assert observer.path == str(ssd_dir)
    for files in observer.files:
        rel = sorted(os.path.relpath(f, ssd_dir) for f, _, _ in files)
        for state in ("weights", "exp_avg", "exp_avg_sq", "gradients"):
            assert [r for r in rel if r.startswith(state + "/")] == [
                f"{state}/unit{u:05d}.bin" for u in range(SMALL_GPT.num_layers)]
        assert any(r.startswith("checkpoints/") for r in rel)
        for f, size, is_file in files:
            assert f.startswith(str(ssd_dir) + os.sep) and is_file and size > 0
    # After fit (teardown): the user's directory stays, holding no state file.
    assert ssd_dir.is_dir()
    assert [os.path.join(r, f) for r, _, fs in os.walk(ssd_dir) for f in fs] == []
    assert os.listdir(ssd_dir) == []


def test_default_ssd_dir_is_temporary_and_removed(tmp_path):
    _, observer = train({"weights": "ssd", "optimizer": "ssd"}, steps=1)
    assert observer.path is not None and observer.files[0]
    assert not os.path.exists(observer.path)


def test_keep_ssd_files_hold_the_final_weights(tmp_path, reference_on_tmp):
    # Nothing in the test reads the weights during the run: the deferred updates of the last step must
    # reach the kept files through the strategy's own end-of-fit flush.
    reference, _ = reference_on_tmp
    ssd_dir = tmp_path / "ssd"
    _, observer = train(dict(STORAGE_ALL_SSD, ssd_dir=str(ssd_dir), keep_ssd_files=True), read_final=False)
    for f, size, _ in observer.files[-1]:
        assert os.path.getsize(f) == size  # still there after teardown
    assert len(observer.slots) == SMALL_GPT.num_layers
    for u, slots in enumerate(observer.slots):
        raw = (ssd_dir / "weights" / f"unit{u:05d}.bin").read_bytes()
        flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        for slot in slots:
            value = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
            assert bitwise_equal(value, reference[f"blocks.{u + slot.block}.{slot.name}"]), (u, slot.name)


@pytest.fixture(scope="module")
def reference_on_tmp(tmp_path_factory):
    final, observer = train(dict(STORAGE_ALL_SSD, ssd_dir=str(tmp_path_factory.mktemp("ref") / "ssd")))
    return final, observer


def test_reference_run_uses_o_direct_where_the_filesystem_allows_it(reference_on_tmp):
    # Whatever the temporary directory's filesystem is (ext4, or tmpfs which accepts O_DIRECT since
    # Linux 6.6): every state file is opened with O_DIRECT exactly when the filesystem accepts it.
    _, observer = reference_on_tmp
    assert observer.o_direct == {fs_accepts_o_direct(os.path.dirname(observer.path))}


def test_o_direct_fallback_trains_identically(tmp_path, reference_on_tmp, refuse_o_direct):
    reference, _ = reference_on_tmp
    got, observer = train(dict(STORAGE_ALL_SSD, ssd_dir=str(tmp_path / "ssd")))
    assert refuse_o_direct and observer.o_direct == {False}
    assert got and got.keys() == reference.keys()
    for name in got:
        assert bitwise_equal(got[name], reference[name]), name


def test_dev_shm_trains_identically(reference_on_tmp):
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    import tempfile

    reference, _ = reference_on_tmp
    with tempfile.TemporaryDirectory(dir="/dev/shm") as base:
        # tmpfs refuses O_DIRECT on older kernels and accepts it since Linux 6.6: either way it trains,
        # with O_DIRECT exactly when this kernel's tmpfs accepts it.
        expected = fs_accepts_o_direct(base)
        got, observer = train(dict(STORAGE_ALL_SSD, ssd_dir=os.path.join(base, "ssd")))
        assert observer.o_direct == {expected}
    assert got and got.keys() == reference.keys()
    for name in got:
        assert bitwise_equal(got[name], reference[name]), name


def test_smaller_last_batch_with_ssd_checkpoints(tmp_path):
    # 10 samples in batches of 8: the second (last) batch holds 2, one micro-batch of the full micro size
    # (4) holding 2 samples. Reference: plain Lightning in fp64 fed the same micro-batches (4, 4 | 2) with
    # accumulate_grad_batches=2, so every micro-batch loss is weighted 1/2 as in the strategy.
    from tests.helpers import max_abs_diff

    dataset = token_loader(10, 8, SMALL_GPT.context_len, SMALL_GPT.vocab_size).dataset

    def model():
        return GPTModule(SMALL_GPT, learning_rate=1e-2)

    one_epoch = {"max_epochs": 1}
    # After every loader batch: the optimizer steps after batches 2 and 3.
    ref = fit_lightning(model, DataLoader(dataset, batch_sampler=[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]), steps=-1,
                        precision="64-true", accumulate=2, record="batch", trainer_extra=one_epoch).states
    run = fit_snake(model, DataLoader(dataset, batch_size=8), steps=-1, precision="64-true",
                    storage={"checkpoints": "ssd", "checkpoint_host_ends": 0, "ssd_dir": str(tmp_path / "ssd")},
                    schedule={"num_micro_batches": 2}, trainer_extra=one_epoch)
    assert run.trainer.global_step == 2 and len(run.states) == 2 and len(ref) == 3
    for got, want in zip(run.states, ref[1:]):
        assert max_abs_diff(got, want) < 1e-10
    assert max_abs_diff(run.states[1], run.states[0]) > 1e-3  # the small last batch really trained


def test_o_direct_refusal_warns_once_per_run(tmp_path, refuse_o_direct, caplog):
    """The fallback is announced once per run (not once per file), naming the directory."""
    import logging

    ssd_dir = tmp_path / "ssd"
    with caplog.at_level(logging.WARNING):
        _, observer = train(dict(STORAGE_ALL_SSD, ssd_dir=str(ssd_dir)), steps=1)
    assert len(observer.files[0]) > SMALL_GPT.num_layers  # many files, one per state and unit
    warnings = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert str(ssd_dir) in warnings[0] and "page cache" in warnings[0]
