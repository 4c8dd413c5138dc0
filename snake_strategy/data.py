"""Byte-level text data that works on any machine, offline.

The default corpus is the Python standard library's own top-level ``.py`` sources: every Python
install carries them, so tests, examples and benchmarks need no download. Tokens are raw bytes
(vocabulary 256), which matches the byte-level GPT presets.
"""
from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

BYTE_VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 8 * 2**20  # 8 MiB
STDLIB_SOURCE = "stdlib"


def _check_max_bytes(max_bytes: int | None) -> None:
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive integer (bytes) or None for no cap, got {max_bytes!r}")


def _read_capped(files: list[Path], max_bytes: int | None) -> bytes:
    """Concatenate ``files`` in order, stopping once ``max_bytes`` bytes are collected."""
    chunks: list[bytes] = []
    total = 0
    for path in files:
        remaining = None if max_bytes is None else max_bytes - total
        if remaining is not None and remaining <= 0:
            break
        with open(path, "rb") as handle:
            data = handle.read() if remaining is None else handle.read(remaining)
        chunks.append(data)
        total += len(data)
    return b"".join(chunks)


def stdlib_source_files() -> list[Path]:
    """Top-level ``*.py`` files of the running interpreter's standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)


def load_corpus(source: str | os.PathLike = STDLIB_SOURCE, max_bytes: int | None = DEFAULT_MAX_BYTES) -> Tensor:
    """Load a corpus as a 1-D int64 tensor of byte tokens (values 0..255).

    source: ``"stdlib"`` for the standard library sources, or a path to a text file, or a directory
        (every regular file under it, recursively, in sorted path order). A local directory literally
        named ``stdlib`` can be given as ``"./stdlib"``.
    max_bytes: keep at most this many bytes (the first ones, in file order); None keeps everything.
    """
    _check_max_bytes(max_bytes)
    if isinstance(source, str) and source == STDLIB_SOURCE:
        files = stdlib_source_files()
        where = f"the standard library at {sysconfig.get_paths()['stdlib']}"
        if not files:
            raise ValueError(f"source='stdlib' found no top-level .py files in {where}; pass a path to a text corpus")
    else:
        path = Path(source).expanduser()
        where = str(path)
        if not path.exists():
            raise ValueError(f"source={str(source)!r} does not exist; pass 'stdlib' or a path to a text file or directory")
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
        else:
            files = [path]
    data = _read_capped(files, max_bytes)
    if not data:
        raise ValueError(f"source={str(source)!r} holds no bytes (looked in {where}); point it at non-empty text")
    # bytearray gives frombuffer a writable buffer; int64 is what nn.Embedding and cross_entropy take.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


class ByteWindows(Dataset):
    """Non-overlapping windows of ``context_len + 1`` tokens, each split into (inputs, targets).

    Window ``i`` covers tokens ``[i * (T + 1), (i + 1) * (T + 1))``; inputs are its first T tokens and
    targets the last T (the same sequence shifted by one). Leftover tokens at the end are dropped.
    """

    def __init__(self, tokens: Tensor, context_len: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len <= 0:
            raise ValueError(f"context_len must be a positive integer (tokens), got {context_len!r}")
        self.tokens = tokens
        self.context_len = context_len
        self.window = context_len + 1

    def __len__(self) -> int:
        return self.tokens.numel() // self.window

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        index %= len(self)
        chunk = self.tokens[index * self.window:(index + 1) * self.window].to(torch.int64)
        return chunk[:-1], chunk[1:]


class TextDataModule(pl.LightningDataModule):
    """Byte-level language-modelling data: train on the first part of a corpus, validate on the tail.

    One train batch is one optimizer step: its size is the GLOBAL batch,
    ``micro_batch_size * num_micro_batches`` windows, which the strategy splits into micro-batches.
    """

    def __init__(
        self,
        source: str | os.PathLike = STDLIB_SOURCE,
        context_len: int = 64,
        micro_batch_size: int = 2,
        num_micro_batches: int = 4,
        val_fraction: float = 0.05,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("context_len", context_len, 1),
            ("micro_batch_size", micro_batch_size, 1),
            ("num_micro_batches", num_micro_batches, 1),
            ("num_workers", num_workers, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be strictly between 0 and 1 (e.g. 0.05), got {val_fraction!r}")
        _check_max_bytes(max_bytes)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.save_hyperparameters()
        self.source = source
        self.context_len = context_len
        self.micro_batch_size = micro_batch_size
        self.num_micro_batches = num_micro_batches
        self.val_fraction = float(val_fraction)
        self.max_bytes = max_bytes
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None
        self._shuffle_generator: torch.Generator | None = None

    @property
    def global_batch_size(self) -> int:
        """Windows per optimizer step: micro_batch_size * num_micro_batches."""
        return self.micro_batch_size * self.num_micro_batches

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    def split_sizes(self, num_windows: int) -> tuple[int, int]:
        """(train windows, val windows) for a corpus of ``num_windows`` windows."""
        # The epsilon keeps e.g. 100 * 0.29 = 28.999... from losing a window to float rounding.
        num_val = math.floor(num_windows * self.val_fraction + 1e-9)
        return num_windows - num_val, num_val

    def min_corpus_bytes(self) -> int:
        """Smallest corpus (bytes) that yields at least one train batch and one val batch."""
        batch = self.global_batch_size
        num_windows = max(2 * batch, math.ceil(batch / self.val_fraction), math.ceil(batch / (1 - self.val_fraction)))
        while min(self.split_sizes(num_windows)) < batch:
            num_windows += 1
        return num_windows * (self.context_len + 1)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return  # the corpus is loaded once, whatever the number of fit/validate calls
        tokens = load_corpus(self.source, self.max_bytes)
        window = self.context_len + 1
        num_train, num_val = self.split_sizes(tokens.numel() // window)
        if num_train < self.global_batch_size or num_val < self.global_batch_size:
            raise ValueError(
                f"corpus from source={str(self.source)!r} has {tokens.numel()} bytes = {tokens.numel() // window} "
                f"windows of context_len+1={window} bytes, split into {num_train} train / {num_val} val windows "
                f"(val_fraction={self.val_fraction}); one batch needs global_batch_size={self.global_batch_size} "
                f"windows in each, so at least {self.min_corpus_bytes()} bytes. Use a bigger corpus or max_bytes, "
                "or a smaller context_len, micro_batch_size or num_micro_batches"
            )
        # Train on the head of the corpus, validate on the tail: whole windows, no byte in both.
        boundary = num_train * window
        self.train_set = ByteWindows(tokens[:boundary], self.context_len)
        self.val_set = ByteWindows(tokens[boundary:(num_train + num_val) * window], self.context_len)
        # One generator for the module's lifetime: each epoch draws a new, reproducible permutation.
        self._shuffle_generator = torch.Generator().manual_seed(self.seed)

    def _require_setup(self) -> None:
        if self.train_set is None:
            self.setup()

    def train_dataloader(self) -> DataLoader:
        self._require_setup()
        return DataLoader(
            self.train_set,
            batch_size=self.global_batch_size,
            shuffle=True,
            generator=self._shuffle_generator,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        self._require_setup()
        return DataLoader(
            self.val_set,
            batch_size=self.global_batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
