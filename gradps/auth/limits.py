"""How many calls one caller may have in flight at once, checked by a server interceptor beside
`gradps.auth.access.AuthInterceptor`: no caller takes every thread of a service's handler pool,
or fills its memory with waiting calls (a waiting call holds no thread, gradps.serving, but
counts until it ends). The limit is the service's `--max-calls-per-caller`, and at most half its
pool's threads (gradps.channel.make_server): the shards serve with 32 threads, the coordinator
with 64.

A caller is a joined worker (its own token: every connection of worker 7 counts as one caller),
else one connection (a role token that many processes share, such as every shard's, or no token
where the server checks none). JoinWorker (quick, and bounded by the coordinator's worker limit)
and health checks are not counted. A call beyond the limit is refused RESOURCE_EXHAUSTED, in one
line, before its handler runs; it changes nothing, and the caller may call again once one ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import click
import grpc

from gradps.auth.access import current_caller

# At most this many calls of one caller at once, unless the service says otherwise (and never
# more than half its threads): a worker has a handful (heartbeat, assignment poll, a pull and a
# push per shard, a data stream's setup).
DEFAULT_MAX_CALLS_PER_CALLER = 64
MAX_CALLS_ENV = "GRADPS_MAX_CALLS_PER_CALLER"
_UNCOUNTED = ("/grpc.health.v1.Health/", "/gradps.v1.CoordinatorService/JoinWorker")


def max_calls_option(fn: Callable) -> Callable:
    """A service's `--max-calls-per-caller` (GRADPS_MAX_CALLS_PER_CALLER)."""
    return click.option(
        "--max-calls-per-caller",
        envvar=MAX_CALLS_ENV,
        show_envvar=True,
        default=DEFAULT_MAX_CALLS_PER_CALLER,
        show_default=True,
        type=click.IntRange(1, 1_000_000),
        help="Calls one caller (a worker, or one connection) may have in flight at once, at most half the service's "
        "threads; beyond: RESOURCE_EXHAUSTED.",
    )(fn)


class CallLimitInterceptor(grpc.ServerInterceptor):
    """Refuses a caller's call while `limit` of its calls are in flight. Placed inside the
    AuthInterceptor, it counts a worker by the id its checked token is bound to."""

    def __init__(self, limit: int = DEFAULT_MAX_CALLS_PER_CALLER) -> None:
        if limit < 1:
            raise ValueError(f"max calls per caller must be at least 1, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}

    def in_flight(self) -> dict[str, int]:
        """Calls in flight by caller (a copy)."""
        with self._lock:
            return dict(self._in_flight)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(_UNCOUNTED):
            return handler
        wrapped = {}
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            if (behaviour := getattr(handler, kind)) is not None:
                wrapped[kind] = self._streamed(behaviour) if kind.endswith("stream") else self._counted(behaviour)
        return handler._replace(**wrapped)

    def _enter(self, context: grpc.ServicerContext) -> str:
        key = _caller_key(context)
        with self._lock:
            held = self._in_flight.get(key, 0)
            admitted = held < self.limit
            if admitted:
                self._in_flight[key] = held + 1
        if not admitted:  # abort raises: the handler never runs, and nothing was counted
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{key} has {held} calls in flight, the most one caller may (--max-calls-per-caller); "
                "call again once one ends",
            )
        return key

    def _leave(self, key: str) -> None:
        with self._lock:
            held = self._in_flight[key] - 1
            if held:
                self._in_flight[key] = held
            else:
                del self._in_flight[key]

    def _counted(self, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            key = self._enter(context)
            try:
                return behaviour(request, context)
            finally:
                self._leave(key)

        return call

    def _streamed(self, behaviour: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            # Counted from its first answer's making to its stream's end (or the client's cancel,
            # when gRPC drops the generator).
            key = self._enter(context)
            try:
                yield from behaviour(request, context)
            finally:
                self._leave(key)

        return call


def _caller_key(context: grpc.ServicerContext) -> str:
    """Who a call counts for: `worker <id>` for a worker's own token, else its connection."""
    caller = current_caller()
    if caller is not None and caller.worker_id is not None:
        return f"worker {caller.worker_id}"
    role = f"{caller.role} " if caller is not None else ""
    return f"{role}connection {context.peer()}"
