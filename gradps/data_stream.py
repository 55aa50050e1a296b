"""Data streams: the payloads of pushes and pulls between a worker and a shard on another host, as
raw bytes on a TCP connection beside gRPC.

Through gRPC a payload costs protobuf framing, HTTP/2 framing and grpcio's copies on both sides
(one per send, two per receive): 42-51% of raw loopback TCP at 64 MiB (docs/performance.md). On a
data stream it costs the kernel's two copies, as the TCP reference does. gRPC still carries every
call, its metadata, deadline and status; a part's message says how many of its bytes follow on the
stream (TensorPart.streamed), and the receiver reads them with `recv_into` straight into a tensor.

The shard listens on a data port (StreamListener). A worker asks it for a stream over gRPC
(ShardService.OpenStream: port and a random token), connects, presents the token and waits for the
shard's one-byte answer; the stream then belongs to that worker in that run. Each direction (push:
worker to shard; pull: shard to worker) is used by one call at a time, and every call's bytes start
with its call number (StreamCall.call). A call that fails for any reason closes the stream: its
bytes can no longer be framed. The worker then sends payloads inline until it has opened a new one
(gradps/transport/data_stream.py).

When the shard serves TLS, so does its data port, with the same certificate (gradps/auth/tls.py):
the worker verifies it as its channel does, and presents the token only inside TLS.
"""

from __future__ import annotations

import hmac
import ipaddress
import itertools
import logging
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gradps.auth.tls import ServerContexts, TlsError, TlsFiles, client_context
from gradps.auth.tls_socket import TlsSocket
from gradps.channel import tune_allocator
from gradps.errors import DataLost

_LOGGER = logging.getLogger("gradps.stream")
TOKEN_BYTES = 16
# A connection must present its token this soon after connecting, and the worker's token is
# valid this long after OpenStream answered.
HANDSHAKE_S = 10.0
# Connections that have not presented their token yet, each with a thread: beyond this many, new
# ones are refused (their workers send payloads inline), so that connections that trickle their
# token, or never send it, cannot take a shard's threads and descriptors without bound.
MAX_HANDSHAKES = 64
# Socket buffers and the largest single send or receive: big, so that Python's per-call cost
# vanishes (the same as the TCP reference of `gradps bench transport`).
SOCKET_BUFFER = 4 << 20
_CALL = struct.Struct("<Q")
_ATTACHED = b"\x01"


class StreamError(DataLost):
    """A stream that cannot be opened, or broke or lost its framing during a call. Out of a
    shard's handler it ends the call with DATA_LOSS: the worker makes it again inline."""


def tune_socket(sock: socket.socket | TlsSocket) -> None:
    """Big buffers, no Nagle delay: a connection that moves tens of MiB per call."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def recv_exact(sock: socket.socket | TlsSocket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from `sock`; StreamError if the peer closes first. With `deadline` (a
    time.monotonic() value) the whole fill must end by then (TimeoutError), however the peer
    spreads its bytes; without, each receive has the socket's timeout."""
    got = 0
    while got < len(view):
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        n = sock.recv_into(view[got:], min(len(view) - got, SOCKET_BUFFER))
        if n == 0:
            raise StreamError("the peer closed the data stream")
        got += n


class DataStream:
    """One worker's connection to one shard in one run. `sending` and `receiving` claim a
    direction for one call."""

    def __init__(self, sock: socket.socket | TlsSocket, stream_id: int) -> None:
        self.id = stream_id
        # One socket object per direction, so that each has its own timeout (the calls in the two
        # directions have their own deadlines); both are the same connection.
        self._sockets = {"send": sock.dup(), "receive": sock}
        for each in self._sockets.values():
            # Timeout mode keeps the shared descriptor non-blocking: every wait is bounded.
            each.settimeout(HANDSHAKE_S)
        self._directions = {"send": threading.Lock(), "receive": threading.Lock()}
        self._calls = itertools.count(1)
        self.closed = False

    @classmethod
    def connect(
        cls, host: str, port: int, token: bytes, stream_id: int, timeout_s: float, tls: TlsFiles | None = None
    ) -> DataStream:
        """The worker's end: connect to the shard's data port and present `token` (inside TLS
        with `tls`, the server verified as the worker's channel verifies it)."""
        try:
            raw = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            raise StreamError(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        sock: socket.socket | TlsSocket = raw
        try:
            tune_socket(raw)
            if tls is not None:
                sock = TlsSocket.client(raw, client_context(tls), host)
            sock.sendall(token)
            answer = bytearray(1)
            recv_exact(sock, memoryview(answer))
            if bytes(answer) != _ATTACHED:
                raise StreamError(f"the shard answered {bytes(answer)!r} to the token")
        except (OSError, StreamError, TlsError) as e:  # ssl.SSLError is an OSError
            sock.close()
            raise StreamError(f"data stream to {host}:{port} refused: {e}") from None
        return cls(sock, stream_id)

    def next_call(self) -> int:
        """A call number not used on this stream before (the worker numbers its calls)."""
        return next(self._calls)

    @contextmanager
    def sending(self, call: int, timeout_s: float) -> Iterator[CallSender | None]:
        """The send direction for call `call`, or None while another call has it or the stream is
        closed. An exception out of the block closes the stream."""
        with self._claim("send") as claimed:
            yield CallSender(self, call, timeout_s) if claimed else None

    @contextmanager
    def receiving(self, call: int, timeout_s: float) -> Iterator[CallReceiver | None]:
        """The receive direction for call `call`; like `sending`."""
        with self._claim("receive") as claimed:
            yield CallReceiver(self, call, timeout_s) if claimed else None

    @contextmanager
    def _claim(self, direction: str) -> Iterator[bool]:
        lock = self._directions[direction]
        if self.closed or not lock.acquire(blocking=False):
            yield False
            return
        try:
            yield True
        except BaseException:
            self.close()
            raise
        finally:
            lock.release()

    def gone(self) -> bool:
        """Whether the stream is closed, here or (seen without blocking) by the other end; a
        stream the other end closed is closed here too."""
        if not self.closed:
            sock = self._sockets["receive"]
            try:
                # poll, not select: select() fails on descriptors past 1024 (a busy shard's).
                readable = select.poll()
                readable.register(sock, select.POLLIN)
                if readable.poll(0) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    self.close()
            except BlockingIOError:
                pass
            except OSError:
                self.close()
        return self.closed

    def close(self) -> None:
        """Close the connection: a call blocked on it in either direction fails at once."""
        self.closed = True
        try:
            self._sockets["receive"].shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for sock in self._sockets.values():
            sock.close()


class _CallIO:
    """One call's use of one direction of a stream."""

    def __init__(self, stream: DataStream, call: int, timeout_s: float) -> None:
        self.stream = stream
        self.call = call
        self._deadline = time.monotonic() + timeout_s
        self.started = False

    def _socket(self, direction: str) -> socket.socket | TlsSocket:
        sock = self.stream._sockets[direction]
        sock.settimeout(max(0.001, self._deadline - time.monotonic()))
        return sock

    def _failed(self, why: str) -> StreamError:
        """Close the stream (its bytes can no longer be framed; the peer's read or write fails at
        once) and say why, for the caller to raise."""
        self.stream.close()
        return StreamError(f"data stream {self.stream.id}: {why}")


class CallSender(_CallIO):
    """One call's bytes in the send direction: its number, then payloads in order. A send that
    fails closes the stream."""

    def send(self, payload: bytes | bytearray | memoryview) -> None:
        """Write one payload (the call number first, before the call's first payload)."""
        try:
            sock = self._socket("send")
            if not self.started:
                sock.sendall(_CALL.pack(self.call))
                self.started = True
            sock.sendall(payload)
        except OSError as e:
            raise self._failed(f"send failed ({e.strerror or e})") from None


class CallReceiver(_CallIO):
    """One call's bytes in the receive direction, checked against its number. A receive that
    fails closes the stream."""

    def receive_into(self, view: memoryview) -> None:
        """Fill `view` (bytes) with the next payload (checking the call number first)."""
        try:
            sock = self._socket("receive")
            if not self.started:
                number = bytearray(_CALL.size)
                recv_exact(sock, memoryview(number))
                (got,) = _CALL.unpack(number)
                if got != self.call:
                    raise self._failed(f"bytes of call {got}, expected call {self.call}")
                self.started = True
            recv_exact(sock, view)
        except TimeoutError:
            raise self._failed("the payload did not arrive in time") from None
        except OSError as e:
            raise self._failed(f"receive failed ({e.strerror or e})") from None
        except StreamError:  # the peer closed it, or the numbers differ (closed already)
            self.stream.close()
            raise


class StreamListener:
    """The shard's end: accepts data streams on one port. `expect` announces a stream (OpenStream)
    and names the function that attaches its connection once it presents the token. `host`: the
    address to listen on ("": every one), as the shard's gRPC port; `tls`: serve TLS only."""

    def __init__(self, port: int = 0, host: str = "", tls: TlsFiles | None = None) -> None:
        # Before the accept thread, as make_server and open_channel do before theirs: a thread that
        # allocates before the one-arena setting keeps an arena of its own, and a shard's decoded
        # pushes then pile up in two (tests/test_shard_memory.py).
        tune_allocator()
        self._tls = ServerContexts(tls) if tls is not None else None
        self._server = _listen(host.strip("[]"), port)
        self.port = self._server.getsockname()[1]
        self._pending: dict[bytes, tuple[float, int, Callable[[DataStream], bool]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        threading.Thread(target=self._accept, name="data-streams", daemon=True).start()

    def expect(self, attach: Callable[[DataStream], bool]) -> tuple[bytes, int]:
        """(token, stream id) of a new stream; `attach(stream)` is called when a connection
        presents the token, and returns False to refuse it (the run closed meanwhile, ...)."""
        token = secrets.token_bytes(TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            # Tokens never presented are forgotten once they expire.
            self._pending = {t: p for t, p in self._pending.items() if p[0] > now}
            stream_id = next(self._ids)
            self._pending[token] = (now + HANDSHAKE_S, stream_id, attach)
        return token, stream_id

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError as e:
                if self._server.fileno() < 0:
                    return  # closed
                # Out of descriptors (EMFILE, ENFILE) or memory: the port must outlive it, or every
                # later stream of every run would time out with nothing logged.
                _LOGGER.warning("data port %d: %s; accepting again in 1 s", self.port, e)
                time.sleep(1.0)
                continue
            if not self._handshakes.acquire(blocking=False):
                conn.close()
                _LOGGER.warning(
                    "data port %d: %d connections without a token yet; one refused", self.port, MAX_HANDSHAKES
                )
                continue
            try:
                threading.Thread(
                    target=self._handshake, args=(conn,), name="data-stream-handshake", daemon=True
                ).start()
            except RuntimeError as e:  # no thread to spare: refuse this one, keep the port
                self._handshakes.release()
                conn.close()
                _LOGGER.warning("data port %d: %s; connection refused", self.port, e)

    def _handshake(self, raw: socket.socket) -> None:
        token = bytearray(TOKEN_BYTES)
        conn: socket.socket | TlsSocket = raw
        deadline = time.monotonic() + HANDSHAKE_S
        try:  # within HANDSHAKE_S in all: a token sent a byte at a time must not stretch it
            if self._tls is not None:
                raw.settimeout(HANDSHAKE_S)
                conn = TlsSocket.server(raw, self._tls.current())
            recv_exact(conn, memoryview(token), deadline=deadline)
        except (OSError, StreamError) as e:  # ssl.SSLError too: a client without TLS, or a wrong certificate
            if isinstance(e, ssl.SSLError):
                _LOGGER.info("data stream refused: %s", e.reason or e)
            conn.close()
            return
        finally:
            self._handshakes.release()
        now = time.monotonic()
        with self._lock:
            found = next((t for t in self._pending if hmac.compare_digest(t, bytes(token))), None)
            pending = self._pending.pop(found) if found is not None else None
        if pending is None or pending[0] < now:
            _LOGGER.info("data stream refused: unknown or expired token")
            conn.close()
            return
        _, stream_id, attach = pending
        tune_socket(conn)
        stream = DataStream(conn, stream_id)
        try:
            if not attach(stream):
                stream.close()
                return
            conn.sendall(_ATTACHED)
        except OSError:
            stream.close()

    def close(self) -> None:
        """Stop accepting: shut down first, or the thread blocked in accept() keeps the port."""
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host` ("" or "::": every address, IPv6 and IPv4 where the host has
    both; "0.0.0.0": every IPv4 one)."""
    if host in ("", "::") and socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host or "0.0.0.0").version == 6 else socket.AF_INET
    except ValueError:  # a host name: its IPv4 address
        family = socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=64)
