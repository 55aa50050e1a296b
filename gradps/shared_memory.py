"""Shared-memory segments: the payloads of pushes and pulls between a worker and a shard that run
on one host.

A worker creates a segment (a file in /dev/shm), the shard maps it (ShardService.MapSegment) and
the worker then unlinks the file: the memory lives while either process maps it, so a killed
worker leaks nothing. A payload then crosses with one memcpy instead of gRPC's copies and the
kernel's two through a loopback socket (docs/performance.md). gRPC still carries every call and
its metadata; only the payload bytes move. Where the shard cannot open the file (another host,
another container), MapSegment fails and the worker sends payloads inline, as before.
"""

from __future__ import annotations

import errno
import hmac
import mmap
import os
import re
import secrets
import stat
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

from gradps.v1 import tensor_pb2

SHM_DIR = Path("/dev/shm")
NAME = re.compile(r"gradps-[A-Za-z0-9_-]{1,100}")
TOKEN_BYTES = 16
# Regions start after the token, at a cache-line boundary; every region offset is a multiple of it.
ALIGN = 64


class SegmentError(Exception):
    """A segment that cannot be created, opened or addressed as asked."""


def _pid_namespace() -> int:
    """This process's PID namespace (0 where /proc does not say): containers sharing /dev/shm
    number their processes apart, so a creator's pid means something only within its namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def name_prefix(pid: int | None = None) -> str:
    """Names of the segments that process `pid` (this one by default) creates start with this."""
    return f"gradps-{_pid_namespace()}-{os.getpid() if pid is None else pid}-"


def remove_orphans() -> None:
    """Unlink the segments of creators in this PID namespace that died between creating one and
    its shard mapping it (the only window in which a segment has a name). Mappings of a removed
    name stay valid."""
    namespace = f"gradps-{_pid_namespace()}-"
    for path in SHM_DIR.glob(f"{namespace}*-*"):
        pid = path.name[len(namespace) :].split("-")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, someone else's


def check_name(name: str) -> None:
    """SegmentError unless `name` is a segment's name: no path, nothing but gradps' own files."""
    if not NAME.fullmatch(name):
        raise SegmentError(f"bad segment name {name!r}: expected 'gradps-' and 1-100 of [A-Za-z0-9_-]")


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


class Segment:
    """A mapped segment; `region` and `floats` give views of its bytes (no copy)."""

    def __init__(self, name: str, memory: mmap.mmap, token: bytes, fd: int | None = None) -> None:
        """`fd`: the file of a segment another process created (`open`), kept to check its size."""
        self.name = name
        self.size = len(memory)
        self.token = token
        self._memory = memory
        self._fd = fd
        if fd is not None:
            weakref.finalize(self, os.close, fd)
        self._bytes = np.frombuffer(memory, dtype=np.uint8)
        # None until pin() is asked; then whether CUDA page-locked the segment.
        self.pinned: bool | None = None
        self._pin_lock = threading.Lock()

    @classmethod
    def create(cls, size: int) -> Segment:
        """A new segment with room for `size` bytes of regions after its token, its pages
        allocated now (a first touch in the middle of a push would cost a page fault per 4 KiB)."""
        remove_orphans()
        name = f"{name_prefix()}{secrets.token_hex(8)}"
        total = ALIGN + aligned(size)
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise SegmentError(f"cannot create {SHM_DIR / name}: {e.strerror}") from None
        try:
            os.posix_fallocate(fd, 0, total)
            memory = mmap.mmap(fd, total)
        except OSError as e:
            os.unlink(SHM_DIR / name)
            raise SegmentError(f"cannot allocate {total} bytes in {SHM_DIR}: {e.strerror}") from None
        finally:
            os.close(fd)
        token = secrets.token_bytes(TOKEN_BYTES)
        memory[:TOKEN_BYTES] = token
        return cls(name, memory, token)

    @classmethod
    def open(cls, name: str, token: bytes) -> Segment:
        """Map the segment another process created, checking that its first bytes are `token`."""
        check_name(name)
        try:
            # Not through a link: a worker must not make this process write a file elsewhere.
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            reasons = {errno.ENOENT: "not on this host", errno.ELOOP: "a symbolic link"}
            reason = reasons.get(e.errno or 0, e.strerror)
            raise SegmentError(f"cannot open segment {name}: {reason}") from None
        try:
            status = os.fstat(fd)
            size = status.st_size
            if not stat.S_ISREG(status.st_mode):
                raise SegmentError(f"segment {name} is not a regular file")
            if size < ALIGN:
                raise SegmentError(f"segment {name} is {size} bytes, too small")
            try:
                memory = mmap.mmap(fd, size)
            except OSError as e:  # more than the address space or memory limits allow
                raise SegmentError(f"cannot map segment {name} ({size} bytes): {e.strerror}") from None
        except SegmentError:
            os.close(fd)
            raise
        if not hmac.compare_digest(memory[:TOKEN_BYTES], token):
            memory.close()
            os.close(fd)
            raise SegmentError(f"segment {name}: token does not match")
        return cls(name, memory, token, fd)

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

    def unlink(self) -> None:
        """Remove the file; the mappings stay valid until both processes drop them."""
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass

    def check(self, offset: int, length: int) -> None:
        """SegmentError unless [offset, offset + length) is an aligned range after the token, and,
        for a segment another process created, still within its file: pages the creator cut off
        (ftruncate) would kill this process with SIGBUS when touched. (A creator that cuts the
        file between this check and the copy still can: the copy itself is not guarded.)"""
        if offset < ALIGN or offset % ALIGN or length < 0 or offset + length > self.size:
            raise SegmentError(
                f"region [{offset}, {offset + length}) of segment {self.name} is not an aligned range "
                f"within [{ALIGN}, {self.size})"
            )
        if self._fd is not None and (size := os.fstat(self._fd).st_size) < offset + length:
            raise SegmentError(f"segment {self.name} was cut to {size} bytes by its creator")

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
