"""A shard serves every thread's allocations from one malloc arena (ps_server/shard.py
`_one_malloc_arena`), so the gradients one gRPC thread frees can serve the next push on another."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

# Allocates 4 MiB tensors (the size of a part) on six threads, as gRPC's pool decodes pushes,
# then counts glibc's arenas in malloc_info's report (one <heap> element per arena).
_PROBE = textwrap.dedent(
    """
    import ctypes, sys, tempfile, threading
    import torch
    from ps_server.shard import _one_malloc_arena
    if sys.argv[1] == "one":
        _one_malloc_arena()
    def decode():
        for _ in range(4):
            torch.empty(1 << 20).fill_(1.0)
    threads = [threading.Thread(target=decode) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    with tempfile.NamedTemporaryFile() as f:
        fp = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(fp))
        libc.fclose(ctypes.c_void_p(fp))
        print(open(f.name).read().count("<heap nr="))
    """
)


def _arenas(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return int(out.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")
def test_a_shard_allocates_from_one_arena_on_every_thread():
    assert _arenas("one") == 1
    # Without it, glibc gives the threads arenas of their own (the probe can tell).
    assert _arenas("default") > 1
