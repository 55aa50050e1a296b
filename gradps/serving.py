"""The gRPC server every gradps service runs: `grpc.aio` on an event loop of its own, in front of
plain handlers.

A call that waits (a pull for its step, a wagma round, a long-polled assignment, a WatchRun
stream) must not hold an OS thread while it waits, or a few dozen of them take every thread and
the call they wait for queues behind them. Handlers stay plain functions (their work is CPU-bound:
decode, update, encode) and run with the sync interceptors (`grpc.ServerInterceptor`: metrics,
auth, call limits, status) on a bounded pool; only waiting moves to the event loop. A handler that
waits is a generator: where it would block it yields from `parked(cond, ready, timeout_s)`, which
frees its thread until the notifier of `cond` (a `ParkCondition`) finds `ready()` true, the time
is up or the call ended; then it goes on, on whichever pool thread is free. A unary method that
waits yields its one response. Health checks are answered on the event loop itself, so they are
answered however busy the pool is.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc

# How often a parked call looks whether it ended (the client cancelled, its deadline passed).
_PARK_SLICE_S = 0.25
# Answered on the event loop: quick, and a probe must be answered while every pool thread works.
_INLINE = frozenset({"/grpc.health.v1.Health/Check"})
_DONE = object()
# Answers a streaming handler may have made and not yet had sent.
_HELD = 2


class Park:
    """What a waiting handler yields (made by `parked`): wait, holding no thread, until its
    condition's notifier finds `ready()` true (or raising), `timeout_s` passed, or the call
    ended. The handler then looks again itself: being woken promises nothing."""

    __slots__ = ("event", "ready", "timeout_s")

    def __init__(self, ready: Callable[[], bool], timeout_s: float) -> None:
        self.ready, self.timeout_s = ready, timeout_s
        self.event = asyncio.Event()  # bound to the event loop when it first waits on it

    def settled(self) -> bool:
        try:
            return bool(self.ready())
        except Exception:  # the handler meets the error when it looks
            return True


class ParkCondition(threading.Condition):
    """A `threading.Condition` whose notify also wakes the calls parked on it whose condition
    now holds: the notifier looks for them, under the lock it holds, so a parked call never
    wakes to find it taken, and the event loop never takes it. Calls parked with the same key
    wait for the same thing and are looked at once: a notify costs one look per distinct wait,
    not one per call (a sync step's hundreds of pulls wait for one version)."""

    def __init__(self) -> None:
        super().__init__()
        self._parked: dict[object, set[Park]] = {}  # guarded by the condition's own lock

    def notify(self, n: int = 1) -> None:
        super().notify(n)
        self._wake_parked()

    def notify_all(self) -> None:
        super().notify_all()
        self._wake_parked()

    def _wake_parked(self) -> None:
        woken: list[asyncio.Event] = []
        for key, parks in list(self._parked.items()):
            if next(iter(parks)).settled():
                woken += (park.event for park in parks)
                del self._parked[key]
        if woken:
            _event_loop().call_soon_threadsafe(_set_each, woken)

    def _park(self, park: Park, key: object) -> None:
        self._parked.setdefault(park if key is None else key, set()).add(park)

    def _unpark(self, park: Park, key: object) -> None:
        key = park if key is None else key
        if (parks := self._parked.get(key)) is not None:
            parks.discard(park)
            if not parks:
                del self._parked[key]


def parked(cond: ParkCondition, ready: Callable[[], bool], timeout_s: float, key: object = None) -> Iterator[Park]:
    """For a generator handler, which must not hold `cond` here: unless `ready()` holds now
    (looked at under `cond`), wait for it, holding no thread, for at most `timeout_s`. The
    handler looks again after (under `cond`): the wait may have ended for another reason.
    `key`: calls whose `ready` is the same test give the same key (hashable), and are looked
    at once per notify."""
    with cond:
        if ready():
            return
        park = Park(ready, timeout_s)
        cond._park(park, key)  # under the lock: no notify between the look and here is missed
    try:
        yield park
    finally:
        with cond:
            cond._unpark(park, key)


def _set_each(events: Iterable[asyncio.Event]) -> None:
    for event in events:
        event.set()


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for its gRPC servers, on a daemon thread started on first use."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="grpc-aio", daemon=True).start()
            _LOOP = loop
        return _LOOP


def _on_loop(fn: Callable[[], Any]) -> Any:
    """`fn()` run on the event loop's thread, its result or exception returned here."""

    async def run() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(run(), _event_loop()).result()


class _Aborted(Exception):
    """A handler called `abort`: the bridge ends the call with the code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class SyncContext:
    """The `grpc.ServicerContext` a plain handler sees, over the aio call's context."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._code: grpc.StatusCode | None = None
        # Set by the bridge when the call is cancelled (the client cancelled, went away, or its
        # deadline passed): the aio context says so only once the handler has returned.
        self.ended = False

    def is_active(self) -> bool:
        return not (self.ended or self._context.done())

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        raise _Aborted(code, details)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code
        self._context.set_code(code)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self._context.add_done_callback(lambda _: callback())
        return True

    def __getattr__(self, name: str) -> Any:  # invocation_metadata, peer, auth_context, ...
        return getattr(self._context, name)


class _Requests:
    """The aio call's request stream as a plain iterator, for a handler on the pool, read ahead
    on the event loop by at most `_HELD` messages: the handler decodes one while the next
    arrives, and takes each without a hop to the loop. A stream that fails (the call was
    cancelled) ends: the handler then finds its call inactive."""

    def __init__(self, requests: AsyncIterator[Any]) -> None:
        self._loop = asyncio.get_running_loop()
        self._messages: queue.Queue[Any] = queue.Queue()
        self._room = asyncio.Semaphore(_HELD)
        self._reading = self._loop.create_task(self._read(requests))

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for message in requests:
                await self._room.acquire()
                self._messages.put(message)
        except Exception:  # the call failed: the stream ends here
            pass
        finally:
            self._messages.put(_DONE)

    def __iter__(self) -> _Requests:
        return self

    def __next__(self) -> Any:
        message = self._messages.get()
        if message is _DONE:
            self._messages.put(_DONE)  # for a handler that asks again
            raise StopIteration
        self._loop.call_soon_threadsafe(self._room.release)
        return message

    def close(self) -> None:
        """On the event loop, when the call ended: a handler still reading sees the stream end."""
        self._reading.cancel()


async def _wait_parked(park: Park, context: grpc.aio.ServicerContext) -> None:
    """Until `park` is woken, its time passed, or the call ended."""
    end = time.monotonic() + park.timeout_s
    while not context.done():
        left = end - time.monotonic()
        remaining = context.time_remaining()
        if remaining is not None:
            left = min(left, remaining)
        if left <= 0:
            return
        try:
            await asyncio.wait_for(park.event.wait(), min(left, _PARK_SLICE_S))
            return
        except TimeoutError:
            pass


class _Handoff:
    """Answers going from a handler's pool thread to the event loop that sends them, at most
    `_HELD` at a time: a handler runs ahead of the network by no more than that."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sync: SyncContext) -> None:
        self._loop, self._sync = loop, sync
        self._answers: queue.Queue[Any] = queue.Queue(maxsize=_HELD)
        self._waiting: asyncio.Future[None] | None = None
        self.outcome: Any = None

    def run(self, answers: Iterator[Any]) -> Any:
        """On the pool: `answers` to its next park (the Park), its end (_DONE), or until the
        call ended with an answer still to hand over (None)."""
        while True:
            answer = next(answers, _DONE)
            if answer is _DONE or isinstance(answer, Park):
                return answer
            while True:
                try:
                    self._answers.put(answer, timeout=_PARK_SLICE_S)
                    break
                except queue.Full:
                    if not self._sync.is_active():
                        return None
            self._loop.call_soon_threadsafe(self.wake)

    def wake(self, *_: Any) -> None:
        """On the event loop: an answer was handed over, or the handler's segment ended."""
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_result(None)

    async def taken(self, segment: asyncio.Future[Any]) -> list[Any]:
        """The answers handed over so far, once there are some or `segment` ended (which must
        call `wake` when it does)."""
        while True:
            answers = self.drain()
            if answers or segment.done():
                return answers
            # An answer handed over from here on wakes this: its wake runs after this awaits.
            self._waiting = self._loop.create_future()
            await self._waiting

    def drain(self) -> list[Any]:
        answers = []
        while True:
            try:
                answers.append(self._answers.get_nowait())
            except queue.Empty:
                return answers


class _Call:
    """One call of a plain (or generator) handler, driven from the event loop."""

    def __init__(self, pool: futures.Executor, context: grpc.aio.ServicerContext) -> None:
        self.loop = asyncio.get_running_loop()
        self.pool = pool
        self.context = context
        self.sync = SyncContext(context)
        # One contextvars.Context for the whole call, as the threaded server gives each call.
        self.vars = contextvars.copy_context()
        self.segment: asyncio.Future[Any] | None = None

    def step(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        return self.loop.run_in_executor(self.pool, self.vars.run, fn, *args)

    async def ending(self, error: _Aborted) -> None:
        await self.context.abort(error.code, error.details)

    async def unary(self, behaviour: Callable[..., Any], request: Any) -> Any:
        try:
            return await self.step(behaviour, request, self.sync)
        except _Aborted as e:
            await self.ending(e)
        except asyncio.CancelledError:
            self.sync.ended = True  # the handler, still on its thread, sees its call inactive
            raise
        finally:
            if isinstance(request, _Requests):
                request.close()

    async def stream(self, behaviour: Callable[..., Iterator[Any]], request: Any) -> AsyncIterator[Any]:
        """The answers of a generator handler. It runs on one pool thread from park to park (a
        handler may hold a lock between two answers, never across a park), handing each answer
        over to be sent; at a park it gives its thread back until woken."""
        try:
            answers = self.vars.run(behaviour, request, self.sync)
        except _Aborted as e:
            await self.ending(e)
            return
        handoff = _Handoff(self.loop, self.sync)
        finished = False
        try:
            while True:
                async for answer in self._segment(handoff, answers):
                    yield answer
                if handoff.outcome is _DONE:
                    finished = True
                    return
                if not isinstance(handoff.outcome, Park):  # the call ended with an answer unsent
                    return
                await _wait_parked(handoff.outcome, self.context)
        except _Aborted as e:
            finished = True
            await self.ending(e)
        except asyncio.CancelledError:
            self.sync.ended = True
            raise
        finally:
            if isinstance(request, _Requests):
                request.close()
            if not finished:  # cancelled, or the client went away: the handler's clean-up runs now
                await self._close(handoff, answers)

    async def _segment(self, handoff: _Handoff, answers: Iterator[Any]) -> AsyncIterator[Any]:
        """One run of the handler on the pool, to its next park or its end: its answers as they
        come, then its outcome in `handoff.outcome`."""
        self.segment = self.step(handoff.run, answers)
        self.segment.add_done_callback(handoff.wake)
        while not self.segment.done():
            for answer in await handoff.taken(self.segment):
                yield answer
        for answer in handoff.drain():
            yield answer
        handoff.outcome = self.segment.result()

    async def _close(self, handoff: _Handoff, answers: Iterator[Any]) -> None:
        self.sync.ended = True
        if self.segment is not None:
            await asyncio.wait([self.segment])  # the thread sees the call ended, and stops
        if (close := getattr(answers, "close", None)) is not None:
            await self.step(close)

    async def last(self, behaviour: Callable[..., Iterator[Any]], request: Any) -> Any:
        """A unary method written as a generator: its one answer, after its parks."""
        answers = [answer async for answer in self.stream(behaviour, request)]
        return answers[-1] if answers else None


def _bridged(handler: grpc.RpcMethodHandler, pool: futures.Executor, unary_generator: bool) -> grpc.RpcMethodHandler:
    """`handler` (plain behaviours, already intercepted) as the aio server runs it."""
    kind, behaviour = next((k, b) for k in _KINDS if (b := getattr(handler, k)) is not None)
    streams_in = kind.startswith("stream")

    def requests(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return _Requests(request) if streams_in else request

    if kind.endswith("stream") and not unary_generator:

        async def streamed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for answer in _Call(pool, context).stream(behaviour, requests(request, context)):
                yield answer

        bridged: Callable[..., Any] = streamed
    elif unary_generator:

        async def parked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await _Call(pool, context).last(behaviour, requests(request, context))

        bridged = parked
    else:

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await _Call(pool, context).unary(behaviour, requests(request, context))

        bridged = unary
    out_kind = kind if not unary_generator else ("stream_unary" if streams_in else "unary_unary")
    fields: dict[str, Callable[..., Any] | None] = {k: None for k in _KINDS}
    fields[out_kind] = bridged
    return handler._replace(response_streaming=out_kind.endswith("stream"), **fields)


def _inline(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A quick unary handler answered on the event loop."""
    behaviour = handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return behaviour(request, SyncContext(context))
        except _Aborted as e:
            await context.abort(e.code, e.details)

    return handler._replace(unary_unary=unary)


_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class _Bridge(grpc.GenericRpcHandler):
    """The aio server's one handler: finds the plain handler, runs the interceptors over it as
    the threaded server would, and hands the aio server its bridged form."""

    def __init__(self, interceptors: Sequence[grpc.ServerInterceptor], pool: futures.Executor) -> None:
        self._interceptors = tuple(interceptors)
        self._pool = pool
        self.generic: list[grpc.GenericRpcHandler] = []
        self.registered: dict[str, grpc.RpcMethodHandler] = {}

    def _find(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if (handler := self.registered.get(details.method)) is not None:
            return handler
        for generic in self.generic:
            if (handler := generic.service(details)) is not None:
                return handler
        return None

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        found = self._find(handler_call_details)
        if found is None:
            return None
        # A unary method that parks is a generator: the interceptors see it as the stream it is.
        unary_generator = found.unary_unary is not None and inspect.isgeneratorfunction(found.unary_unary)
        unary_generator |= found.stream_unary is not None and inspect.isgeneratorfunction(found.stream_unary)
        if unary_generator:
            streams_in = found.stream_unary is not None
            found = found._replace(
                unary_unary=None,
                stream_unary=None,
                response_streaming=True,
                **{"stream_stream" if streams_in else "unary_stream": found.stream_unary or found.unary_unary},
            )

        def chain(index: int, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if index == len(self._interceptors):
                return found
            return self._interceptors[index].intercept_service(lambda d: chain(index + 1, d), details)

        handler = chain(0, handler_call_details)
        if handler is None:
            return None
        if handler_call_details.method in _INLINE and handler.unary_unary is not None:
            return _inline(handler)
        return _bridged(handler, self._pool, unary_generator)


class _Stopped:
    """What `Server.stop` returns: `wait()` blocks until the server stopped, as grpc's event."""

    def __init__(self, done: futures.Future[Any]) -> None:
        self._done = done

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._done.result(timeout)
        except futures.TimeoutError:
            return False
        return True


class Server:
    """A gRPC server with the threaded server's interface (register, bind, start, stop) whose
    waiting calls hold no thread: a `grpc.aio` server on the process's event loop, its plain
    handlers run on a pool of `max_workers` threads behind `interceptors`."""

    def __init__(
        self, max_workers: int, interceptors: Sequence[grpc.ServerInterceptor], options: Sequence[tuple[str, Any]]
    ) -> None:
        self._pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc-handler")
        self._bridge = _Bridge(interceptors, self._pool)
        self._server: grpc.aio.Server = _on_loop(lambda: grpc.aio.server(options=list(options)))
        self._server.add_generic_rpc_handlers((self._bridge,))

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._bridge.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in handlers.items():
            self._bridge.registered[f"/{service}/{name}"] = handler

    def add_insecure_port(self, address: str) -> int:
        return int(_on_loop(lambda: self._server.add_insecure_port(address)))

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return int(_on_loop(lambda: self._server.add_secure_port(address, credentials)))

    def start(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.start(), _event_loop()).result()

    def stop(self, grace: float | None) -> _Stopped:
        async def stop() -> None:
            await self._server.stop(grace)
            self._pool.shutdown(wait=False, cancel_futures=True)

        return _Stopped(asyncio.run_coroutine_threadsafe(stop(), _event_loop()))

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        done = asyncio.run_coroutine_threadsafe(self._server.wait_for_termination(timeout), _event_loop())
        return bool(done.result())


__all__ = ["Park", "ParkCondition", "Server", "SyncContext", "parked"]
