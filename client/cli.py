"""The `gradps` command line: train, up, status, runs, stop, delete, export, compare and bench."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from client.ddp_baseline import BASELINES
from client.local_cluster import LocalCluster
from client.report import follow, print_summary
from client.sdk import Client, run_spec
from client.usage import FiniteFloat, make_dir, one_line_errors, output_file, stop_on_sigterm
from gradps.auth.client_tokens import read_token_file
from gradps.auth.tokens import ROLES, SECRET_ENV, SECRET_FILE_ENV, ClusterSecret
from gradps.codecs import codec_syntax, parse_codec
from gradps.device import device_option, resolve_option
from gradps.parameter_client import TRANSPORTS
from gradps.run_spec import default_spec
from gradps.schemes import PARAMS, SCHEMES, Param, schemes_of
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import run_pb2, tensor_pb2

_DEFAULTS = default_spec()
F = TypeVar("F", bound=Callable[..., Any])
# The RunSpec's integer fields: a larger value is a usage error naming its option, not protobuf's
# "Value out of range".
UINT32, UINT64 = 2**32 - 1, 2**64 - 1
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


def _scheme_option(param: Param) -> Callable[[F], F]:
    """The option of one SchemeParams field, from its registration."""
    flag, text = "--" + param.name.replace("_", "-"), f"{'/'.join(schemes_of(param))}: {param.help}"
    if param.type is bool:
        return click.option(flag, is_flag=True, default=param.default, help=text)
    if param.type is int:
        kind: click.ParamType = click.IntRange(param.low, param.high, min_open=param.low_open)
    else:
        kind = FiniteFloat(param.low, param.high, min_open=param.low_open)
    return click.option(flag, default=param.default, type=kind, help=text)


def spec_options(fn: F) -> F:
    """The options that define a run, shared by `train` and `compare`; defaults are the SDK's
    (`gradps.run_spec.default_spec`), scheme options come from the scheme registry."""
    d, opt = _DEFAULTS, _DEFAULTS.optimizer
    options = [
        click.option("--model", default=d.model, help="mlp, cnn, resnet18, transformer or package.module:function."),
        click.option(
            "--dataset", default=d.dataset, help="digits, synthetic-images, synthetic-tokens or an import path."
        ),
        click.option(
            "--dataset-size", default=0, type=click.IntRange(min=0, max=UINT64), help="Samples for synthetic datasets."
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
            type=click.IntRange(min=0, max=UINT64),
            help="step schedule: decay the lr every N updates.",
        ),
        click.option(
            "--gamma", default=opt.gamma, type=FiniteFloat(0, 1, min_open=True), help="step schedule: lr factor."
        ),
        click.option("--warmup-steps", default=0, type=click.IntRange(min=0, max=UINT64)),
        click.option("--batch-size", default=d.batch_size, type=click.IntRange(min=1, max=UINT32)),
        click.option(
            "--steps", default=0, type=click.IntRange(min=0, max=UINT64), help="Steps per worker (0: use --epochs)."
        ),
        click.option("--epochs", default=d.epochs, type=FiniteFloat(min=0, min_open=True)),
        click.option("--seed", default=0, type=click.IntRange(min=0, max=UINT64)),
        click.option("--codec", default="none", callback=_codec, help=f"Gradient codec: {codec_syntax()}."),
        click.option(
            "--pull-codec", default="none", callback=_codec, help=f"Weights codec: {codec_syntax(pull=True)}."
        ),
        click.option(
            "--eval-every",
            default=d.eval_every,
            type=click.IntRange(min=0, max=UINT32),
            help="Evaluate every K steps (0: only at the end).",
        ),
        click.option(
            "--part-size", default=d.part_size, type=click.IntRange(min=1, max=UINT64), help="Bytes per part."
        ),
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
    check them: a bad combination is a usage error now, not after an embedded cluster has started."""
    straggler = o.pop("straggler", None)
    rank, factor = straggler or (0, 0.0)
    try:
        return run_spec(scheme, workers=workers, straggler_rank=rank, straggler_factor=factor, **o)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@click.group(context_settings=_CONTEXT)
def cli() -> None:
    """gradps: a sharded parameter server for data-parallel training."""


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
    fn = click.option("--shards", default=2, type=click.IntRange(min=1), help="--local: shard processes.")(fn)
    fn = click.option(
        "--local", is_flag=True, help="Start an embedded cluster of local processes (compare: the default)."
    )(fn)
    fn = click.option(
        "--coordinator", envvar="GRADPS_COORDINATOR", show_envvar=True, default=None, help="Coordinator HOST:PORT."
    )(fn)
    return fn


@cli.command(context_settings=_CONTEXT)
@_cluster_options
@click.option(
    "--scheme",
    default=_DEFAULTS.scheme,
    type=click.Choice(list(SCHEMES)),
    help="Consistency scheme: " + "; ".join(f"{s.name}: {s.summary}" for s in SCHEMES.values()) + ".",
)
@click.option("--workers", default=_DEFAULTS.workers, type=click.IntRange(min=1))
@spec_options
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path), default=None, help="Run folder (default runs/<run-id>)."
)
@click.option("--no-progress", is_flag=True, help="No live progress bar.")
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
    out: Path | None,
    no_progress: bool,
    **options: Any,
) -> None:
    """Train one run and print its summary; writes summary.json and metrics.jsonl."""
    if local == bool(coordinator):
        env = " (GRADPS_COORDINATOR is set)" if local and os.environ.get("GRADPS_COORDINATOR") else ""
        raise click.UsageError(f"give exactly one of --local or --coordinator HOST:PORT{env}")
    spec = build_spec(scheme, workers, **options)
    device = resolve_option(device) if local else device  # only the embedded cluster's
    make_dir(out or Path("runs"))  # before a run is submitted that could not write its results
    if local:
        log_dir = Path("runs") / "local-logs" if out is None else out / "logs"
        with LocalCluster(
            shards, workers, heartbeat_timeout, log_dir, device, transport, allow_import=allow_import
        ) as cluster:
            summary = _train_on(cluster.address, spec, out, no_progress)
    else:
        assert coordinator is not None  # exactly one of --local and --coordinator, checked above
        summary = _train_on(coordinator, spec, out, no_progress)
    print_summary(summary)
    if summary["state"] != "completed":
        raise click.ClickException(f"run {summary['run_id']} {summary['state']}: {summary['message']}")


def _train_on(address: str, spec: run_pb2.RunSpec, out: Path | None, no_progress: bool) -> dict:
    with Client(address) as client:
        alive = sum(w.alive for w in client.cluster().workers)
        if alive < spec.workers:
            click.echo(
                f"the cluster has {_count(alive, 'live worker')}; this run needs {spec.workers} and waits until "
                "they join (Ctrl-C stops it)",
                err=True,
            )
        run_id = client.submit(spec)
        out_dir = out or Path("runs") / run_id
        summary = follow(client, run_id, out_dir, show_progress=not no_progress)
        click.echo(f"wrote {out_dir / 'summary.json'} and {out_dir / 'metrics.jsonl'}", err=True)
        return summary


@cli.command(context_settings=_CONTEXT)
@click.option("--shards", default=2, type=click.IntRange(min=1))
@click.option("--workers", default=2, type=click.IntRange(min=0), help="0: your own scripts are the workers.")
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
@one_line_errors
def up(
    shards: int,
    workers: int,
    heartbeat_timeout: float,
    device: str,
    transport: str,
    state_dir: Path,
    allow_import: tuple[str, ...],
) -> None:
    """Run a local cluster in the foreground until Ctrl-C; its admin token is in a file (0600) that
    lives as long as the cluster."""
    log_dir = Path("runs") / "local-logs"
    with LocalCluster(
        shards, workers, heartbeat_timeout, log_dir, device, transport, state_dir, allow_import=allow_import
    ) as cluster:
        click.echo(
            f"coordinator at {cluster.address}; {_count(shards, 'shard')}, {_count(workers, 'worker')} on {device}. "
            "Ctrl-C stops."
        )
        click.echo(f"  runs are kept in {state_dir}")
        click.echo(f"  gradps train --coordinator {cluster.address}")
        if cluster.token_file:  # this user's commands find it by address; others need the file
            click.echo(f"  admin token (0600): {cluster.token_file}")
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            click.echo("stopping")


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
        default="127.0.0.1:50051",
        help="Coordinator HOST:PORT.",
    )(fn)


@cli.command(context_settings=_CONTEXT)
@_coordinator_option
@one_line_errors
def status(coordinator: str) -> None:
    """Shards, workers and runs of a cluster."""
    with Client(coordinator) as client:
        cluster = client.cluster()
        runs = client.runs()
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
    console.print(f"{len(runs)} runs, {len(active)} active")
    for r in runs:
        if r.state == cpb.RUN_STATE_PENDING:
            console.print(f"  run {r.run_id}  pending: {r.pending_reason or 'waiting'}", markup=False)


@cli.command(context_settings=_CONTEXT)
@_coordinator_option
@one_line_errors
def runs(coordinator: str) -> None:
    """List the runs of a cluster."""
    with Client(coordinator) as client:
        all_runs = client.runs()
    table = Table("state", "scheme", "model", "workers", "steps", "test acc", "message")
    # The id is what `stop` and `export` take: never cut, whatever the terminal's width.
    table.columns.insert(0, Column("run", no_wrap=True, min_width=max((len(r.run_id) for r in all_runs), default=3)))
    for r in all_runs:
        accuracies = [m.test_accuracy for m in r.latest if m.test_accuracy >= 0]
        table.add_row(
            r.run_id,
            cpb.RunState.Name(r.state).removeprefix("RUN_STATE_").lower(),
            r.spec.scheme,
            r.spec.model,
            str(r.spec.workers),
            str(max((m.step for m in r.latest), default=0)),
            f"{accuracies[-1]:.4f}" if accuracies else "-",
            # A pending run says what it waits for; an ended one why it failed or stopped.
            Text(r.pending_reason if r.state == cpb.RUN_STATE_PENDING else r.message),
        )
    Console().print(table)


@cli.command(context_settings=_CONTEXT)
@click.argument("run_id")
@_coordinator_option
@one_line_errors
def stop(run_id: str, coordinator: str) -> None:
    """Stop a run."""
    with Client(coordinator) as client:
        client.stop(run_id)
    click.echo(f"stopped {run_id}")


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
@_coordinator_option
@one_line_errors
def export(run_id: str, out: Path, coordinator: str) -> None:
    """Write a run's full state_dict, assembled from all shards, with torch.save."""
    import torch

    with Client(coordinator) as client:
        state = client.export_state_dict(run_id)
    torch.save(state, out)
    click.echo(f"wrote {out}: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters")


@cli.command(context_settings=_CONTEXT)
@_cluster_options
@click.option("--schemes", default=",".join(SCHEMES), help="Comma-separated schemes, run one after another.")
@click.option("--workers", default=4, type=click.IntRange(min=1))
@click.option("--target-accuracy", default=0.95, type=FiniteFloat(0, 1))
@spec_options
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs") / "compare")
@click.option(
    "--baseline",
    default="none",
    type=click.Choice(BASELINES),
    help="ddp: also train the same run with torch DistributedDataParallel on this machine (--workers "
    "processes, gloo on CPU, nccl on CUDA): one more row, and each scheme's time to target over DDP's.",
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
    out: Path,
    baseline: str,
    no_progress: bool,
    **o: Any,
) -> None:
    """Run several schemes on the same cluster, data, seed and model; table, JSON, CSV and a plot.

    With --straggler (or --backup-workers B), sync runs twice: plain, and with backup workers
    (B, or 1) as the row sync-backupB."""
    from client.compare import (
        add_baseline_ratios,
        print_table,
        run_baseline,
        run_comparison,
        with_backup_row,
        write_outputs,
    )

    names = [s.strip() for s in schemes.split(",") if s.strip()]
    hint = "'--schemes'"
    if not names:
        raise click.BadParameter(f"expected one or more of {', '.join(SCHEMES)}", param_hint=hint)
    if unknown := sorted(set(names) - set(SCHEMES)):
        raise click.BadParameter(f"unknown {', '.join(unknown)}; choose from {', '.join(SCHEMES)}", param_hint=hint)
    if len(set(names)) < len(names):
        raise click.BadParameter(f"a scheme is named twice in {schemes!r}: each writes {out}/<scheme>", param_hint=hint)
    if coordinator and local:
        raise click.UsageError("give --local or --coordinator HOST:PORT, not both")
    entries = with_backup_row([(name, build_spec(name, workers, **o)) for name in names], bool(o.get("straggler")))
    # --device is the embedded cluster's, and the baseline's: both run on this machine.
    device = device if coordinator and baseline == "none" else resolve_option(device)
    make_dir(out)
    # The baseline first: it is short, and a failure shows before the schemes' long runs.
    first = entries[0][1]
    reference = run_baseline(first, device, target_accuracy, out, not no_progress) if baseline != "none" else None
    if coordinator:
        with Client(coordinator) as client:
            shards = len(client.cluster().shards)
    straggler = o.get("straggler")
    title = f"{o['model']} on {o['dataset']}, {_count(workers, 'worker')}, {_count(shards, 'shard')}" + (
        f", rank {straggler[0]} {straggler[1]:g}x slower" if straggler else ""
    )
    if coordinator:
        rows = run_comparison(coordinator, entries, target_accuracy, out, show_progress=not no_progress)
    else:  # the default: an embedded cluster, the same one for every scheme
        with LocalCluster(
            shards, workers, heartbeat_timeout, out / "logs", device, transport, allow_import=allow_import
        ) as cluster:
            rows = run_comparison(cluster.address, entries, target_accuracy, out, show_progress=not no_progress)
    if reference is not None:
        rows.append(reference)
        add_baseline_ratios(rows, reference)
    write_outputs(rows, target_accuracy, out, title)
    print_table(rows, target_accuracy)
    click.echo(f"wrote {out / 'compare.json'}, {out / 'compare.csv'} and {out / 'compare.png'}", err=True)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def main() -> None:
    stop_on_sigterm()
    cli(prog_name="gradps")


from client.bench import bench  # noqa: E402 (the bench group sits apart from the commands above)

cli.add_command(bench)

if __name__ == "__main__":
    main()
