"""The `gradps` command line: train, launch, up, status, runs, scale, checkpoint, checkpoints, stop, delete, export,
compare and bench."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from client.help_sections import SectionedCommand
from client.links import Links
from client.local_cluster import LocalCluster
from client.report import follow, model_of, print_summary
from client.sdk import Client, run_spec
from client.terminal import table_console
from client.unread_options import LOCAL_OPTIONS, RUN_OPTIONS, refuse_unread, unread_run_options
from client.usage import Count, FiniteFloat, make_dir, one_line_errors, output_file, stop_on_sigterm
from gradps import run_figures
from gradps.auth.certs import certs
from gradps.auth.client_tokens import read_token_file
from gradps.auth.options import client_tls_options, use_client_tls
from gradps.auth.tokens import ROLES, SECRET_ENV, SECRET_FILE_ENV, ClusterSecret
from gradps.codec_table import codec_syntax, parse_codec
from gradps.device import device_option, resolve_option
from gradps.divergence import known_to_diverge
from gradps.netem import LAYOUTS, Layout
from gradps.run_spec import default_spec
from gradps.schemes import PARAMS, SCHEMES, Param, schemes_of
from gradps.transport import TRANSPORTS
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import run_pb2, tensor_pb2

_DEFAULTS = default_spec()
F = TypeVar("F", bound=Callable[..., Any])
# The RunSpec's integer fields: a larger value is a usage error naming its option, not protobuf's
# "Value out of range".
UINT32, UINT64 = 2**32 - 1, 2**64 - 1
# Where `gradps up` serves by default, and so where the other commands look unless told.
_DEFAULT_COORDINATOR = "127.0.0.1:50051"
_CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}


def _codec(ctx: click.Context, param: click.Parameter, value: str) -> tensor_pb2.CodecParams:
    try:
        return parse_codec(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _straggler(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, float] | None:
    if not value:
        return None
    try:
        rank, factor = value.split(":")
        parsed = int(rank), float(factor)
    except ValueError:
        raise click.BadParameter(f"expected RANK:FACTOR such as 3:3, got {value!r}") from None
    if parsed[0] < 0 or not 1 <= parsed[1] < float("inf"):
        raise click.BadParameter("rank must be >= 0 and factor a finite number >= 1")
    return parsed


def _checkpoint_every(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, float] | None:
    """--checkpoint-every N (steps) or Ns (seconds): (steps, seconds)."""
    if not value:
        return None
    try:
        every = (0, float(value[:-1])) if value.endswith("s") else (int(value), 0.0)
    except ValueError:
        raise click.BadParameter(f"expected steps (100) or seconds (10s), got {value!r}") from None
    if not 0 < max(every) < float("inf"):
        raise click.BadParameter(f"expected a positive number of steps or seconds, got {value!r}")
    return every


def _scheme_option(param: Param) -> Callable[[F], F]:
    """The option of one SchemeParams field, from its registration."""
    flag, text = "--" + param.name.replace("_", "-"), f"{'/'.join(schemes_of(param))}: {param.help}"
    if param.type is bool:
        return click.option(flag, is_flag=True, default=param.default, help=text)
    if param.type is int:
        kind: click.ParamType = (
            Count(param.low, param.high)
            if param.high in (UINT32, UINT64) and not param.low_open
            else click.IntRange(param.low, param.high, min_open=param.low_open)
        )
    else:
        kind = FiniteFloat(param.low, param.high, min_open=param.low_open)
    return click.option(flag, default=param.default, type=kind, help=text)


def spec_options(fn: F) -> F:
    """The options that define a run, shared by `train` and `compare`; defaults are the SDK's
    (`gradps.run_spec.default_spec`), scheme options come from the scheme registry."""
    d, opt = _DEFAULTS, _DEFAULTS.optimizer
    options = [
        click.option(
            "--model",
            default=d.model,
            help="mlp, cnn, resnet18, transformer or package.module:function (called as fn(dataset), returns a "
            "torch.nn.Module).",
        ),
        click.option(
            "--dataset",
            default=d.dataset,
            help="digits, synthetic-images, synthetic-tokens, synthetic-tokens-varlen or package.module:function "
            "(called as fn(size, seed), returns a gradps.datasets.Dataset).",
        ),
        click.option(
            "--dataset-size", default=0, type=Count(min=0, max=UINT64), help="Samples for synthetic datasets."
        ),
        click.option("--optimizer", default=opt.name, type=click.Choice(["sgd", "adam", "adamw"])),
        click.option("--lr", default=opt.lr, type=FiniteFloat(min=0, min_open=True)),
        click.option("--momentum", default=0.0, type=FiniteFloat(min=0)),
        click.option("--nesterov", is_flag=True),
        click.option("--weight-decay", default=0.0, type=FiniteFloat(min=0)),
        click.option("--schedule", default=opt.schedule, type=click.Choice(["constant", "step", "cosine"])),
        click.option(
            "--step-size",
            default=0,
            type=Count(min=0, max=UINT64),
            help="step schedule: decay the lr every N updates.",
        ),
        click.option(
            "--gamma", default=opt.gamma, type=FiniteFloat(0, 1, min_open=True), help="step schedule: lr factor."
        ),
        click.option("--warmup-steps", default=0, type=Count(min=0, max=UINT64)),
        click.option("--batch-size", default=d.batch_size, type=Count(min=1, max=UINT32)),
        click.option("--steps", default=0, type=Count(min=0, max=UINT64), help="Steps per worker (0: use --epochs)."),
        click.option("--epochs", default=d.epochs, type=FiniteFloat(min=0, min_open=True)),
        click.option("--seed", default=0, type=Count(min=0, max=UINT64)),
        click.option("--codec", default="none", callback=_codec, help=f"Gradient codec: {codec_syntax()}."),
        click.option(
            "--pull-codec", default="none", callback=_codec, help=f"Weights codec: {codec_syntax(pull=True)}."
        ),
        click.option(
            "--eval-every",
            default=d.eval_every,
            type=Count(min=0, max=UINT32),
            help="Evaluate every K steps (0: only at the end).",
        ),
        click.option("--part-size", default=d.part_size, type=Count(min=1, max=UINT64), help="Bytes per part."),
        *(_scheme_option(param) for param in PARAMS.values()),
        click.option(
            "--straggler", default=None, callback=_straggler, help="RANK:FACTOR: that worker is FACTOR times slower."
        ),
        click.option(
            "--jitter", default=0.0, type=FiniteFloat(0, 1), help="Probability that a step takes twice as long."
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def build_spec(scheme: str, workers: int, **o: Any) -> run_pb2.RunSpec:
    """The CLI's options as `client.sdk.run_spec` builds them, checked as the coordinator will
    check them: a bad combination is a usage error now, not after an embedded cluster has started,
    and a setting known to diverge is said in one line before the run starts."""
    straggler = o.pop("straggler", None)
    rank, factor = straggler or (0, 0.0)
    try:
        spec = run_spec(scheme, workers=workers, straggler_rank=rank, straggler_factor=factor, **o)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    for line in known_to_diverge(spec):
        click.echo(f"warning: {line}", err=True)
    return spec


@click.group(context_settings=_CONTEXT)
@client_tls_options
def cli(tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:
    """gradps: a sharded parameter server for data-parallel training."""
    use_client_tls(tls_cert, tls_key, tls_ca)


def _transport_option(fn: F, applies: str = "--local: ") -> F:
    return click.option(
        "--transport",
        type=click.Choice(TRANSPORTS),
        default="shm",
        help=f"{applies}where the workers' payloads travel: shm (shared memory), stream (data streams, as "
        "between hosts), grpc (in the messages).",
    )(fn)


def _allow_import_option(fn: F) -> F:
    return click.option(
        "--allow-import",
        envvar="GRADPS_ALLOW_IMPORT",
        show_envvar=True,
        multiple=True,
        help="--local: a package or module whose models and datasets runs may import (repeatable); "
        "default: only the built-in ones.",
    )(fn)


def _cluster_options(fn: F) -> F:
    fn = _allow_import_option(fn)
    fn = _transport_option(fn)
    fn = device_option("--local: where shards and workers compute (auto: CUDA when present).", resolve=False)(fn)
    fn = click.option("--heartbeat-timeout", default=5.0, type=FiniteFloat(min=0.1), help="--local: seconds.")(fn)
    fn = click.option("--shards", default=2, type=Count(min=1), help="--local: shard processes.")(fn)
    fn = click.option(
        "--local", is_flag=True, help="Start an embedded cluster of local processes (compare: the default)."
    )(fn)
    fn = click.option(
        "--coordinator", envvar="GRADPS_COORDINATOR", show_envvar=True, default=None, help="Coordinator HOST:PORT."
    )(fn)
    return fn


_TLS_NOT_LOCAL = (
    "--tls is --local's (an embedded cluster that serves TLS); to reach a cluster in TLS set GRADPS_TLS_CA "
    "(or gradps --tls-ca FILE train ...)"
)


def _local_tls_option(fn: F) -> F:
    return click.option(
        "--tls",
        is_flag=True,
        help="--local: every service serves TLS only, with a CA and certificates of the cluster's own "
        "(removed when it stops); this command's calls check them.",
    )(fn)


@cli.command(cls=SectionedCommand, context_settings=_CONTEXT)
@_cluster_options
@click.option(
    "--scheme",
    default=_DEFAULTS.scheme,
    type=click.Choice(list(SCHEMES)),
    help="Consistency scheme: " + "; ".join(f"{s.name}: {s.summary}" for s in SCHEMES.values()) + ".",
)
@click.option("--workers", default=_DEFAULTS.workers, type=Count(min=1))
@click.option(
    "--until-accuracy",
    type=FiniteFloat(0, 1),
    default=None,
    help="Stop the run at its first evaluation with at least this test accuracy (its final accuracy then); "
    "a run so stopped counts as done.",
)
@spec_options
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path), default=None, help="Run folder (default runs/<run-id>)."
)
@click.option(
    "--tensorboard",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also write TensorBoard event files here (`tensorboard --logdir DIR`): loss, test accuracy, "
    "samples/s, staleness, wait fraction.",
)
@click.option("--no-progress", is_flag=True, help="No live progress bar.")
@click.option(
    "--checkpoint-every",
    default=None,
    callback=_checkpoint_every,
    help="Shards with a --state-dir checkpoint the run every N steps (100) or seconds (10s).",
)
@_local_tls_option
@click.option(
    "--resume",
    metavar="RUN",
    default=None,
    help="Take up the failed or stopped run RUN again, on the cluster that ran it (--coordinator), from its "
    "newest step checkpointed on every shard; it keeps its own spec (run options are refused).",
)
@one_line_errors
def train(
    coordinator: str | None,
    local: bool,
    shards: int,
    heartbeat_timeout: float,
    device: str,
    transport: str,
    allow_import: tuple[str, ...],
    scheme: str,
    workers: int,
    until_accuracy: float | None,
    out: Path | None,
    tensorboard: Path | None,
    no_progress: bool,
    checkpoint_every: tuple[int, float] | None,
    tls: bool,
    resume: str | None,
    **options: Any,
) -> None:
    """Train one run and print its summary; writes summary.json and metrics.jsonl."""
    coordinator = _chosen_coordinator(local, coordinator)
    if not local and not coordinator:
        raise click.UsageError("give exactly one of --local or --coordinator HOST:PORT (or GRADPS_COORDINATOR)")
    if tls and not local:
        raise click.UsageError(_TLS_NOT_LOCAL)
    ctx = click.get_current_context()
    # The embedded cluster's shards have no --state-dir: its runs are never checkpointed.
    local_reads_not = {"checkpoint_every": "no checkpoints with --local; gradps up's shards keep them"}
    refuse_unread(ctx, local_reads_not if local else dict.fromkeys(LOCAL_OPTIONS, "--local only"))
    if resume is not None:
        refuse_unread(ctx, dict.fromkeys([*RUN_OPTIONS, *options], "a resumed run keeps its own spec"))
        if local:
            raise click.UsageError(
                "--resume takes up a run on the cluster that ran it (--coordinator): --local keeps none"
            )
        assert coordinator is not None
        with Client(coordinator) as client:
            client.resume(resume)
            summary = _follow(client, resume, out, no_progress, tensorboard, until=until_accuracy)
        _done(summary)
        return
    refuse_unread(ctx, unread_run_options(options, [scheme]), f"this {scheme} run")
    if until_accuracy is not None and options.get("eval_every") == 0:
        raise click.UsageError("--until-accuracy needs evaluations on the way: --eval-every above 0")
    spec = build_spec(scheme, workers, **options)
    if checkpoint_every:
        spec.checkpoint_every_steps, spec.checkpoint_every_seconds = checkpoint_every
    device = resolve_option(device) if local else device  # only the embedded cluster's
    make_dir(out or Path("runs"))  # before a run is submitted that could not write its results
    if local:
        # The services' logs go to the run's folder; until the run has an id, beside it.
        log_dir = Path("runs") / f"local-logs-{os.getpid()}" if out is None else out / "logs"
        with LocalCluster(
            shards, workers, heartbeat_timeout, log_dir, device, transport, allow_import=allow_import, tls_certs=tls
        ) as cluster:
            summary = _train_on(cluster.address, spec, out, no_progress, tensorboard, until_accuracy)
        if out is None:
            log_dir.rename(Path("runs") / summary["run_id"] / "logs")
    else:
        assert coordinator is not None  # exactly one of --local and --coordinator, checked above
        summary = _train_on(coordinator, spec, out, no_progress, tensorboard, until_accuracy)
    _done(summary)


def _done(summary: dict[str, Any]) -> None:
    """Print a followed run's summary; a one-line error unless it completed (or stopped where it
    reached --until-accuracy)."""
    print_summary(summary)
    if summary["state"] != "completed" and summary.get("reached_target_at_step") is None:
        raise click.ClickException(f"run {summary['run_id']} {summary['state']}: {summary['message']}")


def _chosen_coordinator(local: bool, coordinator: str | None) -> str | None:
    """The coordinator a command uses, None for an embedded cluster: an explicit --local wins over
    GRADPS_COORDINATOR; --local and --coordinator both on the command line is a usage error."""
    if not (local and coordinator):
        return coordinator
    if click.get_current_context().get_parameter_source("coordinator") != ParameterSource.ENVIRONMENT:
        raise click.UsageError("give --local or --coordinator HOST:PORT, not both")
    return None


def _train_on(
    address: str,
    spec: run_pb2.RunSpec,
    out: Path | None,
    no_progress: bool,
    tensorboard: Path | None,
    until: float | None,
) -> dict:
    with Client(address) as client:
        alive = sum(w.alive for w in client.cluster().workers)
        if alive < spec.workers:
            click.echo(
                f"the cluster has {_count(alive, 'live worker')}; this run needs {spec.workers} and waits until "
                "they join (Ctrl-C stops it)",
                err=True,
            )
        return _follow(client, client.submit(spec), out, no_progress, tensorboard, until=until)


def _follow(
    client: Client,
    run_id: str,
    out: Path | None,
    no_progress: bool,
    tensorboard: Path | None,
    interrupt_stops: bool = True,
    until: float | None = None,
) -> dict:
    """Follow a run to its end with a progress display; its summary, also written to `out`. An
    interrupt stops the run unless `interrupt_stops` is False; `until`: see `follow`."""
    out_dir = out or Path("runs") / run_id
    board = tensorboard / run_id if tensorboard is not None else None
    summary = follow(client, run_id, out_dir, not no_progress, board, until=until, interrupt_stops=interrupt_stops)
    click.echo(f"wrote {out_dir / 'summary.json'} and {out_dir / 'metrics.jsonl'}", err=True)
    return summary


@cli.command(context_settings=_CONTEXT)
@click.option("--shards", default=2, type=Count(min=1))
@click.option("--workers", default=2, type=Count(min=0), help="0: your own scripts are the workers.")
@click.option("--heartbeat-timeout", default=5.0, type=click.FloatRange(min=0.1))
@device_option("Where shards and workers compute (auto: CUDA when present).")
@functools.partial(_transport_option, applies="")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=lambda: _default_state_dir(),
    show_default="$XDG_STATE_HOME/gradps/up, else ~/.local/state/gradps/up",
    help="Where the coordinator keeps runs: the next `gradps up` with the same folder lists them again.",
)
@_allow_import_option
@click.option(
    "--port",
    default=50051,
    type=click.IntRange(0, 65535),
    help="The coordinator's port on 127.0.0.1, where `gradps status` and the others look by default (0: a free one).",
)
@click.option(
    "--tls",
    is_flag=True,
    help="Every service serves TLS only, with a CA and certificates of the cluster's own, kept in the state "
    "dir (tls/) for the next `gradps up`; prints the GRADPS_TLS_* lines for other shells.",
)
@one_line_errors
def up(
    port: int,
    shards: int,
    workers: int,
    heartbeat_timeout: float,
    device: str,
    transport: str,
    state_dir: Path,
    allow_import: tuple[str, ...],
    tls: bool,
) -> None:
    """Run a local cluster in the foreground until Ctrl-C; its admin token is in a file (0600) that
    lives as long as the cluster. The services log under the state dir (logs/), not the current one."""
    # Started in the background by a shell, SIGINT comes ignored (and Python then leaves it so).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log_dir = state_dir / "logs"
    with LocalCluster(
        shards,
        workers,
        heartbeat_timeout,
        log_dir,
        device,
        transport,
        state_dir,
        allow_import=allow_import,
        port=port,
        tls_certs=tls,
    ) as cluster:
        try:  # Ctrl-C as soon as the first line shows: a clean stop too
            _print_up(cluster, f"{_count(shards, 'shard')}, {_count(workers, 'worker')} on {device}", state_dir)
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            click.echo("stopping")


def _print_up(cluster: LocalCluster, what: str, state_dir: Path) -> None:
    """What `gradps up` says once its cluster runs: where, and what other shells need to reach it."""
    tls = ", TLS only" if cluster.client_tls is not None else ""
    click.echo(f"coordinator at {cluster.address}; {what}{tls}. Ctrl-C stops.")
    click.echo(f"  runs are kept in {state_dir}, the services' logs in {cluster.log_dir}")
    click.echo(f"  export GRADPS_COORDINATOR={cluster.address}   # for train, status, runs, export in other shells")
    if cluster.client_tls is not None:
        tls_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in cluster.client_tls.client_env().items())
        click.echo(f"  export {tls_env}   # and these: its CA, a client certificate")
    click.echo(f"  gradps train --coordinator {cluster.address}")
    if cluster.token_file:  # this user's commands find it by address; others need the file
        click.echo(f"  admin token (0600): {cluster.token_file}")
    if cluster.worker_token_file:
        click.echo(f"  worker token (0600): {cluster.worker_token_file}   # GRADPS_TOKEN_FILE of workers you start")


def _default_state_dir() -> Path:
    """The user's own state folder (XDG), so runs are remembered whatever the current directory."""
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "gradps" / "up"


@cli.command(context_settings=_CONTEXT)
@click.argument("role", type=click.Choice(ROLES))
@click.option(
    "--secret-file",
    envvar=SECRET_FILE_ENV,
    show_envvar=True,
    default=None,
    help=f"File holding the cluster secret (else {SECRET_ENV}).",
)
@one_line_errors
def token(role: str, secret_file: str | None) -> None:
    """Print the token of ROLE (admin for the CLI and SDK, worker for gradps-worker, shard) that the
    cluster secret derives; services holding the secret check it (docs: README, Security)."""
    try:
        text = os.environ.get(SECRET_ENV) or (read_token_file(secret_file) if secret_file else "")
        if not text:
            raise click.UsageError(f"give the cluster secret: {SECRET_ENV} or --secret-file")
        click.echo(ClusterSecret(text).token(role))
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _coordinator_option(fn: F) -> F:
    return click.option(
        "--coordinator",
        envvar="GRADPS_COORDINATOR",
        show_envvar=True,
        default=_DEFAULT_COORDINATOR,
        help="Coordinator HOST:PORT.",
    )(fn)


def _json_option(fn: F) -> F:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print JSON instead (the proto's JSON mapping, field names as in the proto; 64-bit integers as "
        "strings), complete whatever the terminal.",
    )(fn)


def _print_json(**messages: Any) -> None:
    """One JSON object of `messages` (protobuf messages, lists of them, or plain values) on stdout."""
    from google.protobuf.json_format import MessageToDict

    def plain(value: Any) -> Any:
        if isinstance(value, list):
            return [plain(v) for v in value]
        if hasattr(value, "DESCRIPTOR"):
            return MessageToDict(value, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        return value

    click.echo(json.dumps({key: plain(value) for key, value in messages.items()}, indent=2))


@cli.command(context_settings=_CONTEXT)
@_coordinator_option
@_json_option
@one_line_errors
def status(coordinator: str, as_json: bool) -> None:
    """Shards, workers and runs of a cluster."""
    with Client(coordinator) as client:
        cluster = client.cluster()
        runs = client.runs()
    if as_json:
        _print_json(coordinator=coordinator, cluster=cluster, runs=runs)
        return
    # Names and reasons come from the cluster: printed as they are, never as rich markup.
    console = Console(highlight=False)
    live = sum(w.alive for w in cluster.workers)
    console.print(
        f"coordinator {coordinator}: {_count(len(cluster.shards), 'live shard')}, {_count(live, 'live worker')}",
        markup=False,
    )
    for s in cluster.shard_infos:
        state = "alive" if s.alive else "dead"
        console.print(f"  shard {s.shard_index}  {s.address}  {s.device}  {state}", markup=False)
    for w in cluster.workers:
        state = "alive" if w.alive else "dead"
        console.print(f"  worker {w.worker_id}  {w.name}  {w.device}  {state}  {w.run_id or 'idle'}", markup=False)
    active = [r for r in runs if r.state in (cpb.RUN_STATE_PENDING, cpb.RUN_STATE_RUNNING)]
    console.print(f"{_count(len(runs), 'run')}, {len(active)} active")
    for r in runs:
        if r.state == cpb.RUN_STATE_PENDING:
            console.print(f"  run {r.run_id}  pending: {r.pending_reason or 'waiting'}", markup=False)


@cli.command(context_settings=_CONTEXT)
@_coordinator_option
@_json_option
@one_line_errors
def runs(coordinator: str, as_json: bool) -> None:
    """List the runs of a cluster."""
    with Client(coordinator) as client:
        all_runs = client.runs()
    if as_json:
        _print_json(runs=all_runs)
        return
    table = Table("state", "scheme", "model", "workers", "steps", "test acc", "message")
    # The id is what `stop` and `export` take: never cut, whatever the terminal's width.
    table.columns.insert(0, Column("run", no_wrap=True, min_width=max((len(r.run_id) for r in all_runs), default=3)))
    for r in all_runs:
        accuracy = run_figures.latest_test_accuracy(r.latest)
        table.add_row(
            r.run_id,
            cpb.RunState.Name(r.state).removeprefix("RUN_STATE_").lower(),
            r.spec.scheme,
            model_of(r.spec),
            str(r.spec.workers),
            str(run_figures.highest_step(r.latest)),
            f"{accuracy:.4f}" if accuracy is not None else "-",
            # A pending run says what it waits for; an ended one why it failed or stopped.
            Text(r.pending_reason if r.state == cpb.RUN_STATE_PENDING else r.message),
        )
    table_console().print(table)


@cli.command(context_settings=_CONTEXT)
@click.argument("run_id")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where summary.json and metrics.jsonl go (default runs/RUN_ID).",
)
@click.option(
    "--tensorboard",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also write TensorBoard event files here, DIR/RUN_ID.",
)
@click.option("--no-progress", is_flag=True, help="No live progress bar.")
@_coordinator_option
@one_line_errors
def watch(run_id: str, out: Path | None, tensorboard: Path | None, no_progress: bool, coordinator: str) -> None:
    """Follow a run from its start, whoever submitted it: live progress, then its summary, as
    `train` shows its own; writes summary.json and metrics.jsonl. A run that ended is shown at
    once. Ctrl-C leaves the run going on. Exits non-zero unless the run completed."""
    with Client(coordinator) as client:
        client.run(run_id)  # an unknown run: one line, before any folder is made for it
        make_dir(out or Path("runs"))
        summary = _follow(client, run_id, out, no_progress, tensorboard, interrupt_stops=False)
    _done(summary)


@cli.command(context_settings=_CONTEXT)
@click.argument("run_id")
@click.option("--reason", default="", help='Kept as the run\'s message (one line); default "stopped by a client".')
@_coordinator_option
@one_line_errors
def stop(run_id: str, reason: str, coordinator: str) -> None:
    """Stop a run."""
    with Client(coordinator) as client:
        client.stop(run_id, reason)
    click.echo(f"stopped {run_id}")


@cli.command(context_settings=_CONTEXT)
@click.argument("run_id")
@_coordinator_option
@one_line_errors
def checkpoint(run_id: str, coordinator: str) -> None:
    """Have every shard of a run write a checkpoint of it now (shards with a --state-dir); sync
    and pseudosync at the next cut, a few steps ahead, the same step on every shard."""
    with Client(coordinator, timeout_s=600) as client:  # a large model's checkpoint takes a while
        written = client.checkpoint(run_id)
    for c in written:
        click.echo(
            f"shard {c.shard}: checkpoint {c.sequence} at step {c.step}, "
            f"{c.bytes / 1e6:.1f} MB in {c.write_seconds:.2f} s"
        )


@cli.command(context_settings=_CONTEXT)
@click.argument("run_id")
@click.option("--workers", required=True, type=Count(min=1), help="Ranks to train with, 1 to the run's --workers.")
@_coordinator_option
@one_line_errors
def scale(run_id: str, workers: int, coordinator: str) -> None:
    """Train a running run with more or fewer of its ranks' workers: the highest ranks' workers
    leave it, or idle workers take its empty ranks with the current model."""
    with Client(coordinator) as client:
        answer = client.scale(run_id, workers)
    ranks = len(answer.run.workers)
    left = f"; workers {', '.join(map(str, answer.released))} left it" if answer.released else ""
    click.echo(f"run {run_id}: scaled to {workers} of {ranks} ranks{left}")


@cli.command(context_settings=_CONTEXT)
@click.argument("run_id")
@_coordinator_option
@_json_option
@one_line_errors
def checkpoints(run_id: str, coordinator: str, as_json: bool) -> None:
    """List the steps of a run checkpointed on every shard holding its parts, newest last: what
    `export --checkpoint STEP` takes."""
    with Client(coordinator) as client:
        listed = client.checkpoints(run_id)
    if as_json:
        _print_json(run_id=run_id, checkpoints=list(listed.checkpoints), shards=list(listed.shards))
        return
    if not listed.checkpoints:
        click.echo(f"run {run_id}: no step checkpointed on every shard")
    for c in listed.checkpoints:
        shards = ", ".join(f"{s.shard} (checkpoint {s.sequence})" for s in c.shards)
        click.echo(f"step {c.step}: {c.bytes / 1e6:.1f} MB on {shards}")
    if any(set(s.steps) != {c.step for c in listed.checkpoints} for s in listed.shards):
        # asynchronous schemes: shards checkpoint at steps of their own
        for s in listed.shards:
            click.echo(f"  shard {s.shard} also has steps: {', '.join(str(n) for n in s.steps) or 'none'}")


@cli.command(context_settings=_CONTEXT)
@click.argument("run_id")
@_coordinator_option
@one_line_errors
def delete(run_id: str, coordinator: str) -> None:
    """Delete an ended run: its status, metrics and the parameters its shards keep (stop it first)."""
    with Client(coordinator) as client:
        client.delete(run_id)
    click.echo(f"deleted {run_id}")


@cli.command(context_settings=_CONTEXT)
@click.argument("run_id")
@click.option(
    "--out", required=True, type=click.Path(dir_okay=False, path_type=Path), callback=output_file, help="File to write."
)
@click.option(
    "--checkpoint",
    "checkpoint_step",
    type=click.IntRange(0, UINT64),
    default=None,
    metavar="STEP",
    help="The parameters of the run's checkpoint at STEP (`gradps checkpoints RUN` lists them) instead of its "
    "current ones.",
)
@_coordinator_option
@one_line_errors
def export(run_id: str, out: Path, checkpoint_step: int | None, coordinator: str) -> None:
    """Write a run's full state_dict, assembled from all shards, with torch.save."""
    import torch

    with Client(coordinator) as client:
        state = client.export_state_dict(run_id, checkpoint_step)
    torch.save(state, out)
    click.echo(f"wrote {out}: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters")


@cli.command(cls=SectionedCommand, context_settings=_CONTEXT)
@_cluster_options
@click.option("--schemes", default=",".join(SCHEMES), help="Comma-separated schemes, run one after another.")
@click.option("--workers", default=4, type=Count(min=1))
@click.option("--target-accuracy", default=0.95, type=FiniteFloat(0, 1))
@click.option(
    "--until-target",
    is_flag=True,
    help="Stop each run (and the DDP baseline) at its first evaluation reaching --target-accuracy: "
    "times and steps to it are the same, the rest is not trained; final acc is then that evaluation's.",
)
@spec_options
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs") / "compare")
@click.option(
    "--baseline",
    default="none",
    type=click.Choice(("none", "ddp")),
    help="ddp: also train the same run with torch DistributedDataParallel on this machine (--workers "
    "processes, gloo on CPU, nccl on CUDA): one more row, and each scheme's time to target over DDP's.",
)
@click.option(
    "--tensorboard",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also write TensorBoard event files here (`tensorboard --logdir DIR`): loss, test accuracy, "
    "samples/s, staleness, wait fraction; one TensorBoard run per scheme, DIR/<scheme> (DIR/<repeat>/<scheme> "
    "with --repeats).",
)
@click.option(
    "--link",
    default=None,
    metavar="RATE[,hostK=RATE]",
    help="Run the embedded cluster and the DDP baseline on an emulated network: each worker (and DDP "
    "rank) on a host of its own, each host's link capped at RATE both ways, e.g. 1gbit, or "
    "10gbit,host3=1gbit. Needs root; without it, one line says so and the runs go on loopback.",
)
@click.option(
    "--hosts",
    "layout",
    default="colocated",
    type=click.Choice(LAYOUTS),
    help="With --link: colocated, shard k on worker k's host; separate, each shard on a host of its own.",
)
@click.option(
    "--repeats",
    default=1,
    type=Count(min=1),
    metavar="N",
    help="Run the whole comparison N times (the runs of repeat K in OUT/K/): the table "
    'shows medians and ranges, "vs ddp" from each repeat\'s own DDP run, the plot every run.',
)
@click.option("--no-progress", is_flag=True, help="No live progress bars.")
@one_line_errors
def compare(
    coordinator: str | None,
    local: bool,
    shards: int,
    heartbeat_timeout: float,
    device: str,
    transport: str,
    allow_import: tuple[str, ...],
    schemes: str,
    workers: int,
    target_accuracy: float,
    until_target: bool,
    out: Path,
    baseline: str,
    tensorboard: Path | None,
    link: str | None,
    layout: str,
    repeats: int,
    no_progress: bool,
    **o: Any,
) -> None:
    """Run several schemes on the same cluster, data, seed and model; table, JSON, CSV and a plot.

    With --straggler (or --backup-workers B), sync runs twice: plain, and with backup workers
    (B, or 1) as the row sync-backupB."""
    from client.compare import combine_repeats, print_table, run_baseline, with_backup_row, write_outputs

    names = _scheme_names(schemes, out)
    coordinator = _chosen_coordinator(local, coordinator)
    if link and coordinator:
        raise click.UsageError("--link emulates the embedded cluster's hosts: it does not apply with --coordinator")
    ctx = click.get_current_context()
    # --device is also the DDP baseline's, which runs on this machine.
    embedded_only = [n for n in LOCAL_OPTIONS if not (n == "device" and baseline != "none")] if coordinator else []
    refuse_unread(ctx, dict.fromkeys(embedded_only, "--local only") | ({} if link else {"layout": "--link only"}))
    refuse_unread(ctx, unread_run_options(o, names), "these runs")
    if until_target and o.get("eval_every") == 0:
        raise click.UsageError("--until-target needs evaluations on the way: --eval-every above 0")
    hosts = Layout.named(layout, shards, workers)
    try:  # a bad --link: a usage error, before any run
        links = Links([link], hosts.hosts) if link else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--link'") from None
    entries = with_backup_row([(name, build_spec(name, workers, **o)) for name in names], bool(o.get("straggler")))
    # --device is the embedded cluster's, and the baseline's: both run on this machine.
    device = device if coordinator and baseline == "none" else resolve_option(device)
    make_dir(out)
    until = target_accuracy if until_target else None
    repeated = []
    with links if links and Links.available(Console(stderr=True)) else contextlib.nullcontext() as on:
        network = on.network if on else None

        def ddp(at: Path) -> dict[str, Any]:
            return run_baseline(entries[0][1], device, target_accuracy, at, not no_progress, network, until)

        def embedded(logs: Path) -> LocalCluster:
            return LocalCluster(shards, workers, heartbeat_timeout, logs, device, transport,
                                allow_import=allow_import, network=network, layout=hosts)  # fmt: skip

        for number in range(1, repeats + 1):
            # Each repeat is the whole comparison again: its own DDP run, its own embedded cluster.
            if repeats > 1:
                click.echo(f"repeat {number} of {repeats}", err=True)
            here, board = _repeat_dir(out, number, repeats), tensorboard and _repeat_dir(tensorboard, number, repeats)
            rows, title = _compare_repeat(
                coordinator, entries, target_accuracy, until, here, not no_progress, board, workers, shards,
                o, embedded, ddp if baseline != "none" else None,
            )  # fmt: skip
            repeated.append([row | {"repeat": number} for row in rows])
            if network:
                title += f", {link} links ({layout})"
            # After each repeat: an interrupted comparison keeps the figures of the repeats it made.
            combined = combine_repeats(repeated)
            write_outputs(combined, target_accuracy, out, title)
    print_table(combined, target_accuracy)
    click.echo(f"wrote {out / 'compare.json'}, {out / 'compare.csv'} and {out / 'compare.png'}", err=True)


def _scheme_names(schemes: str, out: Path) -> list[str]:
    """compare's --schemes as a list: known schemes, each named once."""
    names = [s.strip() for s in schemes.split(",") if s.strip()]
    hint = "'--schemes'"
    if not names:
        raise click.BadParameter(f"expected one or more of {', '.join(SCHEMES)}", param_hint=hint)
    if unknown := sorted(set(names) - set(SCHEMES)):
        raise click.BadParameter(f"unknown {', '.join(unknown)}; choose from {', '.join(SCHEMES)}", param_hint=hint)
    if len(set(names)) < len(names):
        raise click.BadParameter(f"a scheme is named twice in {schemes!r}: each writes {out}/<scheme>", param_hint=hint)
    return names


def _repeat_dir(path: Path, number: int, repeats: int) -> Path:
    """Where repeat `number` of compare writes under `path`: `path` itself when it is the only one."""
    return path if repeats == 1 else path / str(number)


def _compare_repeat(
    coordinator: str | None,
    entries: list[tuple[str, run_pb2.RunSpec]],
    target_accuracy: float,
    until: float | None,
    out: Path,
    progress: bool,
    tensorboard: Path | None,
    workers: int,
    shards: int,
    o: dict[str, Any],
    embedded: Callable[[Path], LocalCluster],
    baseline: Callable[[Path], dict[str, Any]] | None,
) -> tuple[list[dict[str, Any]], str]:
    """One repeat of compare, its rows and title: the `baseline`'s run first (it is short, and a
    failure shows before the schemes' long runs), then each entry on the cluster at `coordinator`,
    or on an `embedded` one (started here, the same one for every scheme, its logs in OUT/logs);
    each row with its time to target over the baseline's."""
    from client.compare import add_baseline_ratios, run_comparison

    reference = baseline(out) if baseline is not None else None
    if coordinator:
        with Client(coordinator) as client:
            shards = len(client.cluster().shards)
        rows = run_comparison(coordinator, entries, target_accuracy, out, progress, tensorboard, until)
    else:
        with embedded(out / "logs") as cluster:
            rows = run_comparison(cluster.address, entries, target_accuracy, out, progress, tensorboard, until)
    if reference is not None:
        rows.append(reference)
        add_baseline_ratios(rows, reference)
    straggler = o.get("straggler")
    title = f"{o['model']} on {o['dataset']}, {_count(workers, 'worker')}, {_count(shards, 'shard')}" + (
        f", rank {straggler[0]} {straggler[1]:g}x slower" if straggler else ""
    )
    return rows, title


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def main() -> None:
    stop_on_sigterm()
    cli(prog_name="gradps")


from client.bench import bench  # noqa: E402 (the bench group sits apart from the commands above)
from client.launch import launch_command  # noqa: E402

cli.add_command(bench)
cli.add_command(launch_command(spec_options, build_spec))
cli.add_command(certs)

if __name__ == "__main__":
    main()
