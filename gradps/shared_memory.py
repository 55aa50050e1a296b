"""Shared-memory segments: the payloads of pushes and pulls between a worker and a shard that run
on one host.

A worker creates a segment as a memfd (anonymous shared memory: no file name, so a killed worker
leaks nothing), sealed so that its size can never change (F_SEAL_SHRINK, F_SEAL_GROW) and only
its user can open it (0600). The shard opens it through the worker's descriptor,
/proc/<pid>/fd/<n>, during ShardService.MapSegment, and maps it only if it is sealed against
shrinking: no process, the worker included, can then cut pages from under the shard's mapping (a
touch of a page past the end of a file kills the process with SIGBUS). A payload then crosses
with one memcpy instead of gRPC's copies and the kernel's two through a loopback socket
(docs/performance.md). gRPC still carries every call and its metadata; only the payload bytes
move. Where the shard cannot open the descriptor (another host, another PID namespace, another
user), MapSegment fails and the worker sends payloads inline, as before.
"""

from __future__ import annotations

import errno
import fcntl
import hmac
import mmap
import os
import re
import secrets
import stat
import threading
import weakref

import numpy as np
import torch

from gradps.v1 import tensor_pb2

NAME = re.compile(r"gradps-[A-Za-z0-9_-]{1,100}")
TOKEN_BYTES = 16
# Regions start after the token, at a cache-line boundary; every region offset is a multiple of it.
ALIGN = 64
# Only the segment's user may open it; the shard refuses one that others could.
MODE = 0o600


class SegmentError(Exception):
    """A segment that cannot be created, opened or addressed as asked."""


def pid_namespace() -> int:
    """This process's PID namespace (0 where /proc does not say): a pid names a process only
    within its namespace, so a shard opens a worker's descriptor only when they share one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _same_network(pid: int) -> bool:
    """Whether process `pid` shares this process's network namespace (True where /proc does not say)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return True


def check_name(name: str) -> None:
    """SegmentError unless `name` is a segment's name."""
    if not NAME.fullmatch(name):
        raise SegmentError(f"bad segment name {name!r}: expected 'gradps-' and 1-100 of [A-Za-z0-9_-]")


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def _creator_seals() -> int:
    # The size is fixed for good, and the set is final: no write seal added later can make a
    # shard's mapping fail.
    return fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _open_sealed(name: str, pid: int, fd: int) -> int:
    """Open descriptor `fd` of process `pid`: a regular file of this user, 0600, sealed against
    shrinking, in ordinary pages (in hugetlbfs, pages a creator punches out can fault with SIGBUS
    when the pool is empty). Returns this process's own descriptor of it."""
    path = f"/proc/{pid}/fd/{fd}"
    where = f"segment {name} (descriptor {fd} of process {pid})"
    try:
        before = os.stat(path)
    except OSError as e:
        reasons = {errno.ENOENT: "no such process or descriptor", errno.EACCES: "another user's process"}
        raise SegmentError(f"cannot open {where}: {reasons.get(e.errno or 0, e.strerror)}") from None
    # Checked before opening: opening a device or a FIFO can have effects of its own.
    if not stat.S_ISREG(before.st_mode):
        raise SegmentError(f"{where} is not a regular file")
    try:
        file = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as e:
        raise SegmentError(f"cannot open {where}: {e.strerror}") from None
    try:
        status = os.fstat(file)
        if (status.st_dev, status.st_ino) != (before.st_dev, before.st_ino):
            raise SegmentError(f"{where} changed while it was opened")
        if status.st_uid != os.geteuid() or stat.S_IMODE(status.st_mode) & ~MODE:
            raise SegmentError(f"{where} is not {MODE:o} and this user's (mode {stat.S_IMODE(status.st_mode):o})")
        if status.st_blksize != mmap.PAGESIZE:
            raise SegmentError(f"{where} is not in ordinary {mmap.PAGESIZE}-byte pages")
        try:
            seals = fcntl.fcntl(file, fcntl.F_GET_SEALS)
        except OSError:
            raise SegmentError(f"{where} is not a memfd") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise SegmentError(f"{where} is not sealed against shrinking (F_SEAL_SHRINK)")
    except SegmentError:
        os.close(file)
        raise
    return file


class Segment:
    """A mapped segment; `region` and `floats` give views of its bytes (no copy)."""

    def __init__(self, name: str, memory: mmap.mmap, token: bytes, fd: int | None = None) -> None:
        """`fd`: the creator's descriptor of its segment, open until `release`."""
        self.name = name
        self.size = len(memory)
        self.token = token
        self._memory = memory
        self._fd = fd
        self._close = weakref.finalize(self, os.close, fd) if fd is not None else None
        self._bytes = np.frombuffer(memory, dtype=np.uint8)
        # None until pin() is asked; then whether CUDA page-locked the segment.
        self.pinned: bool | None = None
        self._pin_lock = threading.Lock()

    @classmethod
    def create(cls, size: int) -> Segment:
        """A new sealed segment with room for `size` bytes of regions after its token, its pages
        allocated now (a first touch in the middle of a push would cost a page fault per 4 KiB)."""
        name = f"gradps-{secrets.token_hex(8)}"
        total = ALIGN + aligned(size)
        if not hasattr(os, "memfd_create"):
            raise SegmentError("no memfd on this system")
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            raise SegmentError(f"cannot create a sealed memfd: {e.strerror}") from None
        try:
            os.fchmod(fd, MODE)  # a memfd starts 0777
            os.posix_fallocate(fd, 0, total)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _creator_seals())
            memory = mmap.mmap(fd, total)
        except OSError as e:
            os.close(fd)
            raise SegmentError(f"cannot allocate {total} bytes of sealed shared memory: {e.strerror}") from None
        token = secrets.token_bytes(TOKEN_BYTES)
        memory[:TOKEN_BYTES] = token
        return cls(name, memory, token, fd)

    @classmethod
    def open(cls, name: str, token: bytes, pid: int, fd: int, namespace: int) -> Segment:
        """Map the segment that process `pid` of PID namespace `namespace` created and holds as
        descriptor `fd`, checking that it is sealed against shrinking and starts with `token`."""
        check_name(name)
        if namespace != pid_namespace():
            raise SegmentError(f"cannot open segment {name}: its creator runs in another PID namespace")
        if not _same_network(pid):
            # Another network namespace is another host (a container, an emulated host): its
            # payloads take the network, as they would between machines.
            raise SegmentError(f"cannot open segment {name}: its creator is on another host (network namespace)")
        file = _open_sealed(name, pid, fd)
        try:
            # Read after the seals were checked: from then on the file can only stay this long.
            size = os.fstat(file).st_size
            if size < ALIGN:
                raise SegmentError(f"segment {name} is {size} bytes, too small")
            try:
                memory = mmap.mmap(file, size)
            except OSError as e:  # past the address space or memory limits, or sealed against writes
                raise SegmentError(f"cannot map segment {name} ({size} bytes): {e.strerror}") from None
        finally:
            os.close(file)  # the mapping keeps the memory
        if not hmac.compare_digest(memory[:TOKEN_BYTES], token):
            memory.close()
            raise SegmentError(f"segment {name}: token does not match")
        return cls(name, memory, token)

    def descriptor(self) -> int:
        """The creator's descriptor of the segment, through which the shard opens it."""
        if self._fd is None or not (self._close and self._close.alive):
            raise SegmentError(f"segment {self.name} has no descriptor here")
        return self._fd

    def release(self) -> None:
        """Close the creator's descriptor once the shard has mapped the segment (or could not):
        the mappings stay valid until both processes drop them."""
        if self._close is not None:
            self._close()

    def pin(self) -> bool:
        """Page-lock the segment for CUDA (cudaHostRegister), once: copies between it and a GPU
        then go by DMA straight from and to it, not through the driver's staging buffer. False
        where there is no CUDA or it refuses (copies still work, staged). Unregistered when the
        segment is collected; views handed out before stay valid, as plain memory."""
        with self._pin_lock:
            if self.pinned is None:
                self.pinned = False
                if torch.cuda.is_available():
                    # As torch pins shared memory itself (torch/cuda/_pin_memory_utils.py):
                    # cudaHostRegisterPortable, so every CUDA context of the process sees it.
                    cudart = torch.cuda.cudart()
                    address = self._bytes.ctypes.data
                    if int(cudart.cudaHostRegister(address, self.size, 1)) == 0:
                        weakref.finalize(self, cudart.cudaHostUnregister, address)
                        self.pinned = True
            return self.pinned

    def check(self, offset: int, length: int) -> None:
        """SegmentError unless [offset, offset + length) is an aligned range after the token. (The
        segment's seals keep every such range backed by the file for as long as it is mapped.)"""
        if offset < ALIGN or offset % ALIGN or length < 0 or offset + length > self.size:
            raise SegmentError(
                f"region [{offset}, {offset + length}) of segment {self.name} is not an aligned range "
                f"within [{ALIGN}, {self.size})"
            )

    def region(self, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length), checked."""
        self.check(offset, length)
        return self._bytes[offset : offset + length].data

    def floats(self, offset: int, count: int) -> torch.Tensor:
        """`count` float32 values at `offset`, as a tensor viewing the segment."""
        self.check(offset, 4 * count)
        return torch.from_numpy(self._bytes[offset : offset + 4 * count].view(np.float32))

    def write(self, offset: int, data: bytes | bytearray | memoryview | torch.Tensor) -> None:
        """Copy `data` to `offset`: bytes, or float32 values on any device (one copy, straight
        from a GPU's memory), checked like `region`."""
        if isinstance(data, torch.Tensor):
            self.floats(offset, data.numel()).copy_(data)
        else:
            self.region(offset, len(data))[:] = data


class RegionWriter:
    """Lays payloads one after another into [offset, offset + length) of a segment: a worker's
    push or deposit into its area, a shard's pull or group average into the region the worker
    named. Each payload starts at an ALIGN boundary."""

    def __init__(self, segment: Segment, offset: int, length: int) -> None:
        segment.check(offset, length)
        self.segment = segment
        self.cursor = offset
        self.end = offset + length

    def put(self, payload: bytes | bytearray | memoryview | torch.Tensor) -> tensor_pb2.SharedRegion | None:
        """Copy `payload` (bytes, or float32 values on any device) in and say where it lies; None
        when it does not fit (it then travels inline)."""
        size = nbytes(payload)
        if self.cursor + size > self.end:
            return None
        self.segment.write(self.cursor, payload)
        region = tensor_pb2.SharedRegion(segment=self.segment.name, offset=self.cursor, length=size)
        self.cursor += aligned(size)
        return region


def nbytes(data: bytes | bytearray | memoryview | torch.Tensor) -> int:
    """Bytes `Segment.write` copies for `data`."""
    return 4 * data.numel() if isinstance(data, torch.Tensor) else len(data)
