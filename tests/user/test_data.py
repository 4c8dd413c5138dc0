"""Tests for the byte-level corpus and data module (snake_strategy.data)."""
from __future__ import annotations

import pytest
import torch

from snake_strategy.data import ByteWindows, TextDataModule, load_corpus, stdlib_source_files


def test_stdlib_corpus_is_capped_bytes():
    tokens = load_corpus("stdlib", max_bytes=10_000)
    assert tokens.dtype == torch.int64 and tokens.shape == (10_000,)
    assert 0 <= tokens.min() and tokens.max() < 256
    first = stdlib_source_files()[0].read_bytes()[:100]
    assert bytes(tokens[:100].tolist()) == first[:100]


def test_file_and_directory_sources(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"ZZ")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    single = load_corpus(tmp_path / "a.txt")
    assert bytes(single.tolist()) == b"hello "
    # Sorted recursive order: a.txt before b/z.txt.
    assert bytes(load_corpus(str(tmp_path)).tolist()) == b"hello ZZ"
    assert bytes(load_corpus(tmp_path, max_bytes=7).tolist()) == b"hello Z"


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="no bytes"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="no bytes"):
        load_corpus(tmp_path / "emptydir")
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus("stdlib", max_bytes=0)


def test_windows_shapes_and_shift():
    tokens = torch.arange(50) % 256
    windows = ByteWindows(tokens, context_len=9)
    assert len(windows) == 5  # 50 // (9 + 1)
    inputs, targets = windows[2]
    assert inputs.shape == targets.shape == (9,)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs, torch.arange(20, 29))
    assert torch.equal(targets[:-1], inputs[1:])
    assert targets[-1].item() == 29
    with pytest.raises(IndexError):
        windows[5]


def make(**kwargs) -> TextDataModule:
    settings = dict(context_len=16, micro_batch_size=2, num_micro_batches=3, max_bytes=64 * 1024)
    settings.update(kwargs)
    data = TextDataModule(**settings)
    data.setup("fit")
    return data


def test_loaders_yield_global_batches():
    data = make()
    assert data.global_batch_size == 6
    inputs, targets = next(iter(data.train_dataloader()))
    assert inputs.shape == targets.shape == (6, 16)
    assert inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    val_inputs, _ = next(iter(data.val_dataloader()))
    assert val_inputs.shape == (6, 16)
    assert all(b[0].shape[0] == 6 for b in data.train_dataloader())  # drop_last


def test_train_and_val_are_disjoint_tail_split():
    data = make(val_fraction=0.1)
    window = 17
    num_windows = 64 * 1024 // window
    assert len(data.train_set) + len(data.val_set) == num_windows
    assert len(data.val_set) == int(num_windows * 0.1)
    train_end = data.train_set.tokens.data_ptr() + data.train_set.tokens.numel() * 8
    assert data.val_set.tokens.data_ptr() >= train_end  # val bytes come strictly after train bytes
    corpus = load_corpus("stdlib", max_bytes=64 * 1024)
    assert torch.equal(data.val_set[0][0], corpus[len(data.train_set) * window:][:16])


def test_shuffle_is_seeded():
    first = [b[0] for _, b in zip(range(3), make(seed=3).train_dataloader())]
    again = [b[0] for _, b in zip(range(3), make(seed=3).train_dataloader())]
    other = [b[0] for _, b in zip(range(3), make(seed=4).train_dataloader())]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_too_small_corpus_says_bytes_needed(tmp_path):
    path = tmp_path / "small.txt"
    path.write_bytes(b"x" * 100)  # 5 windows of 17 bytes
    data = TextDataModule(source=path, context_len=16, micro_batch_size=2, num_micro_batches=2, val_fraction=0.25)
    needed = data.min_corpus_bytes()
    with pytest.raises(ValueError, match=f"at least {needed} bytes"):
        data.setup("fit")
    path.write_bytes(b"x" * needed)
    ok = TextDataModule(source=path, context_len=16, micro_batch_size=2, num_micro_batches=2, val_fraction=0.25)
    ok.setup("fit")
    assert len(ok.val_set) >= 4 and len(ok.train_set) >= 4
    path.write_bytes(b"x" * (needed - 1))
    with pytest.raises(ValueError, match="global_batch_size=4"):
        TextDataModule(source=path, context_len=16, micro_batch_size=2, num_micro_batches=2, val_fraction=0.25).setup()


@pytest.mark.parametrize(
    "kwargs, setting",
    [({"context_len": 0}, "context_len"), ({"micro_batch_size": 0}, "micro_batch_size"),
     ({"num_micro_batches": 1.5}, "num_micro_batches"), ({"val_fraction": 0.0}, "val_fraction"),
     ({"val_fraction": 1.0}, "val_fraction"), ({"max_bytes": -1}, "max_bytes"),
     ({"num_workers": -1}, "num_workers"), ({"seed": "a"}, "seed")],
)
def test_datamodule_validation(kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        TextDataModule(**kwargs)
