"""TLS from PEM files: gRPC credentials for servers and channels, and `ssl` contexts for the data
streams, all from one `TlsFiles`.

A server presents `cert` (with `key`) and, with `client_auth`, asks every client for a certificate
that chains to `ca` (mTLS). A client verifies the server's certificate against `ca` and presents
its own `cert` where it has one. A server's files are read again when they change (cert-manager
and `gradps certs` replace them in place): the next connection gets the new certificate, open
ones keep theirs, and the service never restarts.

A client uses TLS when it is told to (`remember` for an address, `set_process_tls` for a
service's own channels) or when GRADPS_TLS_CA names a CA file; GRADPS_TLS_CERT and
GRADPS_TLS_KEY then name its certificate for mTLS.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

_LOGGER = logging.getLogger("gradps.tls")
TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV = "GRADPS_TLS_CERT", "GRADPS_TLS_KEY", "GRADPS_TLS_CA"
TLS_CLIENT_AUTH_ENV = "GRADPS_TLS_CLIENT_AUTH"
# What a file is as far as reloading goes: replaced (new inode), rewritten (mtime, size).
_Signature = tuple[int, int, int]


class TlsError(ValueError):
    """TLS files that are missing, unreadable or do not fit together."""


@dataclass(frozen=True)
class TlsFiles:
    """Where one process's TLS material lies (PEM files)."""

    # This process's certificate chain: a server's; a client's, presented for mTLS.
    cert: Path | None = None
    # The private key of `cert`.
    key: Path | None = None
    # The CA bundle that peers' certificates must chain to (None for a client: the system's roots).
    ca: Path | None = None
    # A server asks every client for a certificate that chains to `ca` (mTLS).
    client_auth: bool = False

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsError("give both a TLS certificate and its key (--tls-cert and --tls-key), or neither")
        if self.client_auth and self.ca is None:
            raise TlsError("--tls-client-auth needs --tls-ca: the CA that client certificates must chain to")

    def read(self, path: Path | None) -> bytes | None:
        """A file's bytes; TlsError (one line) when it cannot be read."""
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError as e:
            raise TlsError(f"cannot read {path}: {e.strerror or e}") from None

    def client_env(self) -> dict[str, str]:
        """The GRADPS_TLS_* variables that give another process's client these files (`client_tls`)."""
        named = ((TLS_CA_ENV, self.ca), (TLS_CERT_ENV, self.cert), (TLS_KEY_ENV, self.key))
        return {name: str(path) for name, path in named if path is not None}

    def signature(self) -> tuple[_Signature | None, ...]:
        """What changes when any of the files is replaced or rewritten."""
        return tuple(_signature(p) for p in (self.cert, self.key, self.ca))

    def check(self) -> None:
        """TlsError unless the files can be read and the key fits the certificate."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if self.cert else ssl.PROTOCOL_TLS_CLIENT)
        try:
            if self.cert is not None:
                context.load_cert_chain(self.cert, self.key)
            if self.ca is not None:
                context.load_verify_locations(cafile=str(self.ca))
        except (OSError, ssl.SSLError) as e:
            names = ", ".join(str(p) for p in (self.cert, self.key, self.ca) if p is not None)
            raise TlsError(f"TLS files {names}: {getattr(e, 'reason', None) or e.strerror or e}") from None


def _signature(path: Path | None) -> _Signature | None:
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def tls_files(cert: str | None, key: str | None, ca: str | None, client_auth: bool = False) -> TlsFiles | None:
    """The TlsFiles named by options (None when none is given); TlsError when they are incomplete."""
    if not (cert or key or ca):
        if client_auth:
            raise TlsError("--tls-client-auth needs --tls-ca, --tls-cert and --tls-key")
        return None
    path = lambda p: Path(p) if p else None  # noqa: E731
    return TlsFiles(path(cert), path(key), path(ca), client_auth)


class _Reloading:
    """Builds a value from the files, and again whenever they change; keeps the last good one
    while a change is half done (a new certificate beside the old key) or cannot be read."""

    def __init__(self, files: TlsFiles, build: Callable[[TlsFiles], object]) -> None:
        self._files = files
        self._build = build
        self._lock = threading.Lock()
        files.check()
        self._seen = files.signature()
        self.value = build(files)

    def changed(self) -> bool:
        """Rebuild `value` if the files changed since; whether it did."""
        signature = self._files.signature()
        if signature == self._seen:
            return False
        with self._lock:
            if signature == self._seen:
                return False
            try:
                self._files.check()
                value = self._build(self._files)
            except TlsError as e:  # tried again at the next connection
                _LOGGER.warning("TLS files changed but cannot be used yet (%s); keeping the previous ones", e)
                return False
            self._seen, self.value = signature, value
        _LOGGER.info("TLS certificate reloaded from %s", self._files.cert)
        return True


def _certificate_configuration(files: TlsFiles) -> object:
    key, cert = files.read(files.key), files.read(files.cert)
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=files.read(files.ca))


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """A gRPC server's credentials from `files` (cert and key needed), read again when they change:
    grpc asks the fetcher before every new connection's handshake. TlsError when unusable."""
    if files.cert is None:
        raise TlsError("a TLS server needs --tls-cert and --tls-key")
    reloading = _Reloading(files, _certificate_configuration)

    def fetch() -> object | None:
        return reloading.value if reloading.changed() else None

    return grpc.dynamic_ssl_server_credentials(reloading.value, fetch, require_client_authentication=files.client_auth)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """A channel's credentials: verify the server against `ca` (the system's roots without one),
    present `cert` when there is one. Read when the channel is opened."""
    return grpc.ssl_channel_credentials(
        root_certificates=files.read(files.ca),
        private_key=files.read(files.key),
        certificate_chain=files.read(files.cert),
    )


def _server_context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    assert files.cert is not None
    context.load_cert_chain(files.cert, files.key)
    if files.ca is not None:
        context.load_verify_locations(cafile=str(files.ca))
    context.verify_mode = ssl.CERT_REQUIRED if files.client_auth else ssl.CERT_NONE
    # No session tickets: a data stream is one long connection, and a ticket is a write that the
    # receiving side would make (gradps/auth/tls_socket.py keeps one side to each direction).
    context.num_tickets = 0
    return context


class ServerContexts:
    """The `ssl` context a data port wraps each new connection with, rebuilt when the files change."""

    def __init__(self, files: TlsFiles) -> None:
        if files.cert is None:
            raise TlsError("a TLS server needs --tls-cert and --tls-key")
        self._reloading = _Reloading(files, _server_context)

    def current(self) -> ssl.SSLContext:
        self._reloading.changed()
        value = self._reloading.value
        assert isinstance(value, ssl.SSLContext)
        return value


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """The `ssl` context of a data stream's worker end: the server verified as a channel does."""
    context = ssl.create_default_context(cafile=str(files.ca) if files.ca else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if files.cert is not None:
        try:
            context.load_cert_chain(files.cert, files.key)
        except (OSError, ssl.SSLError) as e:
            raise TlsError(f"TLS client certificate {files.cert}: {e}") from None
    return context


_lock = threading.Lock()
# A client's TLS by address (a LocalCluster's), and the process's own (a service's): before the environment.
_by_address: dict[str, TlsFiles | None] = {}
_process_tls: TlsFiles | None = None


def remember(address: str, files: TlsFiles | None) -> None:
    """Channels opened in this process to `address` use TLS with `files` (None: plaintext, whatever
    the environment says: a local cluster's own services)."""
    with _lock:
        _by_address[address] = files


def forget(address: str) -> None:
    """Undo `remember`."""
    with _lock:
        _by_address.pop(address, None)


def set_process_tls(files: TlsFiles | None) -> None:
    """The TLS of this process's channels to addresses that have none remembered (a service's
    calls to the other services, with its own certificate as the client's)."""
    global _process_tls
    with _lock:
        _process_tls = files


def client_tls(address: str) -> TlsFiles | None:
    """The TLS of a channel to `address`: remembered for it, else the process's, else from
    GRADPS_TLS_CA (with GRADPS_TLS_CERT and GRADPS_TLS_KEY for mTLS); None: plaintext."""
    with _lock:
        if address in _by_address:
            return _by_address[address]
        files = _process_tls
    if files is not None:
        return files
    ca = os.environ.get(TLS_CA_ENV, "").strip()
    if not ca:
        return None
    return tls_files(os.environ.get(TLS_CERT_ENV, "").strip(), os.environ.get(TLS_KEY_ENV, "").strip(), ca)
