"""`gradps launch`: your own training script as the workers of one run, as torchrun starts a
DDP script. The launcher starts a local cluster without workers of its own (or joins one with
--coordinator), runs the script as N processes, submits the run once every script wrapped its
torch optimizer, follows it, and writes the final model (parameters and buffers) to model.pt.
What the launcher and the scripts exchange: gradps/launching.py; the script's side:
gpu_worker/launched.py."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import click

from client.local_cluster import LocalCluster
from client.report import follow, print_summary
from client.sdk import Client, GradpsError
from client.stopping import terminate
from client.unread_options import LOCAL_OPTIONS, refuse_unread, unread_run_options
from client.usage import make_dir, one_line_errors
from gradps.auth import tls
from gradps.auth.client_tokens import write_private_file
from gradps.auth.tokens import TOKEN_ENV, TOKEN_FILE_ENV, WORKER
from gradps.device import DEVICES, resolve_option
from gradps.launching import (
    COORDINATOR_ENV,
    LAUNCH_DIR_ENV,
    RANK_ENV,
    TRANSPORT_ENV,
    WORLD_SIZE_ENV,
    buffers_file,
    read_json,
    ready_file,
    run_file,
    worker_file,
    write_json,
)
from gradps.run_spec import validate, with_defaults
from gradps.schemes import DEFAULT_SCHEME, SCHEMES
from gradps.transport import TRANSPORTS
from gradps.v1 import run_pb2

# Run options the script itself defines: its model, data, batches and torch optimizer.
_SCRIPT_OWNS = frozenset(
    {"model", "dataset", "dataset_size", "batch_size", "optimizer", "lr", "momentum", "nesterov", "weight_decay"}
)
# OptimizerSpec fields that come from the script's torch optimizer (the schedule is the launcher's).
_FROM_TORCH = ("name", "lr", "momentum", "nesterov", "weight_decay", "beta1", "beta2", "eps")
# Lines of each script's output kept to say why it failed.
_TAIL_LINES = 20
# After a failed or stopped run, how long the scripts get to exit on their own.
_EXIT_GRACE_S = 10.0
_POLL_S = 0.05


class Scripts:
    """The user's script as `world` processes, each with its rank in its environment; their output
    is relayed line by line, prefixed with the rank."""

    def __init__(self, script: Path, args: tuple[str, ...], world: int, env: dict[str, str]) -> None:
        self.script, self.args, self.world, self.env = script, args, world, env
        self.processes: list[subprocess.Popen] = []
        self._tails: list[collections.deque[str]] = []
        self._relays: list[threading.Thread] = []

    def start(self) -> None:
        for rank in range(self.world):
            env = {**self.env, RANK_ENV: str(rank), WORLD_SIZE_ENV: str(self.world)}
            p = subprocess.Popen(
                [sys.executable, str(self.script), *self.args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the launcher, which stops them in order
            )
            self.processes.append(p)
            self._tails.append(collections.deque(maxlen=_TAIL_LINES))
            relay = threading.Thread(target=self._relay, args=(rank, p.stdout, self._tails[rank]), daemon=True)
            relay.start()
            self._relays.append(relay)

    def _relay(self, rank: int, stream: IO[bytes], tail: collections.deque[str]) -> None:
        prefix = f"[rank {rank}] " if self.world > 1 else ""
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            tail.append(line)
            sys.stdout.write(f"{prefix}{line}\n")  # looked up each time: a live display redirects it
            sys.stdout.flush()

    def failure(self) -> str | None:
        """'rank R exited with code C: its last line' for the first script that failed, else None."""
        for rank, p in enumerate(self.processes):
            code = p.poll()
            if code is not None and code != 0:
                return self.describe(rank, code)
        return None

    def describe(self, rank: int, code: int) -> str:
        self._relays[rank].join(timeout=2.0)  # its last lines
        last = next((line for line in reversed(self._tails[rank]) if line.strip()), "")
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        # A gradps refusal in the script is one line already, "gradps: ...".
        return f"rank {rank} {how}" + (f": {last.strip().removeprefix('gradps: ')}" if last else "")

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for every script to exit; False when some still run after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for p in self.processes:
            try:
                p.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the scripts still running, SIGKILL those left after `grace_s`."""
        terminate(self.processes, grace_s)


class _Watch(threading.Thread):
    """While the run goes: stop it as soon as a script fails, or when the cluster gave it workers
    that are not the scripts (a joined cluster with idle workers of its own)."""

    def __init__(self, client: Client, run_id: str, scripts: Scripts, worker_ids: set[int]) -> None:
        super().__init__(name="launch-watch", daemon=True)
        self.client, self.run_id, self.scripts, self.worker_ids = client, run_id, scripts, worker_ids
        self.problem: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        checked = False
        while not self.done.wait(0.2):
            self.problem = self.scripts.failure()  # the first seen: the others may follow from it
            if not checked and self.problem is None:
                try:
                    workers = set(self.client.run(self.run_id).run.workers)
                except GradpsError:  # a coordinator that does not answer now: follow() reports it
                    continue
                checked = bool(workers)
                if workers and workers != self.worker_ids:
                    self.problem = (
                        f"the cluster at {self.client.address} gave the run workers {sorted(workers)}, not this "
                        f"launch's {sorted(self.worker_ids)}: launch on a cluster of its own (gradps up --workers 0)"
                    )
            if self.problem is not None:
                try:
                    self.client.stop(self.run_id)
                except GradpsError:
                    pass  # it ended meanwhile
                return


def launch_command(spec_options: Callable[[Any], Any], build_spec: Callable[..., run_pb2.RunSpec]) -> click.Command:
    """The `gradps launch` command, with `gradps train`'s run options (client.cli passes its
    `spec_options` and `build_spec`: this module does not import the CLI that registers it) less
    those the script defines (its model, data, batches and torch optimizer)."""

    def script_spec_options(fn: Any) -> Any:
        fn = spec_options(fn)
        fn.__click_params__ = [p for p in fn.__click_params__ if p.name not in _SCRIPT_OWNS]
        return fn

    @click.command(
        context_settings={
            "help_option_names": ["-h", "--help"],
            "show_default": True,
            "allow_interspersed_args": False,  # everything after SCRIPT is the script's
        }
    )
    @click.option(
        "--workers", "-n", default=2, type=click.IntRange(1, 256), help="Processes of SCRIPT: the run's workers."
    )
    @click.option(
        "--coordinator",
        default=None,
        help="Join this cluster (HOST:PORT) instead of starting a local one; its workers must be the scripts "
        "alone (gradps up --workers 0).",
    )
    @click.option("--shards", default=2, type=click.IntRange(1, 256), help="Local cluster: shard processes.")
    @click.option("--heartbeat-timeout", default=5.0, type=click.FloatRange(min=0.1), help="Local cluster: seconds.")
    @click.option(
        "--device", default="auto", type=click.Choice(DEVICES), help="Local cluster: where the shards compute."
    )
    @click.option(
        "--transport",
        type=click.Choice(TRANSPORTS),
        default="shm",
        help="Where the scripts' payloads travel: shm (shared memory), stream (data streams), grpc (in the messages).",
    )
    @click.option(
        "--scheme",
        default=DEFAULT_SCHEME,
        type=click.Choice(list(SCHEMES)),
        help="Consistency scheme: " + "; ".join(f"{s.name}: {s.summary}" for s in SCHEMES.values()) + ".",
    )
    @script_spec_options
    @click.option(
        "--out",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Run folder (default runs/<run-id>).",
    )
    @click.option("--no-progress", is_flag=True, help="No live progress bar.")
    @click.option(
        "--tls",
        is_flag=True,
        help="Local cluster: every service serves TLS only, with a CA and certificates of the cluster's own "
        "(removed when it stops), which the scripts are given (GRADPS_TLS_*).",
    )
    @click.argument("script", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
    @one_line_errors
    def launch(
        workers: int,
        coordinator: str | None,
        shards: int,
        heartbeat_timeout: float,
        device: str,
        transport: str,
        scheme: str,
        out: Path | None,
        no_progress: bool,
        tls: bool,
        script: Path,
        script_args: tuple[str, ...],
        **options: Any,
    ) -> None:
        """Run SCRIPT [ARGS]... as the --workers of one run, as torchrun does, and follow it.

        \b
        In the script (README.md, "Your own model and loop"):
            import gradps
            gradps.init()
            optimizer = gradps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model,
                                                    test_data=test_dataset)
            for x, y in gradps.batches(loader):   # --steps, or --epochs passes over loader
                optimizer.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step(loss=loss)

        Each script gets GRADPS_COORDINATOR, GRADPS_RANK, GRADPS_WORLD_SIZE (gradps.rank(),
        gradps.world_size(): shard the data by them) and GRADPS_LAUNCH_DIR. The shards apply the
        script's torch optimizer (SGD, Adam or AdamW, from its param groups); the lr schedule is
        --schedule. Writes summary.json, metrics.jsonl and model.pt (the final state_dict with the
        BatchNorm buffers averaged over the ranks: model.load_state_dict(torch.load(path))).
        """
        ctx = click.get_current_context()
        # --transport is also the scripts', whichever cluster they join.
        local_only = [n for n in LOCAL_OPTIONS if n != "transport"] if coordinator else []
        refuse_unread(ctx, dict.fromkeys(local_only, "a local cluster only"))
        refuse_unread(ctx, unread_run_options(options, [scheme]), f"this {scheme} run")
        run_launch(
            build_spec(scheme, workers, **options),
            workers,
            coordinator,
            shards,
            heartbeat_timeout,
            device,
            transport,
            out,
            no_progress,
            script,
            script_args,
            tls,
        )

    return launch


def run_launch(
    spec: run_pb2.RunSpec,
    workers: int,
    coordinator: str | None,
    shards: int,
    heartbeat_timeout: float,
    device: str,
    transport: str,
    out: Path | None,
    no_progress: bool,
    script: Path,
    script_args: tuple[str, ...],
    tls: bool = False,
) -> None:
    """`gradps launch`: the scripts as the workers of the run `spec`, on a local cluster (`tls`:
    TLS only, with certificates of its own) or the one at `coordinator`; ClickException (one line)
    when the run or a script fails."""
    if tls and coordinator:
        raise click.UsageError(
            "--tls starts the local cluster with TLS; for the TLS of the cluster at --coordinator give the "
            "scripts GRADPS_TLS_CA (and GRADPS_TLS_CERT, GRADPS_TLS_KEY)"
        )
    make_dir(out or Path("runs"))
    with tempfile.TemporaryDirectory(prefix="gradps-launch-") as folder:
        launch_dir = Path(folder)
        env = _script_env(launch_dir, transport)
        cluster = None
        if not coordinator:
            # The services' logs go to the run's folder; until the run has an id, beside it.
            log_dir = Path("runs") / f"local-logs-{os.getpid()}" if out is None else out / "logs"
            # Its port chosen now: the scripts start (import torch, load their data) while it starts.
            cluster = LocalCluster(
                shards,
                0,
                heartbeat_timeout,
                log_dir,
                resolve_option(device),
                transport,
                port=_free_port(),
                tls_certs=tls,
            )
            coordinator = f"127.0.0.1:{cluster.port}"
            _local_credentials(env, cluster, launch_dir)
        env[COORDINATOR_ENV] = coordinator
        scripts = Scripts(script, script_args, workers, env)
        scripts.start()
        try:
            with contextlib.ExitStack() as stack:
                if cluster is not None:
                    stack.enter_context(cluster)
                stack.callback(scripts.stop)  # before the cluster stops
                ready_file(launch_dir).touch()  # the scripts may join now
                summary, failure = _launch_on(coordinator, spec, scripts, out, no_progress)
        finally:
            scripts.stop()
    if cluster is not None and out is None:
        cluster.log_dir.rename(Path("runs") / summary["run_id"] / "logs")
    print_summary(summary)
    if summary["state"] != "completed":
        # A failed run says why (a rank's error); a stopped one was stopped for a script's exit.
        reason = summary["message"] if summary["state"] == "failed" and summary["message"] else failure
        raise click.ClickException(f"run {summary['run_id']} {summary['state']}: {reason or summary['message']}")
    if failure:
        raise click.ClickException(failure)


def _script_env(launch_dir: Path, transport: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({LAUNCH_DIR_ENV: str(launch_dir), TRANSPORT_ENV: transport, "PYTHONUNBUFFERED": "1"})
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes share the cores
    return env


def _local_credentials(env: dict[str, str], cluster: LocalCluster, launch_dir: Path) -> None:
    """The scripts join the local cluster with its worker token, and its client certificate where it
    serves TLS: never with the user's settings for another cluster."""
    for key in (TOKEN_ENV, tls.TLS_CERT_ENV, tls.TLS_KEY_ENV, tls.TLS_CA_ENV):
        env.pop(key, None)
    if cluster.client_tls is not None:
        env.update(cluster.client_tls.client_env())
    token = cluster.role_token(WORKER)
    if token:
        path = launch_dir / "worker.token"
        write_private_file(path, token)
        env[TOKEN_FILE_ENV] = str(path)


def _launch_on(
    address: str, spec: run_pb2.RunSpec, scripts: Scripts, out: Path | None, no_progress: bool
) -> tuple[dict[str, Any], str | None]:
    """Submit the run with the scripts' optimizer, follow it, write model.pt; returns the run's
    summary and why a script failed (None: none did)."""
    launch_dir = Path(scripts.env[LAUNCH_DIR_ENV])
    with Client(address) as client:
        worker_ids, optimizer = _wait_for_scripts(scripts, launch_dir)
        for name in _FROM_TORCH:
            setattr(spec.optimizer, name, getattr(optimizer, name))
        spec.script = scripts.script.name  # its model and data are the script's: listings say so
        validate(with_defaults(spec))  # the torch optimizer's numbers with the launcher's schedule
        run_id = client.submit(spec)
        write_json(run_file(launch_dir), {"run_id": run_id})
        out_dir = out or Path("runs") / run_id
        watch = _Watch(client, run_id, scripts, worker_ids)
        watch.start()
        try:
            summary = follow(client, run_id, out_dir, show_progress=not no_progress)
        finally:
            watch.done.set()
        completed = summary["state"] == "completed"
        scripts.wait(None if completed else _EXIT_GRACE_S)
        failure = watch.problem or scripts.failure()
        if completed:
            _write_model(client, run_id, launch_dir, out_dir)
        click.echo(f"wrote {out_dir / 'summary.json'} and {out_dir / 'metrics.jsonl'}", err=True)
        return summary, failure


def _free_port() -> int:
    """A loopback port free now (the local coordinator binds it moments later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for_scripts(scripts: Scripts, launch_dir: Path) -> tuple[set[int], run_pb2.OptimizerSpec]:
    """Every script's worker id and optimizer, once each wrapped it (gradps.DistributedOptimizer);
    a script that exits first, or optimizers that differ, end the launch."""
    from google.protobuf.json_format import ParseDict

    found: dict[int, dict[str, Any]] = {}
    while len(found) < scripts.world:
        for rank, p in enumerate(scripts.processes):
            if rank not in found and (content := read_json(worker_file(launch_dir, rank))) is not None:
                found[rank] = content
            elif rank not in found and (code := p.poll()) is not None:
                if code == 0:
                    raise click.ClickException(f"rank {rank} exited before creating gradps.DistributedOptimizer")
                raise click.ClickException(scripts.describe(rank, code) + " (before the run started)")
        time.sleep(_POLL_S)
    optimizers = [ParseDict(found[r]["optimizer"], run_pb2.OptimizerSpec()) for r in range(scripts.world)]
    for rank, o in enumerate(optimizers):
        if o != optimizers[0]:
            raise click.ClickException(
                f"rank {rank}'s optimizer ({_text(o)}) differs from rank 0's ({_text(optimizers[0])}): "
                "every rank must wrap the same"
            )
    return {int(found[r]["worker_id"]) for r in found}, optimizers[0]


def _text(o: run_pb2.OptimizerSpec) -> str:
    return " ".join(str(o).split())


def _write_model(client: Client, run_id: str, launch_dir: Path, out_dir: Path) -> None:
    """model.pt: the run's parameters from the shards with rank 0's final (averaged) buffers."""
    import torch
    from safetensors.torch import load_file

    state = client.export_state_dict(run_id)
    path = buffers_file(launch_dir)
    if path.exists():
        state.update(load_file(path))
    torch.save(state, out_dir / "model.pt")
    click.echo(f"wrote {out_dir / 'model.pt'}: the final state_dict, {len(state)} tensors", err=True)
