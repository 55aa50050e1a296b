"""A TLS connection that two threads share, one sending and one receiving: a data stream's two
directions are used by two calls at once (gradps/data_stream.py).

OpenSSL lets only one thread use a connection at a time, so the TLS state (an `ssl.SSLObject`
over memory buffers) is used under one lock, and the network outside it: a sender encrypts a
chunk under the lock and writes the records with one `sendall`, a receiver reads whatever the
socket has and decrypts it under the lock. Neither waits for the network while holding the lock,
and a MiB costs a few system calls, not two per 16 KiB record as `ssl.SSLSocket` makes. Each
handle (`dup`) has its own socket object on the one connection, so its own timeout, as a dup'ed
plain socket has.
"""

from __future__ import annotations

import socket
import ssl
import threading
from dataclasses import dataclass, field
from typing import cast

# Plaintext bytes encrypted per lock hold, and ciphertext bytes read from the socket per receive.
_CHUNK = 1 << 20


@dataclass
class _Session:
    """The TLS state both handles share."""

    tls: ssl.SSLObject
    incoming: ssl.MemoryBIO
    outgoing: ssl.MemoryBIO
    # Held while the TLS state is used (never during network I/O).
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Held from taking ciphertext out of `outgoing` until it is written: records leave in order.
    sending: threading.Lock = field(default_factory=threading.Lock)


class TlsSocket:
    """One handle on a TLS connection, with the methods of a socket that a data stream uses.
    Make one with `client` or `server`, which complete the handshake."""

    def __init__(self, raw: socket.socket, session: _Session) -> None:
        self._raw = raw
        self._session = session
        self._buffer: memoryview | None = None  # ciphertext received, before it is decrypted

    @classmethod
    def client(cls, raw: socket.socket, context: ssl.SSLContext, host: str) -> TlsSocket:
        """The client end over the connected `raw` (its timeout bounds each step of the handshake),
        the server's certificate checked for `host`. ssl.SSLError or OSError when refused."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        sock = cls(raw, _Session(context.wrap_bio(incoming, outgoing, server_hostname=host), incoming, outgoing))
        sock._handshake()
        return sock

    @classmethod
    def server(cls, raw: socket.socket, context: ssl.SSLContext) -> TlsSocket:
        """The server end over the accepted `raw`; like `client`."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        sock = cls(raw, _Session(context.wrap_bio(incoming, outgoing, server_side=True), incoming, outgoing))
        sock._handshake()
        return sock

    def _handshake(self) -> None:
        session = self._session
        while True:
            try:
                session.tls.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
            except ssl.SSLError:
                self._flush()  # the alert that says why, for the peer
                raise
            data = self._raw.recv(1 << 16)
            if not data:
                raise ConnectionResetError("the peer closed the connection during the TLS handshake")
            session.incoming.write(data)

    def _flush(self) -> None:
        """Write what the TLS state has for the peer."""
        session = self._session
        with session.sending:
            with session.lock:
                data = session.outgoing.read()
            if data:
                self._raw.sendall(data)

    def dup(self) -> TlsSocket:
        """Another handle on the same connection, with its own timeout."""
        return TlsSocket(self._raw.dup(), self._session)

    def settimeout(self, timeout: float | None) -> None:
        self._raw.settimeout(timeout)

    def fileno(self) -> int:
        return self._raw.fileno()

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self._raw.setsockopt(level, option, value)

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt and send all of `data`; each chunk's records are written within the timeout."""
        view = memoryview(data).cast("B")
        session = self._session
        with session.sending:
            for start in range(0, len(view), _CHUNK):
                with session.lock:
                    session.tls.write(view[start : start + _CHUNK])
                    records = session.outgoing.read()
                self._raw.sendall(records)

    def recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        """Receive up to `nbytes` (all of `view`: 0) plaintext bytes into `view`; 0 when the peer closed."""
        session = self._session
        wanted = nbytes or len(view)
        while True:
            with session.lock:
                try:
                    # With a buffer, read() returns the count (typeshed has bytes only).
                    got = cast(int, session.tls.read(wanted, view))
                    reply = session.outgoing.pending
                except ssl.SSLWantReadError:
                    got, reply = -1, 0
                except ssl.SSLZeroReturnError:  # the peer's close_notify
                    return 0
            if reply:  # what reading asked the TLS state to answer (none in a data stream's TLS)
                self._flush()
            if got >= 0:
                return got
            if self._buffer is None:
                self._buffer = memoryview(bytearray(_CHUNK))
            n = self._raw.recv_into(self._buffer)
            if n == 0:
                return 0
            with session.lock:
                session.incoming.write(self._buffer[:n])

    def recv(self, n: int, flags: int = 0) -> bytes:
        """`socket.recv` of the encrypted bytes (a data stream peeks with it to see whether the
        peer closed); plaintext comes through `recv_into`."""
        return self._raw.recv(n, flags)

    def shutdown(self, how: int) -> None:
        """Shut the connection down: a thread waiting on it in either direction wakes at once."""
        self._raw.shutdown(how)

    def close(self) -> None:
        self._raw.close()
