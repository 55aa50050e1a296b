"""Domain errors, raised anywhere in a service and turned into gRPC status codes in one place.

A handler or any helper below it raises one of these with a one-line message; the server
interceptor that `gradps.channel.make_server` installs (`StatusInterceptor`) ends the call with
the error's status code and that message. Nothing below a servicer takes the gRPC context to
refuse a request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc


class GradpsError(Exception):
    """A request refused, with the status code it earns."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def trailers(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata the refusal carries for a program to read (none by default)."""
        return ()


class Invalid(GradpsError):
    """The request is malformed or contradicts what it refers to (shape, dtype, codec, bounds)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(GradpsError):
    """An unknown run, part, worker or shard."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(GradpsError):
    """Something with this id exists already, and differs from what the request would make."""

    code = grpc.StatusCode.ALREADY_EXISTS


class NotNow(GradpsError):
    """Well formed, but not acceptable in the current state (a step ahead, a busy data stream,
    the wrong scheme for the call)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Ended(NotNow):
    """The run ended or was closed: no more pushes, pulls or rounds."""


class PermissionDenied(GradpsError):
    """The caller may not ask for this (an import path the operator did not allow)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class TooLarge(GradpsError):
    """A size or count beyond a limit, or memory that cannot be allocated."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OutOfRange(GradpsError):
    """Values that do not fit what the caller asked for (a pull codec's range)."""

    code = grpc.StatusCode.OUT_OF_RANGE


class TimedOut(GradpsError):
    """What the call waited for did not happen before its wait or deadline ended."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(GradpsError):
    """The client went away while the call waited."""

    code = grpc.StatusCode.CANCELLED


class Unavailable(GradpsError):
    """A service the request needs (a shard, for the coordinator) did not answer."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLost(GradpsError):
    """A payload's bytes did not arrive on the call's data stream; the client sends them again inline."""

    code = grpc.StatusCode.DATA_LOSS


# Unmapped's trailing metadata: the segment's name.
UNMAPPED_KEY = "gradps-unmapped"


class Unmapped(NotNow):
    """A call names a shared-memory segment the shard has not mapped for the worker (a shard
    that restarted has none): the worker maps one again (ShardService.MapSegment)."""

    def __init__(self, segment: str, worker_id: int) -> None:
        super().__init__(f"segment {segment!r} is not mapped for worker {worker_id} in the run")
        self.segment = segment

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return ((UNMAPPED_KEY, self.segment),)

    @staticmethod
    def told(e: grpc.RpcError) -> bool:
        """Whether a FAILED_PRECONDITION answer says a segment is not mapped."""
        return e.code() == Unmapped.code and any(key == UNMAPPED_KEY for key, _ in e.trailing_metadata() or ())


# RolledBack's trailing metadata: "<restore epoch>,<step>".
ROLLED_BACK_KEY = "gradps-rolled-back"


class RolledBack(GradpsError):
    """A shard of the run restarted and the run went back to a consistent checkpoint: the
    caller goes on from `step`, calling with restore epoch `epoch` (ShardService.RestoreRun)."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, run_id: str, epoch: int, step: int) -> None:
        super().__init__(f"run {run_id!r} went back to step {step} (restore epoch {epoch}): go on from there")
        self.epoch = epoch
        self.step = step

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return ((ROLLED_BACK_KEY, f"{self.epoch},{self.step}"),)

    @classmethod
    def of(cls, e: grpc.RpcError, run_id: str) -> RolledBack | None:
        """The rollback an ABORTED answer tells of (None for any other answer)."""
        if e.code() != grpc.StatusCode.ABORTED:
            return None
        for key, value in e.trailing_metadata() or ():
            epoch, _, step = str(value).partition(",")
            if key == ROLLED_BACK_KEY and epoch.isdigit() and step.isdigit():
                return cls(run_id, int(epoch), int(step))
        return None


def one_line(e: BaseException) -> str:
    """An exception's message as one line (torch's and others' may span several)."""
    return " ".join(str(e).split()) or type(e).__name__


def _abort(context: grpc.ServicerContext, e: GradpsError) -> None:
    if trailers := e.trailers():
        context.set_trailing_metadata(trailers)
    context.abort(e.code, one_line(e))


def _unary(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behaviour(request, context)
        except GradpsError as e:
            _abort(context, e)

    return call


def _streaming(behaviour: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behaviour(request, context)
        except GradpsError as e:
            _abort(context, e)

    return call


class StatusInterceptor(grpc.ServerInterceptor):
    """Ends a call whose handler raised a GradpsError with the error's code and message."""

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        wrapped = {}
        for kind in ("unary_unary", "stream_unary"):
            if (behaviour := getattr(handler, kind)) is not None:
                wrapped[kind] = _unary(behaviour)
        for kind in ("unary_stream", "stream_stream"):
            if (behaviour := getattr(handler, kind)) is not None:
                wrapped[kind] = _streaming(behaviour)
        return handler._replace(**wrapped)


__all__ = [
    "AlreadyExists",
    "Cancelled",
    "DataLost",
    "Ended",
    "GradpsError",
    "Invalid",
    "NotFound",
    "NotNow",
    "OutOfRange",
    "PermissionDenied",
    "ROLLED_BACK_KEY",
    "RolledBack",
    "StatusInterceptor",
    "TimedOut",
    "TooLarge",
    "UNMAPPED_KEY",
    "Unavailable",
    "Unmapped",
    "one_line",
]
