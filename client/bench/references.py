"""The yardsticks a transport is measured against, in the same run: raw loopback TCP between two
processes (with the socket settings of gradps' data streams), and torch.distributed's gloo
all_reduce between the same number of processes. On an emulated network each end is a host of its
own (`Host`): the far end of the TCP reference on host 1, gloo's rank r on host r.

Both stay up as idle processes for the whole bench and run one round when asked, so that the
bench can interleave their rounds with the gRPC rounds: on a shared machine the load changes
from second to second, and only measurements taken side by side compare.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import struct
import time
from typing import Any

from gradps.data_stream import StreamError, recv_exact, tune_socket
from gradps.netem import Host

MiB = 1 << 20
# A round's command on the TCP connection: payload size and round trips.
_COMMAND = struct.Struct("<QI")


_LOOPBACK = "127.0.0.1"


def _tcp_echo(port_queue: mp.Queue, host: Host | None) -> None:
    """The far end: for each command, receive `size` bytes and send them back, `n` times."""
    if host:
        host.enter()
    listener = socket.socket()
    listener.bind((host.address if host else _LOOPBACK, 0))
    listener.listen(1)
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    tune_socket(conn)
    buffer = bytearray()
    header = memoryview(bytearray(_COMMAND.size))
    while True:
        try:
            recv_exact(conn, header)
        except StreamError:
            return
        size, n = _COMMAND.unpack(header)
        if len(buffer) < size:
            buffer = bytearray(size)
        view = memoryview(buffer)[:size]
        for _ in range(n):
            recv_exact(conn, view)
            conn.sendall(view)


class TcpReference:
    """Raw TCP between this process and an echo process: on loopback, or on `far` (another host)."""

    def __init__(self, far: Host | None = None) -> None:
        ctx = mp.get_context("spawn")
        ports = ctx.Queue()
        self._echo = ctx.Process(target=_tcp_echo, args=(ports, far), daemon=True)
        self._echo.start()
        self._sock = socket.create_connection((far.address if far else _LOOPBACK, ports.get(timeout=120)))
        tune_socket(self._sock)
        self._send = bytearray()
        self._back = bytearray()

    def round(self, size: int, n: int) -> float:
        """Seconds per round trip of `size` bytes (out and back: what a push then a pull moves),
        averaged over `n` round trips."""
        if len(self._send) < size:
            self._send = bytearray(os.urandom(min(size, MiB)) * (size // MiB + 1))
            self._back = bytearray(len(self._send))
        send, back = memoryview(self._send)[:size], memoryview(self._back)[:size]
        self._sock.sendall(_COMMAND.pack(size, n + 1))
        self._sock.sendall(send)  # warm-up round trip
        recv_exact(self._sock, back)
        start = time.perf_counter()
        for _ in range(n):
            self._sock.sendall(send)
            recv_exact(self._sock, back)
        return (time.perf_counter() - start) / n

    def close(self) -> None:
        self._sock.close()
        self._echo.join(timeout=10)
        if self._echo.is_alive():
            self._echo.kill()


def _gloo_rank(rank: int, world: int, master: str, commands: mp.Queue, results: mp.Queue, host: Host | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if host:
        host.enter()
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the host's link, not an address of the machine's name
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Rank 0 serves the rendezvous on a port the kernel gives it, and the others learn it: a port
    # chosen beforehand could be taken by the time it binds.
    if rank == 0:
        store = dist.TCPStore(master, 0, world, is_master=True, wait_for_workers=False)
        results.put(("port", rank, store.port))
    else:
        store = dist.TCPStore(master, commands.get(), world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results.put(("ready", rank, None))
    tensors: dict[int, torch.Tensor] = {}
    try:
        while (command := commands.get()) is not None:
            size, n = command
            if size not in tensors:
                tensors.clear()
                tensors[size] = torch.randn(size // 4)
                dist.all_reduce(tensors[size])  # warm-up (connections, buffers)
            tensor = tensors[size]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(tensor)
            results.put(("round", rank, (start, time.perf_counter())))
    finally:
        dist.destroy_process_group()


class GlooReference:
    """`world` processes in a gloo process group, idle between rounds; rank r on `hosts[r]` where
    given (rank 0 serves the rendezvous)."""

    def __init__(self, world: int, timeout_s: float = 300.0, hosts: list[Host] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.timeout_s = timeout_s
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(world)]
        master = hosts[0].address if hosts else _LOOPBACK
        self._ranks = [
            ctx.Process(
                target=_gloo_rank,
                args=(r, world, master, self._commands[r], self._results, hosts[r] if hosts else None),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self._ranks:
            p.start()
        (port,) = self._collect("port", 1)
        for q in self._commands[1:]:
            q.put(port)
        self._collect("ready")

    def _collect(self, kind: str, n: int | None = None) -> list[Any]:
        """The values of `n` (default: every rank's) results of `kind`."""
        values: list[Any] = []
        deadline = time.monotonic() + self.timeout_s
        while len(values) < (self.world if n is None else n):
            try:
                what, _, value = self._results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self._ranks):
                    raise RuntimeError("the gloo reference processes failed") from None
                continue
            if what != kind:
                raise RuntimeError(f"gloo reference: expected {kind!r}, got {what!r}")
            values.append(value)
        return values

    def round(self, size: int, n: int) -> float:
        """Seconds per all_reduce (sum) of a float32 tensor of `size` bytes, over `n` of them:
        first rank's start to last rank's end."""
        for q in self._commands:
            q.put((size, n))
        spans = self._collect("round")
        return (max(e for _, e in spans) - min(s for s, _ in spans)) / n

    def close(self) -> None:
        for q in self._commands:
            q.put(None)
        for p in self._ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
