"""Shared fixtures: real local clusters (coordinator, shards, workers as processes on loopback)."""

from __future__ import annotations

import pytest

from client.local_cluster import LocalCluster
from client.sdk import Client


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
