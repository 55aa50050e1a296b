"""Files written past the page cache: the bytes and SHA-256 of every size, buffers reused."""

import hashlib
import mmap
import os

import pytest

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
