"""Who may call what: bearer tokens with roles, checked by one server interceptor.

A cluster has one secret, which only the coordinator and the shards hold. Every token is derived
from it: `gradps1.<subject>.<HMAC-SHA256(secret, subject)>`, where the subject is a role (`admin`,
`shard`, `worker`) or one worker (`worker-7`). Any service that knows the secret checks any token
with one HMAC and no table, and the coordinator mints a worker's own token at JoinWorker without
telling anyone. A caller holds only its token, and a token grants only its role:

- `admin` (the CLI, the SDK, the coordinator towards the shards): every call.
- `shard`: RegisterShard and ShardHeartbeat.
- `worker`: JoinWorker only. Its answer carries, in the trailing metadata `gradps-worker-token`,
  the token of the worker id it was given, `worker-<id>`, which makes every other call a worker
  makes (heartbeat, assignment, placement, metrics; pull, push, rounds, segments, streams) and is
  refused PERMISSION_DENIED when a request names another worker id.

Tokens travel as `authorization: Bearer <token>` metadata on every call (`open_channel`), are
compared with `hmac.compare_digest` and never logged. Health checks (grpc.health.v1) stay open.
"""

from __future__ import annotations

import base64
import collections
import contextvars
import hashlib
import hmac
import ipaddress
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import grpc

from gradps.v1 import coordinator_pb2, shard_pb2

ADMIN, SHARD, WORKER = "admin", "shard", "worker"
ROLES = (ADMIN, SHARD, WORKER)
# In a Rule: the calls a worker makes with its own token (`worker-<id>`), as itself only.
OWN_WORKER = "worker-<id>"
# Where a client's token comes from when none is given; and a service's secret.
TOKEN_ENV, TOKEN_FILE_ENV = "GRADPS_TOKEN", "GRADPS_TOKEN_FILE"
SECRET_ENV, SECRET_FILE_ENV = "GRADPS_SECRET", "GRADPS_SECRET_FILE"
# The trailing metadata of JoinWorker that carries the joined worker's own token.
WORKER_TOKEN_KEY = "gradps-worker-token"
# A secret shorter than this is refused: tokens are only as strong as it is.
MIN_SECRET_CHARS = 16
_PREFIX = "gradps1"
_HEALTH = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class Caller:
    """Who a checked token speaks for: a role, and for a joined worker its id."""

    role: str
    worker_id: int | None = None


class ClusterSecret:
    """The secret every token derives from: mints tokens and checks them."""

    def __init__(self, secret: str) -> None:
        secret = secret.strip()
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the cluster secret has {len(secret)} characters; it needs at least {MIN_SECRET_CHARS}")
        self._key = secret.encode()

    def _mac(self, subject: str) -> str:
        digest = hmac.new(self._key, f"{_PREFIX}.{subject}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def token(self, role: str, worker_id: int | None = None) -> str:
        """The token of `role`, or of one worker when `worker_id` is given (role worker)."""
        if role not in ROLES or (worker_id is not None and role != WORKER):
            raise ValueError(f"no token for role {role!r}; roles: {', '.join(ROLES)}")
        subject = role if worker_id is None else f"{WORKER}-{worker_id}"
        return f"{_PREFIX}.{subject}.{self._mac(subject)}"

    def check(self, token: str) -> Caller | None:
        """The caller `token` speaks for; None for anything this secret did not mint."""
        prefix, _, rest = token.partition(".")
        subject, _, mac = rest.partition(".")
        caller = _subject(subject)
        if prefix != _PREFIX or caller is None:
            return None
        # Constant time: a wrong MAC takes as long however many of its characters are right.
        if not hmac.compare_digest(self._mac(subject).encode(), mac.encode("utf-8", "replace")):
            return None
        return caller


def _subject(subject: str) -> Caller | None:
    if subject in ROLES:
        return Caller(subject)
    name, _, number = subject.partition("-")
    if name == WORKER and number.isdigit() and len(number) <= 10 and number == str(int(number)):
        return Caller(WORKER, int(number))
    return None


# ---- which role may call what ---------------------------------------------------------------------

_COORDINATOR = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]
_SHARD_SERVICE = shard_pb2.DESCRIPTOR.services_by_name["ShardService"]
# Calls by role; admin may make every call. A new RPC must be placed here, or this module refuses
# to import (below): no call is left open by omission.
_SHARD_CALLS = {"RegisterShard", "ShardHeartbeat"}
_JOIN_CALLS = {"JoinWorker"}
_WORKER_CALLS = {
    "CoordinatorService": {"Heartbeat", "GetAssignment", "GetPlacement", "ReportMetrics"},
    "ShardService": {
        "RegisterTensors",
        "Pull",
        "Push",
        "PushPull",
        "MapSegment",
        "OpenStream",
        "GetStats",
        "GroupAverage",
    },
}
_ADMIN_CALLS = {
    "CoordinatorService": {
        "SubmitRun",
        "GetRun",
        "ListRuns",
        "StopRun",
        "DeleteRun",
        "WatchRun",
        "GetCluster",
        "ExportRun",
    },
    "ShardService": {"OpenRun", "CloseRun", "EndRun", "SetMembership"},
}


@dataclass(frozen=True)
class Rule:
    """Who may make one call, and where its requests name a worker id (protobuf field numbers
    from the request's top level; empty when they name none)."""

    roles: frozenset[str]
    worker_field: tuple[int, ...] = ()


def _worker_field(method: Any) -> tuple[int, ...]:
    fields = method.input_type.fields_by_name
    if "worker_id" in fields:
        return (fields["worker_id"].number,)
    if "metrics" in fields:  # ReportMetrics: the report names its worker
        return (fields["metrics"].number, fields["metrics"].message_type.fields_by_name["worker_id"].number)
    return ()


def _rules() -> dict[str, Rule]:
    rules: dict[str, Rule] = {}
    for service in (_COORDINATOR, _SHARD_SERVICE):
        for method in service.methods:
            name, path = method.name, f"/{service.full_name}/{method.name}"
            if name in _SHARD_CALLS and service is _COORDINATOR:
                rules[path] = Rule(frozenset({ADMIN, SHARD}))
            elif name in _JOIN_CALLS and service is _COORDINATOR:
                rules[path] = Rule(frozenset({ADMIN, WORKER}))
            elif name in _WORKER_CALLS[service.name]:
                rules[path] = Rule(frozenset({ADMIN, OWN_WORKER}), _worker_field(method))
            elif name in _ADMIN_CALLS[service.name]:
                rules[path] = Rule(frozenset({ADMIN}))
            else:
                raise ImportError(f"gradps.auth: RPC {path} has no role; place it in gradps/auth.py")
    return rules


RULES = _rules()


def allowed(rule: Rule, caller: Caller) -> bool:
    """Whether `caller` may make a call of `rule` (a worker's calls need its own token)."""
    if caller.role in rule.roles:
        return True
    return caller.role == WORKER and caller.worker_id is not None and OWN_WORKER in rule.roles


# ---- the server side ------------------------------------------------------------------------------

# The caller and the server's secret during a unary call's handler (JoinWorker mints with them).
_CALL: contextvars.ContextVar[tuple[Caller, ClusterSecret] | None] = contextvars.ContextVar("gradps_call", default=None)


def issue_worker_token(context: grpc.ServicerContext, worker_id: int) -> None:
    """In JoinWorker's handler: hand a caller that joined with the plain worker token the token of
    `worker_id` (trailing metadata WORKER_TOKEN_KEY). Nothing where the server checks no tokens,
    or the caller holds admin (which acts as any worker)."""
    call = _CALL.get()
    if call is None or call[0] != Caller(WORKER):
        return
    context.set_trailing_metadata(((WORKER_TOKEN_KEY, call[1].token(WORKER, worker_id)),))


def _bearer(context: grpc.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        result |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise ValueError("truncated varint")


def _raw_varint_field(message: bytes | bytearray | memoryview, number: int) -> int:
    """The top-level varint field `number` of an encoded message (0 when absent), read without
    parsing (or copying) the rest: a push's payload stays where it is."""
    buf, pos, value = memoryview(message), 0, 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            found, pos = _read_varint(buf, pos)
            if field == number:
                value = found  # the last occurrence wins, as in protobuf
        elif wire_type == 2:
            size, pos = _read_varint(buf, pos)
            pos += size
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"wire type {wire_type}")
    return value


def _named_worker(request: Any, path: tuple[int, ...]) -> int:
    if isinstance(request, bytes | bytearray | memoryview):  # the shard's bulk calls take raw bytes
        return _raw_varint_field(request, path[0])
    for number in path:
        request = getattr(request, request.DESCRIPTOR.fields_by_number[number].name)
    return int(request)


class AuthInterceptor(grpc.ServerInterceptor):
    """Admits a call only with a token of a role that may make it; health checks stay open."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._secret = secret

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(_HEALTH):
            return handler
        rule = RULES.get(details.method, Rule(frozenset({ADMIN})))  # another service's call: admin's
        wrapped = {}
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            if (behaviour := getattr(handler, kind)) is not None:
                wrapped[kind] = self._guard(behaviour, rule, kind.startswith("stream"), kind.endswith("stream"))
        return handler._replace(**wrapped)

    def _admit(self, rule: Rule, context: grpc.ServicerContext) -> Caller:
        token = _bearer(context)
        if not token:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call needs a token: authorization: Bearer <token>")
        caller = self._secret.check(token or "")
        if caller is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "the token is not valid for this cluster")
        assert caller is not None  # abort raised otherwise
        if not allowed(rule, caller):
            why = "join first: only JoinWorker takes the plain worker token" if caller == Caller(WORKER) else ""
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why or f"a {_shown(caller)} token may not make this call")
        return caller

    def _check_worker(self, rule: Rule, caller: Caller, request: Any, context: grpc.ServicerContext) -> None:
        if caller.worker_id is None or not rule.worker_field:
            return
        try:
            named = _named_worker(request, rule.worker_field)
        except (ValueError, AttributeError, KeyError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a request that is not valid protobuf encoding")
        if named != caller.worker_id:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this token acts as worker {caller.worker_id}, not as worker {named}",
            )

    def _guard(
        self, behaviour: Callable[..., Any], rule: Rule, streams_in: bool, streams_out: bool
    ) -> Callable[..., Any]:
        def checked(messages: Iterator[Any], caller: Caller, context: grpc.ServicerContext) -> Iterator[Any]:
            for message in messages:
                self._check_worker(rule, caller, message, context)
                yield message

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            caller = self._admit(rule, context)
            if streams_in:
                request = checked(request, caller, context)
            else:
                self._check_worker(rule, caller, request, context)
            if streams_out:
                return behaviour(request, context)  # a generator: runs after this returns
            reset = _CALL.set((caller, self._secret))
            try:
                return behaviour(request, context)
            finally:
                _CALL.reset(reset)

        return call


def _shown(caller: Caller) -> str:
    return caller.role if caller.worker_id is None else f"worker-{caller.worker_id}"


# ---- the client side ------------------------------------------------------------------------------

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


# ---- a service's options --------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or "": every interface, for all we know


def secret_options(fn: Callable) -> Callable:
    """A server's `--secret-file` (GRADPS_SECRET_FILE), `--secret` (GRADPS_SECRET) and `--insecure`."""
    fn = click.option(
        "--insecure",
        envvar="GRADPS_INSECURE",
        show_envvar=True,
        is_flag=True,
        help="Serve a non-loopback --bind without a cluster secret: every call from the network accepted.",
    )(fn)
    fn = click.option(
        "--secret",
        envvar=SECRET_ENV,
        show_envvar=True,
        default=None,
        show_default=False,
        help="The cluster secret that every token derives from (set the variable: a flag's value shows in ps).",
    )(fn)
    return click.option(
        "--secret-file",
        envvar=SECRET_FILE_ENV,
        show_envvar=True,
        default=None,
        help="File holding the cluster secret (mode 0600).",
    )(fn)


def server_secret(secret: str | None, secret_file: str | None, bind: str, insecure: bool) -> ClusterSecret | None:
    """The secret a service checks tokens with, from its options; click.UsageError (one line) when
    it cannot be read, or when a non-loopback bind has none and --insecure was not given."""
    try:
        text = secret or (read_token_file(secret_file) if secret_file else None)
        cluster = ClusterSecret(text) if text else None
    except ValueError as e:
        raise click.UsageError(f"cluster secret: {e}") from None
    if cluster is None and not insecure and not is_loopback(bind):
        raise click.UsageError(
            f"refusing to serve on {bind} without a cluster secret (GRADPS_SECRET or --secret-file); "
            "--insecure to accept every call from the network"
        )
    return cluster


def allow_import_option(fn: Callable) -> Callable:
    """`--allow-import PREFIX` (repeatable; GRADPS_ALLOW_IMPORT, space-separated): the import paths
    of models and datasets that runs may name (gradps.datasets.check_import_allowed)."""
    return click.option(
        "--allow-import",
        envvar="GRADPS_ALLOW_IMPORT",
        show_envvar=True,
        multiple=True,
        help="A package or module (or one package.module:function) whose models and datasets runs may "
        "import; repeatable. Default: none, only the built-in models and datasets.",
    )(fn)


def token_options(fn: Callable) -> Callable:
    """A client's `--token-file` (GRADPS_TOKEN_FILE) and `--token` (GRADPS_TOKEN)."""
    fn = click.option(
        "--token",
        envvar=TOKEN_ENV,
        show_envvar=True,
        default=None,
        show_default=False,
        help="Bearer token for the cluster's calls (set the variable: a flag's value shows in ps).",
    )(fn)
    return click.option(
        "--token-file", envvar=TOKEN_FILE_ENV, show_envvar=True, default=None, help="File holding the bearer token."
    )(fn)


def option_token(token: str | None, token_file: str | None) -> str | None:
    """The token `token_options` name (None: none given); click.UsageError when the file cannot be read."""
    if token and token.strip():
        return token.strip()
    if not token_file:
        return None
    try:
        return read_token_file(token_file)
    except ValueError as e:
        raise click.UsageError(f"--token-file: {e}") from None


def write_private_file(path: str | os.PathLike, text: str) -> None:
    """Write a secret or token to a new file that only this user can read (mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
