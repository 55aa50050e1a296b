"""The yardsticks a transport is measured against, in the same run: raw loopback TCP between two
processes, and torch.distributed's gloo all_reduce between the same number of processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time

MiB = 1 << 20
# Socket buffers and the largest single send/recv: big, so that Python's per-call overhead vanishes.
_SOCKET_BUFFER = 4 * MiB


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, _SOCKET_BUFFER))
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _tcp_echo(port_queue: mp.Queue, sizes: list[int], rounds: int, iters: list[int]) -> None:
    """The far end: receive `size` bytes, send them back, for every size and round."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    _tune(conn)
    for size, n in zip(sizes, iters, strict=True):
        view = memoryview(bytearray(size))
        for _ in range(rounds * n + 1):
            _recv_exact(conn, view)
            conn.sendall(view)
    conn.close()


def tcp_ping_pong(sizes: list[int], rounds: int, iters: list[int]) -> dict[int, list[float]]:
    """Seconds per round trip (send `size` bytes, receive them back) for each size, per round.

    A push then a pull moves the same bytes the same way, so 2 * size / seconds is the figure a
    push + pull is compared with.
    """
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    echo = ctx.Process(target=_tcp_echo, args=(ports, sizes, rounds, iters), daemon=True)
    echo.start()
    out: dict[int, list[float]] = {}
    try:
        sock = socket.create_connection(("127.0.0.1", ports.get(timeout=60)))
        _tune(sock)
        for size, n in zip(sizes, iters, strict=True):
            send = memoryview(bytearray(os.urandom(min(size, MiB)) * max(1, size // MiB))[:size])
            back = memoryview(bytearray(size))
            sock.sendall(send)  # warm-up
            _recv_exact(sock, back)
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(n):
                    sock.sendall(send)
                    _recv_exact(sock, back)
                times.append((time.perf_counter() - start) / n)
            out[size] = times
        sock.close()
    finally:
        echo.join(timeout=30)
        if echo.is_alive():
            echo.kill()
    return out


def _gloo_rank(rank: int, world: int, port: int, sizes: list[int], rounds: int, iters: list[int], results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for size, n in zip(sizes, iters, strict=True):
            tensor = torch.randn(size // 4)
            dist.all_reduce(tensor)  # warm-up (and connection set-up)
            for r in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(tensor)
                results.put((size, r, start, time.perf_counter()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_all_reduce(world: int, sizes: list[int], rounds: int, iters: list[int]) -> dict[int, list[float]]:
    """Seconds per all_reduce (sum) of a float32 tensor of each size between `world` processes,
    per round: first rank's start to last rank's end."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    ranks = [
        ctx.Process(target=_gloo_rank, args=(r, world, port, sizes, rounds, iters, results), daemon=True)
        for r in range(world)
    ]
    for p in ranks:
        p.start()
    spans: dict[tuple[int, int], list[tuple[float, float]]] = {}
    expected = world * rounds * len(sizes)
    deadline = time.monotonic() + 600
    try:
        while sum(len(v) for v in spans.values()) < expected:
            if time.monotonic() > deadline or not all(p.is_alive() or p.exitcode == 0 for p in ranks):
                raise RuntimeError("gloo reference processes failed")
            try:
                size, r, start, end = results.get(timeout=1.0)
            except Exception:
                continue
            spans.setdefault((size, r), []).append((start, end))
    finally:
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    n_of = dict(zip(sizes, iters, strict=True))
    return {
        size: [
            (max(e for _, e in spans[(size, r)]) - min(s for s, _ in spans[(size, r)])) / n_of[size]
            for r in range(rounds)
        ]
        for size in sizes
    }


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
