"""Shared fixtures: real local clusters (coordinator, shards, workers as processes on loopback)."""

from __future__ import annotations

import os
import re

import pytest

from client.local_cluster import LocalCluster
from client.sdk import Client


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the tests run without it too
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many processes share the tests (`-n auto`, the default): one a core, up to 4 (one
    process keeps 2 cores 70% busy: its tests wait on the services they start). None (one
    process) where output is asked for (`-s`: a worker's output is not shown), on one core, or
    where load tests are selected: they measure services under load, and nothing may run beside
    them."""
    cores = len(os.sched_getaffinity(0))
    if config.option.capture == "no" or cores < 2 or _selects(config.option.markexpr, "load"):
        return 0
    return min(cores, 4)


def _selects(markexpr: str, marker: str) -> bool:
    """Whether `-m markexpr` selects a test marked `marker` alone (an empty expression selects all)."""
    try:
        from _pytest.mark.expression import Expression  # pytest's own reading of -m
    except ImportError:  # an internal module a later pytest may move: then the marker's name decides
        return not markexpr or re.search(rf"\b{marker}\b", markexpr) is not None
    return not markexpr or Expression.compile(markexpr).evaluate(lambda name, **kwargs: name == marker and not kwargs)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        # A worker process starts with COLUMNS=80 and LINES=24 set: the commands the tests run
        # (and their tables' width) must see the environment a single process sees.
        os.environ.pop("COLUMNS", None)
        os.environ.pop("LINES", None)


@pytest.fixture(scope="module")
def cluster():
    """A coordinator with 2 shards and 2 workers, shared by the tests of one module."""
    with LocalCluster(shards=2, workers=2, heartbeat_timeout_s=1.5) as c:
        yield c


@pytest.fixture(scope="module")
def shards_only():
    """A coordinator with 3 shards and no worker processes: the test itself plays the workers."""
    with LocalCluster(shards=3, workers=0, heartbeat_timeout_s=2.0) as c:
        yield c


@pytest.fixture
def client(request):
    """An SDK client for whichever cluster fixture the test uses."""
    fixture = "cluster" if "cluster" in request.fixturenames else "shards_only"
    c = Client(request.getfixturevalue(fixture).address)
    yield c
    c.close()
