"""What the coordinator refuses before it stores anything: every size and count a caller controls.

The coordinator keeps what it is sent (a run's spec in every status and event, a worker's name,
a report's error) and sends it on (ListRuns, WatchRun, OpenRun to every shard), so one oversized
field would cost memory in proportion and could make a reply too large to send for good.
"""

from __future__ import annotations

from gradps.errors import Invalid
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import run_pb2

# Model, dataset, scheme and optimizer names of a spec; worker, shard and device names. An import
# path or a Kubernetes pod name (at most 253) fits.
MAX_NAME_CHARS = 256
# A serialized RunSpec (a few hundred bytes in practice): it travels in every OpenRunRequest
# beside a placement table that may take nearly a whole message.
MAX_SPEC_BYTES = 16 * 1024
# A shard address: a DNS name (at most 253 characters), or a bracketed IPv6 address, and a port.
MAX_HOST_CHARS = 253
MAX_ADDRESS_CHARS = MAX_HOST_CHARS + 2 + 1 + 5
# One Metrics report, and its error (a worker cuts its own at 2000 characters).
MAX_METRICS_BYTES = 16 * 1024
MAX_ERROR_CHARS = 4096
# The reason a client gives for stopping a run, kept as its message.
MAX_REASON_CHARS = 1024
# Counts the coordinator holds: runs that are pending or running, live workers, known shards.
MAX_ACTIVE_RUNS = 1024
MAX_LIVE_WORKERS = 16384
MAX_SHARDS = 1024


def shown(text: str, limit: int = 80) -> str:
    """`text` for a one-line message: quoted, and cut short."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _check_name(what: str, value: str) -> None:
    if len(value) > MAX_NAME_CHARS:
        raise Invalid(f"{what} has {len(value)} characters, more than {MAX_NAME_CHARS}: {shown(value, 40)}")


def check_spec(spec: run_pb2.RunSpec) -> None:
    """Invalid for a spec beyond the size limits (checked before any copy of it is made)."""
    size = spec.ByteSize()  # first: reading a field copies it
    if size > MAX_SPEC_BYTES:
        raise Invalid(
            f"the run spec takes {size} bytes, more than {MAX_SPEC_BYTES} (names are at most {MAX_NAME_CHARS} "
            "characters)"
        )
    for what in ("model", "dataset", "scheme"):
        _check_name(what, getattr(spec, what))
    _check_name("optimizer", spec.optimizer.name)
    _check_name("optimizer schedule", spec.optimizer.schedule)


def check_stop(request: cpb.StopRunRequest) -> None:
    """Invalid for a stop whose reason is beyond the limit or not one line (listings show it)."""
    if len(request.reason) > MAX_REASON_CHARS:
        raise Invalid(f"the reason has {len(request.reason)} characters, more than {MAX_REASON_CHARS}")
    if "\n" in request.reason or "\r" in request.reason:
        raise Invalid(f"the reason must be one line: {shown(request.reason, 40)}")


def check_join(request: cpb.JoinWorkerRequest) -> None:
    """Invalid for a worker name or device beyond the limits."""
    _check_name("worker name", request.name)
    _check_name("worker device", request.device)


def check_shard(address: str, device: str) -> None:
    """Invalid unless `address` is a bounded HOST:PORT or [IPV6]:PORT and `device` a bounded name."""
    why = address_problem(address)
    if why:
        raise Invalid(f"shard address must be HOST:PORT or [IPV6]:PORT, got {shown(address, 100)}: {why}")
    _check_name("shard device", device)


def address_problem(address: str) -> str:
    """Why `address` is not a shard's HOST:PORT or [IPV6]:PORT; empty when it is one."""
    if len(address) > MAX_ADDRESS_CHARS:
        return f"{len(address)} characters, more than {MAX_ADDRESS_CHARS}"
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        return "no host"
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            return "unclosed or empty [IPv6] host"
    elif any(c in host for c in ":[]"):
        return "an IPv6 host goes in brackets"
    elif len(host) > MAX_HOST_CHARS:
        return f"the host has more than {MAX_HOST_CHARS} characters"
    if any(c.isspace() or not c.isprintable() for c in host):
        return "the host has blanks or control characters"
    if not (port.isascii() and port.isdigit() and len(port) <= 5) or not 1 <= int(port) <= 65535:
        return "the port must be a number in [1, 65535]"
    return ""


def check_metrics(metrics: cpb.Metrics) -> None:
    """Invalid for a report beyond the limits."""
    if len(metrics.error) > MAX_ERROR_CHARS:
        raise Invalid(f"a report's error has {len(metrics.error)} characters, more than {MAX_ERROR_CHARS}")
    size = metrics.ByteSize()
    if size > MAX_METRICS_BYTES:
        raise Invalid(f"a metrics report takes {size} bytes, more than {MAX_METRICS_BYTES}")
