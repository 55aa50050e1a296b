"""Smoke tests of `gradps bench`: real shards, TCP and gloo references, JSON rows, and what each
bench shows (one progress line on stderr, then its table).

No timed assertions: the machine is shared and noisy; only that every row is complete and every
measured number is positive.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from client.bench.plot import plot_transport
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
            "--sizes=1",
            "--shards=1",
            "--workers=2",
            "--codec=none,int8",
            "--rounds=2",
            "--part-size=0.5",  # 2 parts per shard, large enough to go on a data stream
            "--round-mib=1",
            f"--json={out}",
            f"--plot={tmp_path / 'transport.png'}",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    figure = (tmp_path / "transport.png").read_bytes()
    assert figure.startswith(b"\x89PNG") and len(figure) > 10_000
    ops = sorted((r["op"], r["codec"], r["transport"]) for r in rows)
    # Every op, codec and transport once; a shm or stream row is only written when every shard
    # mapped the bench workers' segments or attached their streams (the workers fail otherwise).
    assert ops == sorted(
        (op, codec, transport)
        for op in ("push_pull", "sync_step")
        for codec in ("none", "int8")
        for transport in ("shm", "stream", "grpc")
    )
    for row in rows:
        assert set(_FIELDS) <= set(row), row
        assert row["size_mib"] == 1 and row["shards"] == 1 and row["workers"] == 2
        for field in ("seconds", "gbps", "tcp_gbps", "ratio_vs_tcp", "gloo_seconds", "ratio_vs_gloo"):
            assert _positive(row[field]), (field, row)


@pytest.mark.slow
def test_transport_bench_places_each_shard_beside_a_worker(tmp_path):
    # Each bench worker checks that it shares memory with its own shard and streams to the other
    # (it fails the bench otherwise).
    rows = _bench(
        tmp_path,
        "transport",
        "--sizes=1",
        "--shards=2",
        "--workers=2",
        "--transport=colocated",
        "--rounds=1",
        "--part-size=0.5",  # one part per shard, large enough to go on a data stream
        "--round-mib=1",
        parts=2,
    )
    assert sorted((r["op"], r["transport"], r["shards"]) for r in rows) == [
        ("push_pull", "colocated", 2),
        ("sync_step", "colocated", 2),
    ]
    assert all(_positive(r["seconds"]) and _positive(r["ratio_vs_gloo"]) for r in rows), rows


def test_transport_plot_draws_what_a_run_has_and_refuses_nothing(tmp_path):
    # One worker: push_pull rows alone (no gloo reference, no sync step); the right panel says so.
    row = {"op": "push_pull", "size_mib": 1.0, "transport": "shm", "codec": "none", "ratio_vs_tcp": 0.8}
    plot_transport([row, {**row, "size_mib": 16.0, "ratio_vs_tcp": 1.1}], tmp_path / "one.svg")
    assert b"<svg" in (tmp_path / "one.svg").read_bytes()
    with pytest.raises(ValueError, match="no rows"):
        plot_transport([], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


# stderr as a terminal shows it (the progress line draws only there), at a known width.
_TERMINAL = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "TERM": "xterm", "COLUMNS": "160"}


def _bench(tmp_path, *args: str, parts: int) -> list | dict:
    """Run `gradps bench ARGS --json FILE`, check what it showed and return the file's content."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(cli, ["bench", *args, f"--json={out}"], env=_TERMINAL)
    assert result.exit_code == 0, result.output
    _check_shown(result.stdout, result.stderr, args[0], parts)
    return json.loads(out.read_text())


def _check_shown(stdout: str, stderr: str, name: str, parts: int) -> None:
    """The bench's output: on stderr its one progress line, drawn over itself, up to `parts` of
    `parts`, and no log line but the last one (where --json wrote); on stdout its table."""
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stderr)
    assert f" {parts}/{parts} " in plain, plain
    assert [line[:5] for line in _logged(plain)] == ["wrote"], plain
    assert f"gradps bench {name}" in stdout, stdout


def _logged(stderr: str) -> list[str]:
    """The lines a console logged (each begins with its time, "[12:34:56] "), less the time; a
    terminal's lines may end in a carriage return as well."""
    times = (re.match(r"\[\d\d:\d\d:\d\d\] (.*)", line) for line in re.split(r"[\r\n]", stderr))
    return [m.group(1) for m in times if m]


def test_adam_bench_times_the_shards_update_and_the_per_part_one(tmp_path):
    # Its parts: the copy/add reference, then each path.
    rows = _bench(tmp_path, "adam", "--params=300000", "--part-size=0.25", "--steps=2", "--device=cpu", parts=3)
    assert [r["path"] for r in rows] == ["shard", "per-part"]
    for row in rows:
        assert row["kernels"] == "fused" and row["params"] == 300000 and row["device"] == "cpu"
        for field in ("seconds", "gbps", "copy_gbps", "ratio_vs_copy"):
            assert _positive(row[field]), (field, row)


def test_step_bench_breaks_a_real_step_down(tmp_path):
    b = _bench(
        tmp_path,
        "step",
        "--model=mlp",
        "--dataset=digits",
        "--shards=1",
        "--steps=2",
        "--warmup=1",
        "--transport=stream",
        parts=2,  # the cluster, then the steps
    )
    assert b["transport"] == "stream"
    assert (b["model"], b["scheme"], b["workers"], b["device"]) == ("mlp", "asgd", 2, "cpu")
    assert b["params"] > 0 and b["steps"] == 2
    for field in ("step_s", "compute_s", "exchange_s", "push_s", "decode_s"):
        assert _positive(b[field]), (field, b)
    # asgd's exchange pushes and fetches in one call (PushPull): the weights it decodes came back
    # in the push call, and no pull call is made.
    assert b["pull_s"] == 0, b
    # Medians of the step's parts: each within the median step (medians do not add exactly).
    assert b["compute_s"] <= b["step_s"] and b["exchange_s"] <= b["step_s"]
    assert 0 <= b["exposed_comm_fraction"] <= 1


@pytest.mark.slow
def test_step_bench_measures_what_checkpoints_cost_in_the_same_run(tmp_path):
    b = _bench(
        tmp_path,
        "step",
        "--model=mlp",
        "--dataset=digits",
        "--shards=2",
        "--steps=300",
        "--warmup=1",
        "--checkpoint-every=0.2",
        parts=3,  # the cluster, the steps, the checkpoint after them
    )
    # The shards' checkpoint windows were found among the steps and the steps beside them
    # measured against the others: what one costs, and that over the interval.
    assert b["checkpoints"] >= 1 and b["checkpoints_beside_steps"] >= 1, b
    assert b["checkpoint_cost"] == pytest.approx(b["checkpoint_lost_s"] / 0.2), b
    assert abs(b["checkpoint_lost_s"]) < 300 * b["step_mean_s"], b
    assert b["checkpoint_bytes"] > 0 and _positive(b["checkpoint_write_s"]) and _positive(b["plain_write_s"]), b


@pytest.mark.slow
def test_memory_bench_reports_the_shards_peak_against_what_it_must_hold(tmp_path):
    rows = _bench(
        tmp_path,
        "memory",
        "--size=8",
        "--workers=1",
        "--optimizer=adam",
        "--op=push_pull",
        "--transport=shm,grpc",
        parts=2,
    )
    assert sorted(r["transport"] for r in rows) == ["grpc", "shm"]
    for row in rows:
        # 8 MiB of parameters, two Adam moments, one push in flight.
        assert row["expected_mib"] == 8 * (1 + 2 + 1), row
        assert _positive(row["peak_mib"]) and _positive(row["ratio"]), row
        assert row["peak_mib"] >= row["baseline_mib"], row


def test_bad_bench_options_are_one_line_usage_errors():
    cases = [
        (["memory", "--workers", "0"], "every value must be >= 1"),
        (["memory", "--op", "push_pull,nope"], "unknown value 'nope': expected push_pull or sync_step"),
        (["memory", "--optimizer", "lamb"], "unknown value 'lamb': expected sgd or adam"),
        (["transport", "--transport", "udp"], "unknown value 'udp': expected shm or stream or grpc or colocated"),
        (["memory", "--transport", "colocated"], "unknown value 'colocated': expected shm or stream or grpc"),
        (["transport", "--sizes", "1,x"], "expected a comma-separated list"),
        (["transport", "--codec", "zip"], "unknown codec"),
        (["transport", "--plot", "rows.txt"], "rows.txt: expected a file ending in .png, .svg, .pdf"),
        (["step", "--device", "tpu"], "'tpu' is not one of"),
    ]
    for args, words in cases:
        result = CliRunner().invoke(cli, ["bench", *args])
        assert result.exit_code == 2, (args, result.output)
        assert words in result.output, (args, result.output)
        assert "Traceback" not in result.output


@pytest.mark.slow
def test_the_transport_bench_measures_the_cost_of_metrics_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    args = ["bench", "transport", "--sizes", "1", "--shards", "1", "--workers", "1", "--transport", "shm"]
    result = CliRunner().invoke(cli, [*args, "--metrics", "both", "--rounds", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [(r["transport"], r["metrics"]) for r in rows] == [("shm", False), ("shm", True)]
    assert all(r["gbps"] > 0 and r["seconds"] > 0 for r in rows)
    # Without a terminal no progress line draws, nor a log line per configuration: the table, and
    # the one log line that says where the rows went.
    assert "gradps bench transport" in result.stdout
    assert [line[:5] for line in _logged(result.stderr)] == ["wrote"], result.stderr


def test_a_long_transport_table_is_shortened_to_the_largest_size() -> None:
    import io

    from rich.console import Console

    from client.bench.transport import Row, print_rows

    def row(size: float, transport: str) -> Row:
        return Row(
            op="push_pull", size_mib=size, shards=1, workers=1, codec="none", transport=transport, tls=False,
            metrics=False, device="cpu", part_mib=4.0, seconds=0.01, gbps=1.0, tcp_gbps=2.0, ratio_vs_tcp=0.5,
            gloo_seconds=None, ratio_vs_gloo=None, seconds_min=0.01, rounds=1, encode_s=0.0, decode_s=0.0,
        )  # fmt: skip

    def printed(rows: list[Row]) -> str:
        out = io.StringIO()
        print_rows(rows, Console(file=out, width=200))
        return out.getvalue()

    few = [row(size, "shm") for size in (1, 16, 64)]
    assert printed(few).count("push_pull") == 3 and "rows measured" not in printed(few)
    many = [row(size, t) for size in (1, 16, 64, 256) for t in ("shm", "stream", "grpc") for _ in range(3)]
    text = printed(many)
    assert text.count("push_pull") == 9 and "36 rows measured; shown: the 256 MiB ones." in text


def test_a_long_memory_table_is_shortened_to_the_largest_worker_count() -> None:
    import io

    from rich.console import Console

    from client.bench.memory import MemoryRow, print_rows

    rows = [
        MemoryRow(op, 8.0, w, opt, t, 100.0, 150.0, 0.0, 40.0, 40.0, 1.0)
        for op in ("push_pull", "sync_step")
        for opt in ("sgd", "adam")
        for w in (2, 4, 8)
        for t in ("shm", "stream", "grpc")
    ]
    out = io.StringIO()
    print_rows(rows, Console(file=out, width=200))
    text = out.getvalue()
    assert text.count("push_pull") + text.count("sync_step") == 12
    assert "36 rows measured; shown: the 8-worker ones. --json FILE keeps every row." in text
