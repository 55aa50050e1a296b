"""Prometheus metrics: every series a gradps service exports, defined once, and how they are served.

Services record where the event happens: the shard in its handlers, the worker in its `Trainer`,
every gRPC server through `ServerMetricsInterceptor` (which `gradps.channel.make_server` installs
in a process that serves metrics); the coordinator's gauges are read from its state when
Prometheus scrapes (`watch_coordinator`).
Labels stay few and bounded: method, code, scheme, codec, transport, state; never a run or a step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import prometheus_client
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gradps.codec_table import codec_family
from gradps.serving import Park
from gradps.v1 import tensor_pb2

_LOGGER = logging.getLogger("gradps.metrics")

# A `_created` gauge beside every counter doubles the series for nothing a dashboard reads.
prometheus_client.disable_created_metrics()

# Seconds: a push over shared memory takes well under a millisecond, a long poll up to a minute.
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Versions a push's gradient is behind (0 for sync; bounded by s for ssp).
_STALENESS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)

# ---- gRPC servers (every service) --------------------------------------------------------------

GRPC_STARTED = Counter("gradps_grpc_server_started", "RPCs started on the server.", ["method"])
GRPC_HANDLED = Counter(
    "gradps_grpc_server_handled", "RPCs completed on the server, by status code.", ["method", "code"]
)
GRPC_SECONDS = Histogram(
    "gradps_grpc_server_handling_seconds",
    "Time from an RPC's start to its end on the server (a stream's last message).",
    ["method"],
    buckets=(*_SECONDS, 300.0),
)
GRPC_RECEIVED = Counter("gradps_grpc_server_msg_received", "Messages received by the server.", ["method"])
GRPC_SENT = Counter("gradps_grpc_server_msg_sent", "Messages sent by the server.", ["method"])

# ---- shard ---------------------------------------------------------------------------------------

SHARD_PUSHED_BYTES = Counter(
    "gradps_shard_pushed_bytes",
    "Payload bytes of the pushes a shard applied (as GetStats counts them), by route and codec.",
    ["transport", "codec"],
)
SHARD_PULLED_BYTES = Counter(
    "gradps_shard_pulled_bytes",
    "Payload bytes a shard sent in answers to pulls, by route and codec.",
    ["transport", "codec"],
)
SHARD_PUSH_SECONDS = Histogram(
    "gradps_shard_push_seconds",
    "Time a shard took to read, decode and apply one push.",
    ["scheme"],
    buckets=_SECONDS,
)
SHARD_PULL_SECONDS = Histogram(
    "gradps_shard_pull_seconds",
    "Time from a pull's check to its last part sent, waiting for the parts included.",
    ["scheme"],
    buckets=_SECONDS,
)
SHARD_ROUND_SECONDS = Histogram(
    "gradps_shard_round_seconds",
    "Time of one group-average call (wagma): deposit read, round, average sent.",
    ["scheme"],
    buckets=_SECONDS,
)
SHARD_STALENESS = Histogram(
    "gradps_shard_push_staleness",
    "Staleness of each applied push: updates between the version its gradient was computed on and now "
    "(its count is the pushes applied).",
    ["scheme"],
    buckets=_STALENESS,
)

SHARD_CHECKPOINT_SECONDS = Histogram(
    "gradps_shard_checkpoint_seconds",
    "A checkpoint's time, by phase: snapshot (the run's lock held, pushes wait) and write (in the "
    "background, files fsynced and renamed).",
    ["scheme", "phase"],
    buckets=_SECONDS,
)
SHARD_CHECKPOINT_BYTES = Counter(
    "gradps_shard_checkpoint_bytes", "Bytes of checkpoints a shard wrote (their files).", ["scheme"]
)
SHARD_CHECKPOINT_FAILURES = Counter(
    "gradps_shard_checkpoint_failures", "Checkpoints a shard could not write (a full or read-only disk).", ["scheme"]
)

# ---- worker --------------------------------------------------------------------------------------

WORKER_STEPS = Counter("gradps_worker_steps", "Training steps a worker completed.", ["scheme"])
WORKER_SAMPLES = Counter("gradps_worker_samples", "Training samples a worker consumed.", ["scheme"])
WORKER_STEP_SECONDS = Histogram(
    "gradps_worker_step_seconds",
    "Wall time of one training step: forward, backward and the scheme's exchange.",
    ["scheme"],
    buckets=_SECONDS,
)
WORKER_WAIT_SECONDS = Histogram(
    "gradps_worker_wait_seconds",
    "Time one step spent blocked in the scheme's exchange with the shards.",
    ["scheme"],
    buckets=_SECONDS,
)
WORKER_PUSHED_BYTES = Counter(
    "gradps_worker_pushed_bytes",
    "Payload bytes a worker pushed (gradients, and models deposited for group averages).",
    ["transport", "codec"],
)
WORKER_PULLED_BYTES = Counter("gradps_worker_pulled_bytes", "Payload bytes a worker pulled.", ["transport", "codec"])

# ---- coordinator (read from its state at each scrape) --------------------------------------------

_LIVE_WORKERS = "gradps_coordinator_live_workers"
_LIVE_SHARDS = "gradps_coordinator_live_shards"
_RUNS = "gradps_coordinator_runs"
RUN_STATES = ("pending", "running", "completed", "failed", "stopped")

_DEFINED: tuple[Counter | Gauge | Histogram, ...] = (
    GRPC_STARTED,
    GRPC_HANDLED,
    GRPC_SECONDS,
    GRPC_RECEIVED,
    GRPC_SENT,
    SHARD_PUSHED_BYTES,
    SHARD_PULLED_BYTES,
    SHARD_PUSH_SECONDS,
    SHARD_PULL_SECONDS,
    SHARD_ROUND_SECONDS,
    SHARD_STALENESS,
    WORKER_STEPS,
    WORKER_SAMPLES,
    WORKER_STEP_SECONDS,
    WORKER_WAIT_SECONDS,
    WORKER_PUSHED_BYTES,
    WORKER_PULLED_BYTES,
)
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def series_names() -> frozenset[str]:
    """Every series name gradps's services export (a counter's `_total`, a histogram's `_bucket`,
    `_sum` and `_count`): what a dashboard or an alert may query."""
    names = {_LIVE_WORKERS, _LIVE_SHARDS, _RUNS}
    for metric in _DEFINED:
        for family in metric.describe():
            names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return frozenset(names)


# ---- the gRPC server interceptor -----------------------------------------------------------------


class _MethodSeries:
    """One method's children, bound once: a call then touches no label lookup but its code's."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.started = GRPC_STARTED.labels(method)
        self.seconds = GRPC_SECONDS.labels(method)
        self.received = GRPC_RECEIVED.labels(method)
        self.sent = GRPC_SENT.labels(method)
        self.handled: dict[str, Counter] = {}

    def ended(self, code: str, began: float, received: int, sent: int) -> None:
        child = self.handled.get(code)
        if child is None:
            child = self.handled.setdefault(code, GRPC_HANDLED.labels(self.method, code))
        child.inc()
        self.seconds.observe(time.perf_counter() - began)
        self.received.inc(received)
        self.sent.inc(sent)


_methods: dict[str, _MethodSeries] = {}
_methods_lock = threading.Lock()


def _series(method: str) -> _MethodSeries:
    found = _methods.get(method)
    if found is None:
        with _methods_lock:
            found = _methods.setdefault(method, _MethodSeries(method))
    return found


def _code(context: grpc.ServicerContext, failed: bool) -> str:
    """The status the call ended with: what the handler set (abort sets it too), else OK, or
    UNKNOWN when it raised without one (gRPC's own answer to an uncaught exception)."""
    code = context.code()
    if code is None or (failed and code == grpc.StatusCode.OK):
        return "UNKNOWN" if failed else "OK"
    return str(code.name)


class _Counted:
    """A request stream that counts the messages read from it."""

    def __init__(self, messages: Iterable[Any]) -> None:
        self._messages = iter(messages)
        self.n = 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        message = next(self._messages)
        self.n += 1
        return message


def _unary_response(behaviour: Callable[..., Any], series: _MethodSeries, streamed: bool) -> Callable[..., Any]:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        series.started.inc()
        began = time.perf_counter()
        requests = _Counted(request) if streamed else None
        code = "UNKNOWN"
        try:
            response = behaviour(requests if streamed else request, context)
            code = _code(context, failed=False)
            return response
        except BaseException:
            code = _code(context, failed=True)
            raise
        finally:
            received = requests.n if requests is not None else 1
            series.ended(code, began, received, int(code == "OK"))

    return call


def _stream_response(
    behaviour: Callable[..., Iterator[Any]], series: _MethodSeries, streamed: bool
) -> Callable[..., Iterator[Any]]:
    def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        series.started.inc()
        began = time.perf_counter()
        requests = _Counted(request) if streamed else None
        responses = behaviour(requests if streamed else request, context)
        sent, code = 0, "UNKNOWN"
        try:
            for response in responses:
                yield response
                sent += not isinstance(response, Park)  # a wait (gradps.serving), not a message
            code = _code(context, failed=False)
        except GeneratorExit:  # gRPC closed the stream: the client cancelled or went away
            code = "CANCELLED"
            raise
        except BaseException:
            code = _code(context, failed=True)
            raise
        finally:
            # A generator is closed now, so that the handler's own clean-up runs before the call ends.
            if (close := getattr(responses, "close", None)) is not None:
                close()
            series.ended(code, began, requests.n if requests is not None else 1, sent)

    return call


class ServerMetricsInterceptor(grpc.ServerInterceptor):
    """Counts every call of a known method: started, handled by status code, handling time,
    messages received and sent (the series every gRPC server exports). Installed outermost, so
    that it sees the code StatusInterceptor and any other interceptor end a call with."""

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED, and no series is made
            return None
        series = _series(details.method.lstrip("/"))
        wrapped = {}
        for kind, streamed in (("unary_unary", False), ("stream_unary", True)):
            if (behaviour := getattr(handler, kind)) is not None:
                wrapped[kind] = _unary_response(behaviour, series, streamed)
        for kind, streamed in (("unary_stream", False), ("stream_stream", True)):
            if (behaviour := getattr(handler, kind)) is not None:
                wrapped[kind] = _stream_response(behaviour, series, streamed)
        return handler._replace(**wrapped)


class WorkerSeries:
    """A worker's series for one run, bound once: a step touches no label lookup."""

    def __init__(
        self, scheme: str, codec: tensor_pb2.CodecParams, pull_codec: tensor_pb2.CodecParams, transport: str
    ) -> None:
        self._steps = WORKER_STEPS.labels(scheme)
        self._samples = WORKER_SAMPLES.labels(scheme)
        self._step_seconds = WORKER_STEP_SECONDS.labels(scheme)
        self._wait_seconds = WORKER_WAIT_SECONDS.labels(scheme)
        self._pushed = WORKER_PUSHED_BYTES.labels(transport, codec_family(codec))
        self._pulled = WORKER_PULLED_BYTES.labels(transport, codec_family(pull_codec))
        self._counted = (0, 0)

    def step(self, steps: int, samples: int, step_s: float, wait_s: float) -> None:
        """One training step: the steps it advanced (a late wagma worker skips some), its samples,
        its wall time and the part of it spent waiting on the shards."""
        self._steps.inc(steps)
        self._samples.inc(samples)
        self._step_seconds.observe(step_s)
        self._wait_seconds.observe(wait_s)

    def traffic(self, pushed: int, pulled: int) -> None:
        """The bytes pushed and pulled so far in the run: the counters grow by what is new."""
        self._pushed.inc(pushed - self._counted[0])
        self._pulled.inc(pulled - self._counted[1])
        self._counted = (pushed, pulled)


# ---- the coordinator's gauges --------------------------------------------------------------------


@dataclass(frozen=True)
class Census:
    """What the coordinator holds at one moment."""

    live_workers: int
    live_shards: int
    # Runs it keeps, by state (RUN_STATES).
    runs: dict[str, int]


class _CoordinatorCollector(Collector):
    def __init__(self, census: Callable[[], Census]) -> None:
        self._census = census

    def describe(self) -> Iterable[GaugeMetricFamily]:
        # Names only: registering must not read the coordinator's state.
        return self._families(Census(0, 0, {}))

    def collect(self) -> Iterable[GaugeMetricFamily]:
        return self._families(self._census())

    @staticmethod
    def _families(census: Census) -> list[GaugeMetricFamily]:
        runs = GaugeMetricFamily(_RUNS, "Runs the coordinator keeps, by state.", labels=["state"])
        for state in RUN_STATES:  # every state, 0 included: a missing series would read as no data
            runs.add_metric([state], census.runs.get(state, 0))
        return [
            GaugeMetricFamily(_LIVE_WORKERS, "Workers whose heartbeats the coordinator hears.", census.live_workers),
            GaugeMetricFamily(_LIVE_SHARDS, "Shards whose heartbeats the coordinator hears.", census.live_shards),
            runs,
        ]


def watch_coordinator(census: Callable[[], Census]) -> None:
    """Export the coordinator's gauges, read through `census` whenever Prometheus scrapes."""
    REGISTRY.register(_CoordinatorCollector(census))


# ---- the endpoint --------------------------------------------------------------------------------


_serving = False


def serving_metrics() -> bool:
    """Whether this process serves /metrics: where none scrapes, gRPC calls go uncounted."""
    return _serving


def start_endpoint(port: int, host: str) -> int:
    """Serve /metrics on host:port (0: any free port) from a daemon thread; returns the bound port.
    Host "::" takes IPv4 too; where IPv6 is off, it falls back to 0.0.0.0."""
    try:
        server, _ = prometheus_client.start_http_server(port, addr=host)
    except OSError:
        if host != "::":
            raise
        server, _ = prometheus_client.start_http_server(port, addr="0.0.0.0")
    global _serving
    _serving = True
    bound = int(server.server_port)
    _LOGGER.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
