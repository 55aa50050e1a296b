"""A client's token: where a channel finds it when given none, the per-user store local clusters
leave theirs in, and the interceptor that sends it with every call."""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from gradps.auth.tokens import TOKEN_ENV, TOKEN_FILE_ENV

TokenSource = str | Callable[[], str | None] | None

_lock = threading.Lock()
# Tokens by address (a LocalCluster's, a joined worker's for its shards), and the process's own
# (a service's, derived from its secret): before the environment.
_by_address: dict[str, str] = {}
_process_token: str | None = None


def remember(address: str, token: str) -> None:
    """Channels opened in this process to `address` without a token of their own send `token`."""
    with _lock:
        _by_address[address] = token


def forget(address: str) -> None:
    """Undo `remember`."""
    with _lock:
        _by_address.pop(address, None)


def set_process_token(token: str | None) -> None:
    """The token of this process's channels that name none and whose address has none remembered."""
    global _process_token
    with _lock:
        _process_token = token


def read_token_file(path: str | os.PathLike) -> str:
    """A token (or secret) file's content, stripped; ValueError when it cannot be read or is empty."""
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    if not text:
        raise ValueError(f"{path} is empty")
    return text


def client_token(address: str) -> str | None:
    """The token a channel to `address` sends when it is given none: remembered for the address,
    else the process's, else GRADPS_TOKEN, else the file GRADPS_TOKEN_FILE names, else the one a
    local cluster of this user stored for the address (`store_token`); None: no token."""
    with _lock:
        token = _by_address.get(address) or _process_token
    if token:
        return token
    if token := os.environ.get(TOKEN_ENV, "").strip():
        return token
    if path := os.environ.get(TOKEN_FILE_ENV, "").strip():
        return read_token_file(path)
    return stored_token(address)


def token_store() -> Path:
    """Where local clusters leave their admin tokens by address, for this user's other commands
    (`gradps up` in one terminal, `gradps train --coordinator` in another): GRADPS_TOKEN_DIR, else
    $XDG_RUNTIME_DIR/gradps-tokens, else ~/.local/state/gradps/tokens."""
    if configured := os.environ.get("GRADPS_TOKEN_DIR"):
        return Path(configured)
    if runtime := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(runtime) / "gradps-tokens"
    return Path.home() / ".local" / "state" / "gradps" / "tokens"


def _stored_path(address: str) -> Path:
    return token_store() / ("".join(c if c.isalnum() or c in ".-" else "_" for c in address) + ".token")


def store_token(address: str, token: str) -> None:
    """Leave `token` for `address` in the token store: a file only this user reads (0600, its
    folder 0700), replaced whole. OSError when it cannot be written."""
    path = _stored_path(address)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    write_private_file(tmp, token)
    os.replace(tmp, path)


def unstore_token(address: str) -> None:
    """Remove what `store_token` left for `address`."""
    try:
        _stored_path(address).unlink(missing_ok=True)
    except OSError:  # already unreadable to us: nothing of ours to take away
        pass


def stored_token(address: str) -> str | None:
    """The token stored for `address`; None when there is none, or its file or folder is open to
    other users (someone else could have put it there)."""
    path = _stored_path(address)
    try:
        for where in (path.parent, path):
            st = where.stat()
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                return None
        return read_token_file(path)
    except (OSError, ValueError):
        return None


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call; the token is asked for per call, so a
    worker's channel carries its own token once it has joined."""

    def __init__(self, token: Callable[[], str | None]) -> None:
        self._token = token

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        token = self._token()
        if not token:
            return details
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {token}")]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    """A call's details with the token added (grpc's own type has no constructor)."""


def with_token(channel: grpc.Channel, token: TokenSource) -> grpc.Channel:
    """`channel` sending `token` (a string, or a function asked per call) with every call."""
    if token is None:
        return channel
    source = token if callable(token) else (lambda: token)
    return grpc.intercept_channel(channel, _Bearer(source))


def write_private_file(path: str | os.PathLike, text: str) -> None:
    """Write a secret or token to a new file that only this user can read (mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
