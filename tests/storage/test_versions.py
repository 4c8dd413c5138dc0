"""Versioned SSD state files (storage/versions.py) seen from their API: a rollback hold keeps the pre-step
bytes without a copy in two alternating files (no allocation per step), and never touches a version a
checkpoint pinned."""
from __future__ import annotations

import os

import pytest

from snake_strategy.storage.ssd_directory import SsdDirectory

MIB = 2**20
SIZE = 8 * MIB


def _write(vf, offset: int, data: bytes) -> None:
    fd = vf.fd_for_write(offset, len(data))
    assert os.pwrite(fd, data, offset) == len(data)


def _read(pieces) -> bytes:
    out = bytearray()
    for fd, at, _, n in pieces:
        out += os.pread(fd, n, at)
    return bytes(out)


@pytest.fixture(params=["named", "anonymous"])
def ssd(request, tmp_path):
    directory = SsdDirectory(str(tmp_path / "ssd") if request.param == "named" else None, use_o_direct=False)
    yield directory
    directory.close()


def _step(vf, tag: bytes, half: int) -> None:
    """One training step of a unit under speculation: the forward part [0, half) is written, then the
    backward part [half, SIZE) is held and written."""
    _write(vf, 0, tag * half)
    vf.hold(half, half)
    _write(vf, half, tag * half)


def test_a_hold_keeps_the_old_bytes_while_writes_go_on_in_two_alternating_files(ssd):
    vf = ssd.open_versioned("master/unit0.bin", SIZE)
    half = SIZE // 2
    _write(vf, 0, b"a" * SIZE)
    os.fsync(vf.fd)
    vf.hold(half, half)  # the backward part [half, SIZE)
    _write(vf, half, b"b" * half)  # the speculative step: a new version receives it
    assert vf.versions == 2
    assert _read(vf.read_pieces(0, SIZE)) == b"a" * half + b"b" * half  # the live state
    assert _read(vf.held_pieces(half, half)) == b"a" * half  # the pre-step bytes
    vf.release_hold()  # committed
    for step, tag in enumerate((b"c", b"d", b"e", b"f")):
        before = _read(vf.read_pieces(half, half))
        _step(vf, tag, half)
        assert vf.versions == 3 + step
        assert _read(vf.read_pieces(0, SIZE)) == tag * SIZE
        assert _read(vf.held_pieces(half, half)) == before
        vf.release_hold()
        os.fsync(vf.fd)
        # Two files, alternating: the closed version is overwritten next, no third file is allocated.
        assert vf.allocated_bytes() <= 2 * SIZE + 2 * MIB
    if not ssd.anonymous:
        assert sorted(os.listdir(os.path.join(ssd.path, "master"))) == ["unit0.bin", "unit0.bin.alt"]


def test_a_hold_never_writes_or_punches_a_version_a_checkpoint_pinned(ssd, tmp_path):
    vf = ssd.open_versioned("master/unit0.bin", SIZE)
    half = SIZE // 2
    _write(vf, 0, b"a" * SIZE)
    dest = tmp_path / "unit0.master.bin"
    assert vf.pin(dest) == "link"
    _write(vf, 0, b"f" * half)  # the forward part after the save: a new version, the pinned one held
    vf.hold(half, half)  # [half, SIZE) is not rewritten yet: its pre-step bytes are the pinned version's
    _write(vf, half, b"b" * half)
    assert _read(vf.held_pieces(half, half)) == b"a" * half
    vf.release_hold()
    assert dest.read_bytes() == b"a" * SIZE
    vf.hold(0, half)  # [0, half) was rewritten since the pin: the pinned version is settled first
    _write(vf, 0, b"g" * half)  # a new version: the pinned one is never reused while the checkpoint links it
    assert os.stat(dest).st_nlink == 1  # closed, its own name dropped: the checkpoint's alone
    assert _read(vf.held_pieces(0, half)) == b"f" * half
    vf.release_hold()
    for tag in (b"h", b"i", b"j"):  # steps on: the checkpoint's bytes are never written
        _step(vf, tag, half)
        vf.release_hold()
        assert dest.read_bytes() == b"a" * SIZE
    assert _read(vf.read_pieces(0, SIZE)) == b"j" * SIZE


def test_a_pin_while_a_hold_is_active_is_an_invariant_violation(ssd, tmp_path):
    vf = ssd.open_versioned("master/unit0.bin", SIZE)
    _write(vf, 0, b"a" * SIZE)
    vf.hold(0, SIZE)
    _write(vf, 0, b"b" * SIZE)
    with pytest.raises(AssertionError, match="held version"):
        vf.pin(tmp_path / "x.bin")
    vf.release_hold()


def test_a_released_checkpoint_version_is_overwritten_by_the_next_one_not_freed_and_allocated(ssd, tmp_path):
    """Saves that rotate (``last``, top-k): the version the released checkpoint pinned becomes the next
    version's blocks (a named one; an anonymous one a pin linked can never be linked again, so it is
    freed), and every checkpoint keeps its bytes."""
    vf = ssd.open_versioned("master/unit0.bin", SIZE)
    _write(vf, 0, b"a" * SIZE)
    previous, inodes = None, set()
    for step, tag in enumerate((b"b", b"c", b"d", b"e")):
        dest = tmp_path / f"ckpt{step}.bin"
        assert vf.pin(dest) == "link"
        if previous is not None:
            previous.unlink()  # the rotation: the older checkpoint is released after the new one is saved
        _write(vf, 0, tag * SIZE)  # the step after the save: copy-on-write
        inodes.add(os.fstat(vf.fd).st_ino)
        assert dest.read_bytes() == (b"a" if step == 0 else (b"b", b"c", b"d")[step - 1]) * SIZE
        previous = dest
        os.fsync(vf.fd)
        assert vf.allocated_bytes() <= 2 * SIZE + 2 * MIB  # never a third copy
    assert vf.versions == 5
    if not ssd.anonymous:
        assert len(inodes) == 2  # two files, alternating
        assert sorted(os.listdir(os.path.join(ssd.path, "master"))) == ["unit0.bin", "unit0.bin.alt"]


@pytest.mark.parametrize("start", ["pin", "hold"])
def test_settling_a_partly_written_version_keeps_the_bytes_it_never_received(ssd, tmp_path, start):
    """A new version that received only part of the state (a unit whose frozen part is never rewritten,
    a step cut short) is settled by the next pin: the previous version closes, so the ranges the new one
    never received are copied into it first. Every read and the new checkpoint then still see the old bytes."""
    vf = ssd.open_versioned("master/unit0.bin", SIZE)
    quarter = SIZE // 4
    _write(vf, 0, b"a" * SIZE)
    if start == "pin":
        vf.pin(tmp_path / "first.bin")
    else:
        vf.hold(quarter, quarter)
    _write(vf, quarter, b"b" * quarter)  # a new version: only [quarter, 2 quarter) written
    if start == "hold":
        vf.release_hold()
    assert vf.versions == 2
    want = b"a" * quarter + b"b" * quarter + b"a" * (2 * quarter)
    assert _read(vf.read_pieces(0, SIZE)) == want  # read through the previous version
    second = tmp_path / "second.bin"
    vf.pin(second)  # settles: the previous version is read no more
    assert _read(vf.read_pieces(0, SIZE)) == want
    assert _read(vf.read_pieces(3 * quarter, quarter)) == b"a" * quarter  # a range never rewritten
    assert second.read_bytes() == want
