"""Files written past the page cache: the bytes and SHA-256 of every size, buffers reused."""

import ctypes
import hashlib
import mmap
import os

import pytest

from ps_server import direct_io
from ps_server.direct_io import ALIGN, Buffers, write_file

CHUNK = 16 << 20


def _filled(size: int) -> mmap.mmap:
    buffer = Buffers().get(size)
    buffer[:size] = os.urandom(size)
    return buffer


@pytest.mark.parametrize("size", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN, CHUNK + 5, 2 * CHUNK])
def test_a_file_holds_exactly_the_bytes_given_and_their_sha256(tmp_path, size):
    buffer = _filled(size)
    data = memoryview(buffer)[:size]
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (size + 100))  # an older, longer file of that name: truncated
    digest = write_file(path, data)
    assert path.read_bytes() == bytes(data)
    assert digest == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("pause_at", [1, ALIGN, ALIGN + 7])
def test_a_paused_write_has_written_exactly_that_many_bytes(tmp_path, pause_at):
    size = 5 * ALIGN + 3
    buffer = _filled(size)
    path = tmp_path / "f.bin"
    seen: list[int] = []
    digest = write_file(path, memoryview(buffer)[:size], pause_at, lambda: seen.append(path.stat().st_size))
    assert seen == [pause_at]
    assert path.read_bytes() == buffer[:size] and digest == hashlib.sha256(buffer[:size]).hexdigest()


def test_buffers_are_page_aligned_and_reused_when_big_enough():
    buffers = Buffers()
    a = buffers.get(10_000)
    assert len(a) == 3 * ALIGN and len(a) % ALIGN == 0
    buffers.give_back([a])
    assert buffers.get(12_000) is a  # fits: reused, after the kernel was free to reclaim it
    buffers.give_back([a])
    b = buffers.get(20_000)
    assert b is not a and len(b) == 5 * ALIGN
    buffers.give_back([b])
    buffers.clear()
    assert buffers.get(100) is not b


def _resident(buffer: mmap.mmap) -> int:
    """Bytes of `buffer` whose pages are in memory (mincore(2)): its own pages, not the process's,
    whatever else the process allocates meanwhile."""
    assert direct_io._LIBC is not None
    pages = (ctypes.c_ubyte * (len(buffer) // mmap.PAGESIZE))()
    with direct_io._address(buffer) as base:
        if direct_io._LIBC.mincore(ctypes.c_void_p(base), ctypes.c_size_t(len(buffer)), pages) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
    return sum(page & 1 for page in pages) * mmap.PAGESIZE


def test_reserved_buffers_have_their_pages_in_and_are_handed_out_next():
    size = 64 << 20
    buffers = Buffers()
    fresh = buffers.get(size)
    assert _resident(fresh) == 0  # a fresh buffer: its pages come at the first copy into it
    buffers.reserve([size])
    reserved = buffers.get(size)
    assert reserved is not fresh and len(reserved) == size
    assert _resident(reserved) == size  # faulted in by reserve, off the snapshot's path
    fresh[:ALIGN] = b"\x01" * ALIGN
    assert _resident(fresh) == ALIGN  # the check sees pages come


def test_a_reservation_is_dropped_when_a_snapshot_gave_back_its_own_meanwhile(monkeypatch):
    buffers = Buffers()
    own = buffers.get(ALIGN)
    real = direct_io._mapped

    def mapped_while_a_snapshot_ends(size: int, populate: bool) -> mmap.mmap:
        buffers.give_back([own])
        return real(size, populate)

    monkeypatch.setattr(direct_io, "_mapped", mapped_while_a_snapshot_ends)
    buffers.reserve([ALIGN])
    assert buffers.get(ALIGN) is own  # the snapshot's memory kept, the late reservation not
