"""storage/file_writer.py: a checkpoint's written files hold exactly the tensors' bytes, with the CRC-32 the
manifest records, through O_DIRECT where the filesystem takes it."""
import errno
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from snake_strategy.storage.file_writer import BUFFERS, CHUNK_BYTES, write_tensors


def _values() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, generator=g),  # 20 bytes: the next value starts mid-page
            torch.randn(BUFFERS * CHUNK_BYTES // 4 + 3, generator=g),  # more chunks than staging buffers
            torch.empty(0),
            torch.randn(1000, generator=g).to(torch.bfloat16),
            torch.randn(7, 9, generator=g).t()]  # not contiguous


def _direct_io_works(directory) -> bool:
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError as err:
        assert err.errno == errno.EINVAL
        return False
    return True


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_the_file_holds_the_concatenated_bytes_and_their_crc(tmp_path, where):
    directory = tmp_path
    if where == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        directory = Path("/dev/shm") / f"snake-writer-{os.getpid()}"
        directory.mkdir()
    try:
        values = _values()
        expected = b"".join(v.contiguous().view(torch.uint8).numpy().tobytes() for v in values)
        written = write_tensors(directory / "state.bin", values)
        assert (directory / "state.bin").read_bytes() == expected  # the padding of the last page is cut off
        assert written.bytes == len(expected) and written.crc32 == zlib.crc32(expected)
        assert written.direct == _direct_io_works(directory)
    finally:
        if where == "shm":
            for path in directory.iterdir():
                path.unlink()
            directory.rmdir()


def test_an_existing_file_is_replaced_and_an_empty_one_written(tmp_path):
    path = tmp_path / "state.bin"
    path.write_bytes(b"x" * 3 * CHUNK_BYTES)
    written = write_tensors(path, [torch.arange(3, dtype=torch.int64)])
    assert path.read_bytes() == torch.arange(3, dtype=torch.int64).numpy().tobytes()
    assert written.bytes == 24
    empty = write_tensors(tmp_path / "empty.bin", [])
    assert (tmp_path / "empty.bin").read_bytes() == b"" and empty.bytes == 0 and empty.crc32 == zlib.crc32(b"")


def test_a_failed_write_raises_in_the_caller(tmp_path):
    """A write that fails on the writer thread (here: past the process's file size limit, EFBIG) raises
    in the caller, after the other writes are done, instead of leaving a short file that looks written."""
    script = f"""
import errno, resource, signal, torch
from snake_strategy.storage.file_writer import write_tensors
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
try:
    write_tensors({str(tmp_path / "state.bin")!r}, [torch.zeros(10 * 2**20)])
except OSError as err:
    assert err.errno == errno.EFBIG, err
    print("raised")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised"
