"""Which role may call what, and the one server interceptor that checks every call."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from gradps.auth.tokens import ADMIN, OWN_WORKER, SHARD, WORKER, WORKER_TOKEN_KEY, Caller, ClusterSecret
from gradps.v1 import coordinator_pb2, shard_pb2

_HEALTH = "/grpc.health.v1.Health/"

_COORDINATOR = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]
_SHARD_SERVICE = shard_pb2.DESCRIPTOR.services_by_name["ShardService"]
# Calls by role; admin may make every call. A new RPC must be placed here, or this module refuses
# to import (below): no call is left open by omission.
_SHARD_CALLS = {"RegisterShard", "ShardHeartbeat"}
_JOIN_CALLS = {"JoinWorker"}
_WORKER_CALLS = {
    "CoordinatorService": {"Heartbeat", "LeaveWorker", "GetAssignment", "GetPlacement", "ReportMetrics"},
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
# Calls whose worker_id may be left out (0) by a client that predates it: not bound to the token
# by the interceptor; the handler takes the token's worker where there is one.
_OPTIONAL_WORKER_ID = {"GetPlacement"}
_ADMIN_CALLS = {
    "CoordinatorService": {
        "SubmitRun",
        "GetRun",
        "ListRuns",
        "StopRun",
        "ResumeRun",
        "DeleteRun",
        "WatchRun",
        "GetCluster",
        "ExportRun",
        "TakeCheckpoint",
        "ListRunCheckpoints",
        "ScaleRun",
    },
    "ShardService": {
        "OpenRun",
        "CloseRun",
        "EndRun",
        "SetMembership",
        "CheckpointRun",
        "ListCheckpoints",
        "ReadCheckpoint",
        "RestoreRun",
    },
}


@dataclass(frozen=True)
class Rule:
    """Who may make one call, and where its requests name a worker id (protobuf field numbers
    from the request's top level; empty when they name none)."""

    roles: frozenset[str]
    worker_field: tuple[int, ...] = ()


def _worker_field(method: Any) -> tuple[int, ...]:
    fields = method.input_type.fields_by_name
    if method.name in _OPTIONAL_WORKER_ID:
        return ()
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
                raise ImportError(f"gradps.auth: RPC {path} has no role; place it in gradps/auth/access.py")
    return rules


RULES = _rules()


def allowed(rule: Rule, caller: Caller) -> bool:
    """Whether `caller` may make a call of `rule` (a worker's calls need its own token)."""
    if caller.role in rule.roles:
        return True
    return caller.role == WORKER and caller.worker_id is not None and OWN_WORKER in rule.roles


# ---- the server side ------------------------------------------------------------------------------

# The caller and the server's secret while a call's handler runs (JoinWorker mints with them; a
# handler asks `acting_worker` which runs the caller may touch).
_CALL: contextvars.ContextVar[tuple[Caller, ClusterSecret] | None] = contextvars.ContextVar("gradps_call", default=None)


def current_caller() -> Caller | None:
    """In a handler: who the call's token speaks for; None where the server checks no tokens."""
    call = _CALL.get()
    return None if call is None else call[0]


def acting_worker() -> int | None:
    """In a handler: the worker id the call's own worker token is bound to; None for an admin
    call, or where the server checks no tokens. A handler refuses such a worker any run it is not
    a member of (PERMISSION_DENIED), whatever the request names."""
    caller = current_caller()
    return None if caller is None else caller.worker_id


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
            if streams_out:  # a generator: runs after this returns
                return _as_caller(behaviour(request, context), (caller, self._secret))
            reset = _CALL.set((caller, self._secret))
            try:
                return behaviour(request, context)
            finally:
                _CALL.reset(reset)

        return call


def _as_caller(answers: Iterator[Any], call: tuple[Caller, ClusterSecret]) -> Iterator[Any]:
    """A streamed answer, made with `call` as the current caller (gRPC runs each call in a
    contextvars.Context of its own, and iterates its answer in one thread to its end)."""
    _CALL.set(call)
    try:
        yield from answers
    finally:
        _CALL.set(None)


def _shown(caller: Caller) -> str:
    return caller.role if caller.worker_id is None else f"worker-{caller.worker_id}"
