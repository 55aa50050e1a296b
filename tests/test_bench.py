"""Smoke test of `gradps bench transport`: real shards, TCP and gloo references, JSON rows.

No timed assertions: the machine is shared and noisy; only that every row is complete and every
measured number is positive.
"""

from __future__ import annotations

import json
import math

from click.testing import CliRunner

from client.cli import cli

_FIELDS = (
    "op",
    "size_mib",
    "shards",
    "workers",
    "codec",
    "transport",
    "seconds",
    "gbps",
    "tcp_gbps",
    "ratio_vs_tcp",
    "gloo_seconds",
    "ratio_vs_gloo",
)


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_transport_bench_writes_complete_rows(tmp_path):
    out = tmp_path / "transport.json"
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "transport",
            "--sizes=0.25",
            "--shards=1",
            "--workers=2",
            "--codec=none,int8",
            "--rounds=2",
            "--part-size=0.0625",  # 4 parts per shard
            "--round-mib=0.5",
            f"--json={out}",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    ops = sorted((r["op"], r["codec"], r["transport"]) for r in rows)
    # Every op, codec and transport once; a shm row is only written when every shard mapped the
    # bench workers' segments (the workers fail otherwise).
    assert ops == sorted(
        (op, codec, transport)
        for op in ("push_pull", "sync_step")
        for codec in ("none", "int8")
        for transport in ("shm", "grpc")
    )
    for row in rows:
        assert set(_FIELDS) <= set(row), row
        assert row["size_mib"] == 0.25 and row["shards"] == 1 and row["workers"] == 2
        for field in ("seconds", "gbps", "tcp_gbps", "ratio_vs_tcp", "gloo_seconds", "ratio_vs_gloo"):
            assert _positive(row[field]), (field, row)
