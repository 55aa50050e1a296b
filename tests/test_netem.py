"""An emulated cluster of four hosts (gradps.netem): real namespaces, real link caps, a real cluster.

The test process stays on the machine's own network: the driver of the cluster is a child process
that moves onto host 0 (`_drive`), as `gradps bench transport --link` does.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from client.cli import cli
from gradps.netem import EmulatedNetwork, Layout, NetemError, format_rate, parse_links, parse_rate, unavailable

MiB = 1 << 20
RATE = 100 * 10**6  # slow enough that a 4 MiB push takes a third of a second on the wire
# The coordinator alone on host 3; worker 1 shares host 1 with shard 0; shard 1 alone on host 2.
LAYOUT = Layout(coordinator=3, shards=(1, 2), workers=(0, 1))

needs_netem = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def test_link_rates_parse_with_per_host_overrides():
    assert parse_rate("10gbit") == 10**10 and parse_rate("1.5Gbit/s") == 1_500_000_000
    assert parse_links("10gbit,host2=1gbit", 4) == [10**10, 10**10, 10**9, 10**10]
    assert format_rate(25 * 10**9) == "25gbit" and format_rate(2_500_000_000) == "2.5gbit"
    for bad, why in [
        ("fast", "bad link rate"),
        ("0gbit", "bad link rate"),
        ("host1=1gbit", "give a rate for every host"),
        ("10gbit,host4=1gbit", "there are 4 hosts"),
        ("10gbit,1gbit", "one default rate"),
        ("10gbit,node1=1gbit", "expected host<K>=RATE"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_links(bad, 4)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--link=10gbit,host9=1gbit"], "there are 2 hosts"),
        (["--link=10gbit", "--transport=stream"], "--transport does not apply with --link"),
        (["--link=10gbit", "--hosts=rack"], "unknown value 'rack'"),
        (["--hosts=separate"], "this bench would ignore --hosts (--link only)"),
    ],
)
def test_bench_refuses_a_bad_link_in_one_line(args, message):
    result = CliRunner().invoke(cli, ["bench", "transport", "--shards=1", "--workers=2", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def _listening(pid: int) -> set[str]:
    """The addresses process `pid` listens on (its sockets in /proc/<pid>/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(f"/proc/{pid}/fd/{fd}") else ""
        if match := re.fullmatch(r"socket:\[(\d+)\]", target):
            inodes.add(match[1])
    bound = set()
    for table in ("tcp", "tcp6"):  # gRPC listens on IPv6 sockets, an IPv4 address mapped
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                # /proc prints each 32-bit word in host (little-endian) order.
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
                bound.add(socket.inet_ntop(family, words).removeprefix("::ffff:"))
    return bound


def _mapped_segments(pid: int) -> int:
    """How many gradps shared-memory segments process `pid` maps."""
    return len({line.split()[-2] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "gradps-" in line})


def _drive(network: EmulatedNetwork, results: mp.Queue) -> None:
    """On host 0: what `_observe` saw, or why it failed."""
    try:
        results.put(_observe(network))
    except Exception as e:
        results.put({"error": f"{type(e).__name__}: {e}"})


def _observe(network: EmulatedNetwork) -> dict:
    """A cluster placed as LAYOUT, two bench workers, one timed push + pull round."""
    from client.bench.workers import BenchWorkers, Job, submit_run
    from client.local_cluster import LocalCluster
    from gradps.netem import enter

    enter(network.namespace(0))
    hosts = [network.host(k) for k in LAYOUT.workers]
    with (
        LocalCluster(shards=2, workers=0, network=network, layout=LAYOUT) as cluster,
        BenchWorkers(cluster.address, 2, hosts=hosts) as workers,
    ):
        seen = {"coordinator": _listening(cluster.coordinator.pid)}
        seen |= {f"shard-{i}": _listening(p.pid) for i, p in enumerate(cluster.shards)}
        run_id = submit_run(cluster.address, "push_pull", 2, "none", 1 * MiB, 2)
        # Each worker checks its routes: shared memory with the shards of its host, streams to others.
        workers.start(Job(run_id, "push_pull", 4.0, "none", 1, 1, 1, "shm"), 2)
        segments = [_mapped_segments(p.pid) for p in cluster.shards]
        seconds = workers.round()
        workers.finish()
    return {"listening": seen, "segments": segments, "round_s": seconds}


@pytest.mark.slow
@needs_netem
def test_four_emulated_hosts_bind_their_addresses_share_memory_only_within_a_host_and_cap_links():
    network = EmulatedNetwork([RATE] * 4).start()
    try:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        driver = ctx.Process(target=_drive, args=(network, results))
        driver.start()
        got = results.get(timeout=300)
        driver.join(timeout=60)
        assert driver.exitcode == 0
    finally:
        network.close()
    assert "error" not in got, got["error"]
    address = network.address
    assert got["listening"]["coordinator"] == {address(3)}
    assert got["listening"]["shard-0"] == {address(1)}  # its gRPC port and its data port
    assert got["listening"]["shard-1"] == {address(2)}
    # Shard 0 maps the segment of worker 1 (its host) only; shard 1 shares a host with no worker.
    assert got["segments"] == [1, 0]
    # Worker 0 pushes its 4 MiB gradient to two other hosts and pulls 4 MiB back over a 100 Mbit/s
    # link: the round cannot beat the wire, however idle the machine.
    wire_s = 4 * MiB * 8 / RATE
    assert got["round_s"] >= wire_s, got
    # Nothing left: no namespace, so no interface, address or queue of the network.
    left = [n for n in os.listdir("/run/netns") if n.startswith(f"gradps-{os.getpid()}-")]
    assert left == []


@needs_netem
def test_a_network_left_by_a_killed_process_is_swept_by_the_next():
    child = subprocess.run(
        ["python", "-c", "from gradps.netem import EmulatedNetwork; EmulatedNetwork([10**9] * 2).start()"],
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stderr
    left = [n for n in os.listdir("/run/netns") if re.fullmatch(r"gradps-\d+-\w+", n)]
    assert len(left) == 3  # two hosts and the switch, of a process that never closed them
    with EmulatedNetwork([10**9]) as network:
        assert sorted(os.listdir("/run/netns")) == sorted([network.namespace(0), f"gradps-{os.getpid()}-sw"])
    assert not [n for n in os.listdir("/run/netns") if n.startswith("gradps-")]


def test_an_emulated_network_is_refused_in_one_line_where_it_cannot_be_made():
    with pytest.raises(NetemError, match="1 to 200 hosts"):
        EmulatedNetwork([])


def _gradps(*args: str, logs: Path | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """The CLI in a process of its own: with --link it moves onto an emulated host for good. Past
    `timeout_s`, it is stopped as a user would (SIGTERM: it stops its cluster and deletes its
    network), and the test fails with the last lines of each log in `logs`."""
    process = subprocess.Popen([sys.executable, "-m", "client.cli", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.terminate()
        stdout, stderr = process.communicate(timeout=60)
        tails = [
            f"{p.name}: {p.read_text(errors='replace')[-600:]}" for p in (sorted(logs.glob("*.log")) if logs else [])
        ]
        pytest.fail(f"gradps {args[0]} ran past {timeout_s:.0f}s; stderr {stderr[-2000:]!r}; logs: {tails}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@needs_netem
@pytest.mark.slow
def test_bench_transport_on_emulated_links_rows_plot_and_the_wire_floor(tmp_path):
    out = tmp_path / "links.json"
    done = _gradps(
        "bench", "transport", "--sizes=1", "--shards=1", "--workers=2", "--rounds=1", "--round-mib=1",
        "--link=1gbit", "--link=100mbit", "--hosts=colocated,separate", "--pull-codec=none,bf16",
        f"--json={out}", f"--plot={tmp_path / 'links.png'}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    ops = {"push_pull", "sync_step"}
    assert {(r["op"], r["transport"], r["link"], r["pull_codec"]) for r in rows} == {
        (op, layout, link, pull)
        for op in ops
        for layout in ("colocated", "separate")
        for link in ("1gbit", "100mbit")
        for pull in ("none", "bf16")
    }
    assert all(r["gloo_seconds"] > 0 for r in rows if r["op"] == "sync_step")
    # Separate: each worker pushes its 1 MiB to the shard's host, then pulls 1 MiB back (float32).
    wire_s = 2 * MiB * 8 / 100e6
    slow = [r for r in rows if r["link"] == "100mbit" and r["transport"] == "separate" and r["pull_codec"] == "none"]
    assert slow and all(r["seconds"] >= wire_s for r in slow), slow
    assert (tmp_path / "links.png").read_bytes().startswith(b"\x89PNG")
    assert not [n for n in os.listdir("/run/netns") if n.startswith("gradps-")]


@needs_netem
@pytest.mark.slow
def test_compare_on_emulated_links_places_the_cluster_and_the_ddp_ranks_on_hosts(tmp_path):
    out = tmp_path / "cmp"
    done = _gradps(
        "compare", "--schemes=asgd", "--workers=2", "--shards=1", "--baseline=ddp", "--link=1gbit",
        "--steps=40", "--eval-every=20", "--target-accuracy=0.5", "--no-progress", f"--out={out}",
        logs=out / "logs",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "compare.json").read_text())
    assert {r["scheme"] for r in result["schemes"]} == {"asgd", "ddp"}
    assert "1gbit links (colocated)" in result["title"]
    # The ranks' rendezvous store listens on host 0's address, which only the emulated hosts reach.
    assert all(r["state"] == "completed" for r in result["schemes"])
    assert not [n for n in os.listdir("/run/netns") if n.startswith("gradps-")]


@pytest.mark.slow
def test_without_root_one_line_says_so_and_the_bench_runs_on_loopback(tmp_path, monkeypatch):
    import gradps.netem

    monkeypatch.setattr(gradps.netem.os, "geteuid", lambda: 1000)  # as a user without root
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(
        cli,
        ["bench", "transport", "--sizes=1", "--shards=1", "--workers=2", "--rounds=1", "--round-mib=1",
         "--link=1gbit", f"--json={out}"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if "need root" in line]
    assert said == ["emulated links need root (network namespaces and traffic control): running on loopback, unshaped"]
    rows = json.loads(out.read_text())
    assert rows and all(r["link"] is None and r["transport"] != "colocated" for r in rows)
