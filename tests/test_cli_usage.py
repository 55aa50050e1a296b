"""The CLI refuses bad input up front, in one line, and an interrupted command leaves nothing running:
no embedded-cluster process, no run holding the cluster's workers."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console
from rich.table import Table

from client.cli import cli
from client.local_cluster import LocalCluster
from client.sdk import Client, GradpsError
from client.terminal import table_console
from client.unread_options import unread_run_options
from gradps.schemes import PARAMS, SCHEMES
from gradps.v1 import coordinator_pb2 as cpb
from tests.services import Services, free_ports


def _usage_cases(tmp: Path) -> list[tuple[list[str], str]]:
    a_file = tmp / "a-file"
    a_file.write_text("")
    return [
        (["train", "--local", "--schedule", "step"], "the step schedule needs step_size >= 1"),
        (["train", "--local", "--pull-codec", "int8"], "pull codec must be none, fp16 or bf16"),
        (["train", "--local", "--momentum", "nan"], "'nan' is not a finite number"),
        (["train", "--local", "--lr", "inf"], "'inf' is not a finite number"),
        (["train", "--local", "--straggler", "1:inf"], "factor a finite number >= 1"),
        (["train", "--local", "--out", str(a_file / "run")], f"cannot create folder {a_file / 'run'}"),
        (["export", "RUN", "--out", str(a_file / "model.pt")], f"cannot create folder {a_file}"),
        (["compare", "--schemes", "sync,sync"], "a scheme is named twice"),
        (["compare", "--schemes", ","], "expected one or more of sync, asgd"),
        (["compare", "--until-target", "--eval-every", "0"], "--until-target needs evaluations on the way"),
        (["train", "--local", "--until-accuracy", "0.9", "--eval-every", "0"], "--until-accuracy needs evaluations"),
        (["bench", "transport", "--json", str(a_file / "rows.json")], f"cannot create folder {a_file}"),
        (["bench", "transport", "--plot", str(a_file / "rows.png")], f"cannot create folder {a_file}"),
        (["bench", "memory", "--json", str(tmp)], "is a directory"),
        (["bench", "adam", "--params", str(10**15)], "GiB free on cpu"),
        (["bench", "step", "--scheme", "bogus"], "'bogus' is not one of"),
        (["train", "--local", "--seed", str(2**64)], "is not in the range 0<=x<=18446744073709551615"),
        (["up", "--workers", "300"], "more than the 256 processes a local cluster starts"),
        # An option the run would not read is refused, naming what it applies to.
        (
            ["train", "--coordinator", "127.0.0.1:1", "--device", "cuda", "--shards", "3"],
            "this run would ignore --shards (--local only), --device (--local only)",
        ),
        (["train", "--local", "--scheme", "sync", "--tau", "4"], "this sync run would ignore --tau (wagma only)"),
        (
            ["train", "--local", "--scheme", "ssp", "--n-push", "2", "--gamma", "0.5"],
            "this ssp run would ignore --gamma (--schedule step only), --n-push (asgd only)",
        ),
        (["train", "--local", "--optimizer", "adam", "--nesterov"], "ignore --nesterov (--optimizer sgd only)"),
        (["train", "--local", "--dataset-size", "500"], "ignore --dataset-size (digits has a fixed size)"),
        (["train", "--local", "--checkpoint-every", "10"], "ignore --checkpoint-every (no checkpoints with --local"),
        (
            ["train", "--coordinator", "127.0.0.1:1", "--resume", "r-1", "--lr", "0.1"],
            "ignore --lr (a resumed run keeps its own spec)",
        ),
        (["compare", "--schemes", "sync,asgd", "--tau", "3"], "these runs would ignore --tau (wagma only)"),
        (["compare", "--hosts", "separate"], "ignore --hosts (--link only)"),
        (
            ["launch", "--scheme", "asgd", "--staleness", "3", str(a_file)],
            "this asgd run would ignore --staleness (ssp only)",
        ),
        (["launch", "--coordinator", "127.0.0.1:1", "--device", "cpu", str(a_file)], "--device (a local cluster only)"),
        # ... and one it reads is not: this run gets as far as the coordinator.
        (
            ["train", "--coordinator", "127.0.0.1:1", "--scheme", "wagma", "--tau", "3", "--out", str(tmp / "run")],
            "no coordinator reachable at 127.0.0.1:1",
        ),
    ]


def test_bad_input_is_refused_before_any_work(tmp_path: Path) -> None:
    runner = CliRunner()
    with runner.isolated_filesystem(temp_dir=tmp_path) as cwd:
        for args, words in _usage_cases(tmp_path):
            start = time.monotonic()
            result = runner.invoke(cli, args, env={"GRADPS_COORDINATOR": None})
            assert result.exit_code in (1, 2), (args, result.output)
            assert words in result.output, (args, result.output)
            assert "Traceback" not in result.output, (args, result.output)
            # Refused up front: no cluster was started (that alone takes seconds).
            assert time.monotonic() - start < 3, (args, time.monotonic() - start)
        assert not (Path(cwd) / "runs").exists()


@pytest.mark.slow
def test_an_explicit_local_wins_over_a_coordinator_from_the_environment(tmp_path: Path) -> None:
    both = CliRunner().invoke(cli, ["train", "--local", "--coordinator", "127.0.0.1:1"])
    assert both.exit_code == 2 and "give --local or --coordinator HOST:PORT, not both" in both.output
    # GRADPS_COORDINATOR names a port nobody serves: the run trains on the embedded cluster anyway.
    args = ["train", "--local", "--steps", "5", "--eval-every", "0", "--no-progress", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "GRADPS_COORDINATOR": "127.0.0.1:1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["state"] == "completed"


def test_a_shard_address_for_a_coordinator_is_named(cluster: LocalCluster, client: Client) -> None:
    shard = client.cluster().shards[0]
    result = CliRunner().invoke(cli, ["status", "--coordinator", shard])
    assert result.exit_code == 1
    assert f"Error: {shard} is not a gradps coordinator" in result.output, result.output


def _descendants(pid: int) -> list[int]:
    """The processes under `pid`: the coordinator beside the fork server, the shards and workers under it."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found = [child for child, parent in parents.items() if parent == pid]
    for child in found:  # grows as it goes: every generation
        found.extend(c for c, parent in parents.items() if parent == child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _gradps(*args: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "client.cli", *args, "--steps", "100000", "--no-progress", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "GRADPS_COORDINATOR"},
    )


def _metrics_started(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > 0


def test_the_cli_and_the_coordinator_run_without_torch(cluster: LocalCluster) -> None:
    """Only what computes loads torch (shards, workers, compare's DDP baseline, the benches when
    they run, export): every command's help and the commands that talk to the coordinator start
    without it, and so does the coordinator. A command other than a bench loads neither the
    benches nor numpy."""
    code = (
        "import sys\n"
        "from client.bench import BENCHES\n"
        "from client.cli import cli\n"
        f"cli(['runs', '--coordinator', {cluster.address!r}], standalone_mode=False)\n"
        "print('runs:', sorted(m for m in sys.modules if m.startswith(('numpy', 'client.bench.'))))\n"
        "for name in [*cli.commands, *(f'bench {b}' for b in BENCHES)]:\n"
        "    cli([*name.split(), '--help'], standalone_mode=False)\n"
        "print('all:', sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = dict(line.split(": ", 1) for line in done.stdout.splitlines() if line.startswith(("runs: ", "all: ")))
    assert loaded["runs"] == "[]", f"`gradps runs` loaded {loaded['runs'][:300]}"
    assert loaded["all"] == "[]", f"the CLI loaded {loaded['all'][:300]}"
    assert cluster.coordinator is not None
    maps = Path(f"/proc/{cluster.coordinator.pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "libtorch" in Path(f"/proc/{cluster.shards[0].pid}/maps").read_text()  # the check can see it


@pytest.mark.parametrize("again", [False, True], ids=["once", "again-while-it-stops"])
def test_sigterm_stops_the_embedded_cluster(tmp_path: Path, again: bool) -> None:
    cli_process = _gradps("train", "--local", out=tmp_path)
    try:
        _until(lambda: _metrics_started(tmp_path), 120, "the local run did not start")
        services = _descendants(cli_process.pid)
        assert len(services) >= 6, services  # coordinator, fork server, 2 shards, 2 workers
        cli_process.send_signal(signal.SIGTERM)
        if again:  # as a second Ctrl-C: once the first service (a shard) is gone, the cluster is stopping
            deadline = time.monotonic() + 30
            while all(_alive(pid) for pid in services) and time.monotonic() < deadline:
                time.sleep(0.01)
            cli_process.send_signal(signal.SIGTERM)
        _, stderr = cli_process.communicate(timeout=60)
        assert cli_process.returncode != 0
        assert "Traceback" not in stderr, stderr[-2000:]
        _until(lambda: not any(_alive(pid) for pid in services), 30, f"services left running: {services}")
    finally:
        if cli_process.poll() is None:
            cli_process.kill()


@pytest.mark.parametrize("interrupt", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_train_stops_its_run(
    cluster: LocalCluster, client: Client, tmp_path: Path, interrupt: int
) -> None:
    cli_process = _gradps("train", "--coordinator", cluster.address, out=tmp_path)
    try:
        _until(lambda: _metrics_started(tmp_path), 60, "the run did not start")
        cli_process.send_signal(interrupt)
        _, stderr = cli_process.communicate(timeout=60)
        assert cli_process.returncode != 0
        assert "stopped run" in stderr, stderr[-2000:]
        run = next(r for r in client.runs() if r.state != cpb.RUN_STATE_COMPLETED and r.run_id in stderr)
        assert run.state == cpb.RUN_STATE_STOPPED, run
    finally:
        if cli_process.poll() is None:
            cli_process.kill()


def test_services_refuse_bad_flags_in_one_line(tmp_path: Path) -> None:
    busy = socket.socket(socket.AF_INET6)
    busy.bind(("::", 0))
    busy.listen()
    in_use = str(busy.getsockname()[1])
    cases = [
        (["ps_server.coordinator", "--port", "70000"], "70000 is not in the range 0<=x<=65535"),
        (["ps_server.coordinator", "--port", in_use], f"--port {in_use}: cannot bind port {in_use}"),
        (["ps_server.shard", "--coordinator", "127.0.0.1:1", "--log-level", "BOGUS"], "'BOGUS' is not one of"),
        (["ps_server.shard", "--coordinator", "127.0.0.1:1", "--port-file", "/proc/x/p"], "cannot write a file in"),
        (["gpu_worker.service", "--coordinator", "127.0.0.1:1", "--threads", "0"], "0 is not in the range x>=1"),
    ]
    try:
        started = [  # at once: each takes a second or two to start
            (subprocess.Popen([sys.executable, "-m", *args], stderr=subprocess.PIPE, text=True), args, words)
            for args, words in cases
        ]
        for p, args, words in started:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 2, (args, err)
            assert err.strip().splitlines()[-1].endswith(words) or words in err, (args, err)
            assert "Traceback" not in err, (args, err)
    finally:
        busy.close()


def test_a_worker_waiting_to_join_stops_on_sigterm() -> None:
    worker = subprocess.Popen(
        [sys.executable, "-m", "gpu_worker.service", "--coordinator", "127.0.0.1:1"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert worker.stderr is not None
    try:
        # It says why nothing happens, then gives up on SIGTERM rather than after its 60 s of retries.
        line = worker.stderr.readline()
        while "retrying" not in line:
            assert line, "the worker exited without saying it retries"
            line = worker.stderr.readline()
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=10)
        assert "stopped before joining the coordinator at 127.0.0.1:1" in stderr, stderr
        assert "Traceback" not in stderr
    finally:
        if worker.poll() is None:
            worker.kill()


# tgkill(2): a signal to one thread of another process (Python sends only to its own threads).
_TGKILL = {"x86_64": 234, "aarch64": 131}


@pytest.mark.skipif(platform.machine() not in _TGKILL, reason="tgkill's number known for x86_64 and aarch64")
def test_the_services_stop_on_sigterm_delivered_to_any_of_their_threads(tmp_path: Path) -> None:
    # The kernel hands a process's signal to whichever thread it likes; Python runs the handler
    # only on its main thread, which a service keeps blocked until it is told to stop.
    services = Services(tmp_path)
    try:
        services.start_coordinator()
        services.add_shard()
        libc = ctypes.CDLL(None, use_errno=True)
        for process in (services.shards[0], services.coordinator):
            assert process is not None
            others = [int(t) for t in os.listdir(f"/proc/{process.pid}/task") if int(t) != process.pid]
            assert libc.syscall(_TGKILL[platform.machine()], process.pid, others[-1], signal.SIGTERM) == 0
            assert process.wait(timeout=15) == 0
    finally:
        services.stop()


def test_a_local_service_that_does_not_stop_cleanly_is_named_with_the_end_of_its_log(caplog, monkeypatch) -> None:
    monkeypatch.setenv("GRADPS_LOG_LEVEL", "INFO")
    cluster = LocalCluster(shards=1, workers=0).start()
    shard = cluster.shards[0]
    shard.send_signal(signal.SIGSTOP)  # deaf to SIGTERM: killed once the grace is over
    with caplog.at_level("WARNING", logger="gradps.local_cluster"):
        codes = cluster.stop(grace_s=1.0)
    assert codes == [-signal.SIGKILL, 0], codes  # the shard, then the coordinator
    (record,) = [r for r in caplog.records if r.name == "gradps.local_cluster"]
    assert record.getMessage().startswith("local cluster: shard-0 did not stop within 1 s of SIGTERM and was killed;")
    assert "shard 0 serving on port" in record.getMessage()  # the end of its log


def test_a_local_service_that_refuses_to_start_is_named_with_its_refusal() -> None:
    with LocalCluster(shards=1, workers=0) as cluster:
        taken = int(cluster.address.rsplit(":", 1)[1])  # the coordinator's
        with pytest.raises(GradpsError) as refused:
            cluster.add_shard(1, port=taken)
    message = str(refused.value)
    assert message.startswith(f"shard-1 exited at start-up (Error: --port {taken}: cannot bind port {taken}"), message


def test_up_serves_on_its_port_and_says_how_the_other_commands_find_it(tmp_path: Path) -> None:
    port = free_ports(1)[0]  # a port free now, as a user would pick one
    args = ["up", "--port", str(port), "--shards", "1", "--workers", "0", "--state-dir", str(tmp_path / "state")]
    env = {k: v for k, v in os.environ.items() if k != "GRADPS_COORDINATOR"}
    up = subprocess.Popen(
        [sys.executable, "-m", "client.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert up.stdout is not None
        printed = [up.stdout.readline() for _ in range(3)]
        export = f"export GRADPS_COORDINATOR=127.0.0.1:{port}"
        assert any(line.strip().startswith(export) for line in printed), printed
        status = subprocess.run(
            [sys.executable, "-m", "client.cli", "status"],
            capture_output=True,
            text=True,
            env={**env, "GRADPS_COORDINATOR": f"127.0.0.1:{port}"},
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert f"coordinator 127.0.0.1:{port}: 1 live shard" in status.stdout, status.stdout
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=60)
        assert up.returncode == 0
    finally:
        if up.poll() is None:
            up.kill()


def test_up_started_in_the_background_stops_on_sigint_and_logs_in_its_state_dir(tmp_path: Path) -> None:
    # A shell starts a background job with SIGINT ignored; `gradps up` must still stop on it.
    state, cwd = tmp_path / "state", tmp_path / "cwd"
    cwd.mkdir()
    args = ["up", "--port", "0", "--shards", "1", "--workers", "0", "--state-dir", str(state)]
    up = subprocess.Popen(
        [sys.executable, "-c", "import sys; from client.cli import cli; cli(sys.argv[1:])", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert up.stdout is not None
        printed = [up.stdout.readline() for _ in range(2)]
        assert printed[0].startswith("coordinator at 127.0.0.1:"), printed
        assert f"the services' logs in {state / 'logs'}" in printed[1], printed
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=60)
        assert up.returncode == 0
        assert (state / "logs" / "coordinator.log").exists() and not any(cwd.iterdir())
    finally:
        if up.poll() is None:
            up.kill()


def test_a_table_piped_out_keeps_every_cell_whole(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    table = Table("run", "state", "scheme", "model", "workers", "steps", "test acc", "message")
    table.add_row("20261206-201956-e3b4", "completed", "wagma", "mlp", "2", "100", "0.8167", "")
    Console().print(table)  # rich's own guess for a pipe: 80 columns, cells cut
    assert "…" in capsys.readouterr().out
    table_console().print(table)
    piped = capsys.readouterr().out
    assert "completed" in piped and "0.8167" in piped and "…" not in piped, piped
    monkeypatch.setenv("COLUMNS", "100")  # a width the user asks for wins
    assert table_console().width == 100


def test_a_run_option_is_unread_only_where_no_chosen_scheme_or_setting_reads_it() -> None:
    reads_all = {"schedule": "step", "optimizer": "sgd", "dataset": "synthetic-images"}
    assert unread_run_options(reads_all, list(SCHEMES)) == {}
    assert set(unread_run_options(reads_all, ["wagma"])) == set(PARAMS) - {"group_size", "tau"}
    assert "n_push" in unread_run_options(reads_all, ["sync", "ssp"])
    assert "staleness_lr" not in unread_run_options(reads_all, ["sync", "ssp"])  # ssp reads it
    plain = unread_run_options({"schedule": "cosine", "optimizer": "adamw", "dataset": "digits"}, list(SCHEMES))
    assert plain == {
        "step_size": "--schedule step only",
        "gamma": "--schedule step only",
        "momentum": "--optimizer sgd only",
        "nesterov": "--optimizer sgd only",
        "dataset_size": "digits has a fixed size",
    }


def test_train_help_is_sectioned_common_options_first_without_wire_bounds() -> None:
    text = CliRunner().invoke(cli, ["train", "--help"], terminal_width=100).output
    titles = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert titles[:4] == ["Run", "Compression", "Output", "Cluster"], titles
    assert "Scheme parameters (each names the schemes it applies to)" in titles
    run = text.split("Run:")[1].split("Compression:")[0]
    for option in ("--scheme", "--workers", "--model", "--dataset", "--lr", "--steps"):
        assert option in run, option
    # Every option shows up exactly once, and no bound is a protobuf integer's width.
    for option in ("--codec", "--tau", "--straggler", "--part-size", "--coordinator"):
        assert text.count(f"  {option} ") == 1, option
    assert "18446744073709551615" not in text and "4294967295" not in text and "RANGE" not in text


@pytest.mark.slow
def test_a_local_run_keeps_the_services_logs_in_its_own_folder(tmp_path: Path) -> None:
    args = ["train", "--local", "--steps", "5", "--eval-every", "0", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "GRADPS_COORDINATOR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent.parent), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = (tmp_path / "runs").iterdir()  # the run's folder alone: no logs folder beside it
    assert (run / "summary.json").exists()
    logs = sorted(p.name for p in (run / "logs").iterdir())
    assert logs == ["coordinator.log", "shard-0.log", "shard-1.log", "worker-0.log", "worker-1.log"], logs
