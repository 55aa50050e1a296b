"""Service logs: lines for people (`--log-format text`, the default) or one JSON object per line
for log pipelines (`--log-format json`: Loki, Elasticsearch, Cloud Logging), with the run and
worker a line is about as fields of their own. On SIGUSR1, every thread's stack."""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

LOG_FORMATS = ("text", "json")
# Fields a log call may pass as `extra=` (or the process context may hold), written as such.
_FIELDS = ("run_id", "worker_id", "shard_index")
# A worker process trains one run at a time: what every one of its lines is about.
_context: dict[str, Any] = {}


def set_log_context(**fields: Any) -> None:
    """Fields added to every later line of this process (None removes one)."""
    for key, value in fields.items():
        if key not in _FIELDS:
            raise ValueError(f"unknown log field {key!r}; one of {', '.join(_FIELDS)}")
        if value is None:
            _context.pop(key, None)
        else:
            _context[key] = value


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, service, logger, message, the
    run and worker ids where known, and the traceback of an exception."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in _FIELDS:
            value = getattr(record, key, _context.get(key))
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(service: str, level: str, log_format: str) -> None:
    """The root logger of a service process: `level` and `log_format` (text or json) on stderr."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # `kill -USR1 PID` writes every thread's stack to stderr: what a service that does not stop
    # or does not answer is doing, without a debugger. Written from the signal handler's C
    # code, so it works while the interpreter is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def log_options(fn: F) -> F:
    """A service's `--log-level` (GRADPS_LOG_LEVEL) and `--log-format` (GRADPS_LOG_FORMAT)."""
    fn = click.option(
        "--log-format",
        envvar="GRADPS_LOG_FORMAT",
        show_envvar=True,
        default="text",
        type=click.Choice(LOG_FORMATS),
        help="text: lines for people; json: one object per line, with run_id and worker_id fields.",
    )(fn)
    return click.option(
        "--log-level",
        envvar="GRADPS_LOG_LEVEL",
        show_envvar=True,
        default="INFO",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    )(fn)
