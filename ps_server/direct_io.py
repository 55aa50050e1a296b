"""Files written from page-aligned memory past the page cache (O_DIRECT), and that memory kept
from one write to the next.

A checkpoint is written every few seconds while the steps keep every core busy, so what it costs
in CPU comes out of the steps. Through the page cache a write of 400 MB costs about a second of
CPU (page allocation, the copy into the cache, writeback) and a fresh 400 MB buffer nearly as
much again in page faults; written directly from a buffer that is reused, both are gone and what
is left is the SHA-256 (0.3 s). Where the file system refuses O_DIRECT the same bytes go through
the page cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

# O_DIRECT wants the memory address, the file offset and the length aligned to the device's
# logical block; a page covers every block size in use.
ALIGN = mmap.PAGESIZE
_CHUNK = 16 << 20
# The C library's own functions (madvise), called without the GIL; None where it cannot be loaded.
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


def aligned(size: int) -> int:
    """`size` rounded up to a whole number of pages."""
    return -(-size // ALIGN) * ALIGN


class Buffers:
    """Page-aligned private anonymous memory, handed out and taken back: the next checkpoint's
    snapshot reuses the last one's pages (no page faults), and the kernel may reclaim them in
    between (MADV_FREE) if memory runs short. The first snapshot's can be made ready ahead of it
    (`reserve`), so that its copy under the run's lock does not fault every page in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spare: list[mmap.mmap] = []
        # Bumped by every get and give_back: a reservation made meanwhile is out of date.
        self._generation = 0

    def get(self, size: int) -> mmap.mmap:
        """A buffer of at least `size` bytes (a spare one when one is big enough)."""
        with self._lock:
            self._generation += 1
            fitting = [b for b in self._spare if len(b) >= size]
            if fitting:
                best = min(fitting, key=len)
                self._spare.remove(best)
                return best
        return _mapped(size, populate=False)

    def give_back(self, buffers: list[mmap.mmap]) -> None:
        """Buffers no longer read: kept for the next snapshot, in place of the spare ones."""
        for b in buffers:
            _free(b)
        with self._lock:
            self._generation += 1
            self._spare = list(buffers)

    def reserve(self, sizes: list[int]) -> None:
        """Spare buffers of `sizes` bytes, their pages faulted in by this call (400 MB: 0.1 s on
        an idle machine, up to a second on a busy one); call it off the run's lock. Dropped if a
        snapshot took or gave back buffers meanwhile."""
        with self._lock:
            generation = self._generation
        made = [_mapped(size, populate=True) for size in sizes]
        with self._lock:
            if generation == self._generation:
                self._spare = made

    def clear(self) -> None:
        with self._lock:
            self._generation += 1
            self._spare = []


def _mapped(size: int, populate: bool) -> mmap.mmap:
    """`size` bytes (whole pages) of private anonymous memory, its pages faulted in now if
    `populate`."""
    buffer = mmap.mmap(-1, aligned(max(size, 1)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if populate:
        _fault_in(buffer)
    return buffer


def _fault_in(buffer: mmap.mmap) -> None:
    """Every page of `buffer` made present by writing zeros, a chunk at a time, through ctypes
    (which lets go of the GIL). Not MAP_POPULATE: Python's mmap holds the GIL while the kernel
    faults in the whole mapping (0.13 s for 400 MB on an idle host, over a second on a busy one),
    so every push and pull the shard serves would stop for as long; `mmap.madvise` holds it too."""
    with _address(buffer) as base:
        for start in range(0, len(buffer), _CHUNK):
            ctypes.memset(base + start, 0, min(_CHUNK, len(buffer) - start))


def _free(buffer: mmap.mmap) -> None:
    """Let the kernel take `buffer`'s pages back if it runs short of memory (MADV_FREE), through
    libc so that the GIL is let go: the call walks every page (20 ms for 400 MB on an idle host).
    Where there is no MADV_FREE the pages stay resident."""
    advice = getattr(mmap, "MADV_FREE", None)
    if _LIBC is None or advice is None:
        return
    with _address(buffer) as base:
        _LIBC.madvise(ctypes.c_void_p(base), ctypes.c_size_t(len(buffer)), advice)


@contextlib.contextmanager
def _address(buffer: mmap.mmap) -> Iterator[int]:
    """The address of `buffer`'s first byte, for C calls; the buffer can be closed again after."""
    view = (ctypes.c_char * len(buffer)).from_buffer(buffer)
    try:
        yield ctypes.addressof(view)
    finally:
        del view


def write_file(path: Path, data: memoryview, pause_at: int = -1, pause: Callable[[], None] | None = None) -> str:
    """Write `data` (in page-aligned memory) as the new file `path`, fsynced; its SHA-256 (hex).
    Whole pages go straight to the disk, a last partial page through the page cache. Tests only:
    `pause` is called once `pause_at` bytes are written."""
    digest = hashlib.sha256()
    size = len(data)
    fd, direct = _open(path)
    try:
        ends = {min(s + _CHUNK, size) for s in range(0, size, _CHUNK)} | {size - size % ALIGN}
        if 0 < pause_at < size:
            ends.add(pause_at)
        start = 0
        for end in sorted(e for e in ends if e > 0):
            piece = data[start:end]
            digest.update(piece)
            if direct and (start % ALIGN or len(piece) % ALIGN):
                direct = _buffered(fd)
            direct = _write_all(fd, piece, direct)
            start = end
            if pause is not None and end == pause_at:
                pause()
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest()


def _open(path: Path) -> tuple[int, bool]:
    """`path` created for writing, with O_DIRECT where the file system takes it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), True
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this file system has no direct I/O
                raise
    return os.open(path, flags, 0o600), False


def _buffered(fd: int) -> bool:
    """The file's further writes through the page cache; False."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    return False


def _write_all(fd: int, piece: memoryview, direct: bool) -> bool:
    """Write all of `piece`; whether the file is still written directly (a file system that took
    O_DIRECT at open but refuses the write gets the rest through the page cache)."""
    while len(piece):
        try:
            n = os.write(fd, piece)
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise
            direct = _buffered(fd)
            continue
        if direct and n % ALIGN:  # a short direct write leaves the rest unaligned
            direct = _buffered(fd)
        piece = piece[n:]
    return direct
