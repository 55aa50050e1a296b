"""`gradps bench transport`: push + pull of a parameter set through real shard processes, beside
raw loopback TCP and torch gloo all_reduce of the same bytes, measured in one invocation."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from client.bench.display import ProgressLine, short_rows
from client.bench.link_plot import plot_links
from client.bench.options import (
    COLOCATED,
    json_option,
    parse_choices,
    parse_codecs,
    parse_counts,
    parse_list,
    transport_option,
    write_json,
)
from client.bench.plot import check_path, plot_transport
from client.bench.references import GlooReference, TcpReference
from client.bench.workers import BenchWorkers, Job, submit_run
from client.links import Links
from client.local_cluster import LocalCluster
from client.terminal import table_console
from client.unread_options import refuse_unread
from client.usage import one_line_errors, output_file
from gradps.device import device_option
from gradps.netem import LAYOUTS, Layout, parse_links
from gradps.placement import DEFAULT_PART_SIZE
from gradps.transport import TRANSPORTS

MiB = 1 << 20
# By default a round moves at least this many bytes per worker (small sizes repeat in a round).
ROUND_MIB = 32.0


@dataclass
class Row:
    """One measured configuration. Times are medians over rounds, per iteration."""

    # push_pull: each worker pushes a gradient (asgd) and pulls the weights; sync_step: each
    # worker pushes step t's gradient and pulls the weights of step t + 1 (sync).
    op: str
    size_mib: float
    shards: int
    workers: int
    codec: str
    # Where payloads travel: "shm" (shared memory; the calls still go through gRPC), "stream"
    # (data streams), "grpc", or "colocated" (each worker shares memory with one shard and streams
    # to the others; see client/bench/options.py).
    transport: str
    # Every connection (gRPC and data streams) in TLS (`--tls`); the references never are.
    tls: bool
    # Every process serves Prometheus metrics and counts each call (`--metrics`).
    metrics: bool
    # Where the workers' tensors and the shards' parts live ("cuda": payloads cross the PCIe bus
    # too; the TCP and gloo references stay on the host).
    device: str
    part_mib: float
    # Seconds per iteration (push + pull) with all workers running at once.
    seconds: float
    # Bytes of fp32 parameters moved per second over all workers: workers * 2 * size / seconds.
    gbps: float
    # Raw loopback TCP, the same bytes out and back between two processes: 2 * size / seconds.
    tcp_gbps: float
    ratio_vs_tcp: float
    # gloo all_reduce of the same tensor between `workers` processes (None for one worker).
    gloo_seconds: float | None
    # seconds / gloo_seconds: below 1 is faster than gloo.
    ratio_vs_gloo: float | None
    # Fastest round, for a noisy machine.
    seconds_min: float
    rounds: int
    # Per worker and iteration, summed over shard threads: client-side encode/decode seconds.
    encode_s: float
    decode_s: float
    # On an emulated network (`--link`): its setting, e.g. "10gbit"; `transport` is then the
    # layout, "colocated" or "separate" (shared memory within a host, data streams between
    # hosts), and the references run between hosts too. None: loopback.
    link: str | None = None
    # Pull codec: what the weights travel in ("none": float32).
    pull_codec: str = "none"


def _iters(size: int, round_bytes: float) -> int:
    return max(1, math.ceil(round_bytes / size))


def measure_transport(
    sizes_mib: list[float],
    shards_list: list[int],
    workers_list: list[int],
    codecs: list[str],
    transports: Sequence[str] = TRANSPORTS,
    rounds: int = 5,
    warmup: int = 2,
    part_size: int = DEFAULT_PART_SIZE,
    round_mib: float = ROUND_MIB,
    device: str = "cpu",
    console: Console | None = None,
    tls_modes: Sequence[bool] = (False,),
    metrics_modes: Sequence[bool] = (False,),
    links: Sequence[str] = (),
    layouts: Sequence[str] = ("colocated",),
    pull_codecs: Sequence[str] = ("none",),
) -> list[Row]:
    """Every (op, size, shards, workers, codec) combination, on a plaintext cluster and/or one in
    TLS (`tls_modes`), serving no metrics and/or counting every call for Prometheus
    (`metrics_modes`). Each gRPC round runs right after a TCP round and (for two or more workers)
    a gloo round of the same size, so that the ratios compare measurements taken under the same
    load. `codecs` and `pull_codecs`: every pair of a push codec and a pull codec.

    `links`: on an emulated network instead of loopback, measured at each of these link settings
    (e.g. "10gbit", "10gbit,host1=1gbit"), the processes placed on hosts as each of `layouts`
    says; payloads then take shared memory within a host and data streams between hosts, whatever
    `transports` says. This process moves onto host 0 for good."""
    ops = [("push_pull", w) for w in workers_list] + [("sync_step", w) for w in workers_list if w > 1]
    if links:
        transports, hosts = ["shm"], _hosts_needed(max(shards_list), max(workers_list), layouts)
        network: Links | None = Links(links, hosts)
    else:
        network, layouts = None, [""]
    rows: list[Row] = []
    # The progress line counts every configuration: each push codec with each pull codec.
    codecs = [f"{push}/{pull}" if pull != "none" else push for push in codecs for pull in pull_codecs]
    configurations = len(shards_list) * len(ops) * len(codecs) * len(transports) * len(sizes_mib)
    configurations *= len(tls_modes) * len(metrics_modes) * len(layouts) * max(1, len(links))
    progress = ProgressLine(console, configurations, "starting the references (TCP echo, gloo)")
    with ExitStack() as outer:
        if network:
            outer.enter_context(network)
        outer.enter_context(progress)
        tcp = TcpReference(network.host(1) if network else None)
        outer.callback(tcp.close)
        glooes = {}
        for w in sorted({w for w in workers_list if w > 1}):
            glooes[w] = GlooReference(w, hosts=[network.host(r) for r in range(w)] if network else None)
            outer.callback(glooes[w].close)
        settings = range(len(links)) if network else [None]
        for n_shards in shards_list:
            with ExitStack() as stack:
                # One cluster per mode, side by side: each configuration is measured on each at once.
                modes = itertools.product(tls_modes, metrics_modes, layouts)
                clusters = [
                    _cluster(stack, n_shards, max(workers_list), device, *mode, network=network) for mode in modes
                ]
                for (op, w), codec, transport, size_mib in itertools.product(ops, codecs, transports, sizes_mib):
                    for setting, ((tls, counted, layout), cluster, bench_workers) in itertools.product(
                        settings, clusters
                    ):
                        link = network.use(setting) if network and setting is not None else None
                        shape = f"{n_shards} shard{'s' * (n_shards > 1)}, {w} worker{'s' * (w > 1)}"
                        via = _via(layout or transport, tls, counted, link)
                        progress.measuring(f"{op} {size_mib:g} MiB, {shape}, {codec}, {via}")
                        row = _measure_one(
                            bench_workers,
                            cluster.address,
                            tcp,
                            glooes.get(w),
                            op,
                            size_mib,
                            n_shards,
                            w,
                            codec,
                            transport,
                            tls,
                            counted,
                            rounds,
                            warmup,
                            part_size,
                            round_mib,
                            device,
                        )  # fmt: skip
                        if link:
                            row.transport, row.link = layout, link
                        rows.append(row)
                        progress.done()
    return rows


def _via(transport: str, tls: bool, counted: bool, link: str | None) -> str:
    """How a configuration's payloads travel, for the progress line."""
    return f"{transport}{' in TLS' if tls else ''}{' counted' if counted else ''}{f' at {link}' if link else ''}"


def _hosts_needed(shards: int, workers: int, layouts: Sequence[str]) -> int:
    """Hosts for the largest cluster of every layout, and the references (gloo: a host per rank;
    TCP: two)."""
    return max(2, workers, *(Layout.named(name, shards, workers).hosts for name in layouts))


def _cluster(
    stack: ExitStack,
    shards: int,
    workers: int,
    device: str,
    tls: bool,
    counted: bool,
    layout: str,
    network: Links | None = None,
) -> tuple[tuple[bool, bool, str], LocalCluster, BenchWorkers]:
    """A local cluster (in TLS, with a CA of its own: `tls`; serving Prometheus metrics: `counted`;
    on `network`'s hosts as `layout` places them) and its bench workers, closed with `stack`."""
    placed = Layout.named(layout, shards, workers) if network else None
    cluster = LocalCluster(
        shards=shards,
        workers=0,
        device=device,
        tls_certs=tls,
        metrics=counted,
        network=network.network if network else None,
        layout=placed,
    )
    stack.enter_context(cluster)
    hosts = [network.host(k) for k in placed.workers] if network and placed else None
    workers_ = BenchWorkers(cluster.address, workers, tls=cluster.client_tls, metrics=counted, hosts=hosts)
    return (tls, counted, layout), cluster, stack.enter_context(workers_)


def _measure_one(
    bench_workers: BenchWorkers,
    address: str,
    tcp: TcpReference,
    gloo: GlooReference | None,
    op: str,
    size_mib: float,
    shards: int,
    workers: int,
    codec: str,
    transport: str,
    tls: bool,
    counted: bool,
    rounds: int,
    warmup: int,
    part_size: int,
    round_mib: float,
    device: str,
) -> Row:
    size = int(size_mib * MiB)
    n = _iters(size, round_mib * MiB)
    codec, _, pull_codec = codec.partition("/")
    pull_codec = pull_codec or "none"
    run_id = submit_run(address, op, workers, codec, part_size, warmup + rounds * n)
    job = Job(run_id, op, size_mib, codec, warmup, rounds, n, transport, device, pull_codec)
    bench_workers.start(job, workers)
    grpc_s, tcp_s, gloo_s = [], [], []
    for _ in range(rounds):
        tcp_s.append(tcp.round(size, n))
        if gloo is not None:
            gloo_s.append(gloo.round(size, n))
        grpc_s.append(bench_workers.round() / n)
    traffic = bench_workers.finish()
    calls = warmup + rounds * n
    seconds, tcp_seconds = statistics.median(grpc_s), statistics.median(tcp_s)
    gloo_seconds = statistics.median(gloo_s) if gloo_s else None
    moved = workers * 2 * size
    return Row(
        op=op,
        size_mib=size_mib,
        shards=shards,
        workers=workers,
        codec=codec,
        pull_codec=pull_codec,
        transport=transport,
        tls=tls,
        metrics=counted,
        device=device,
        part_mib=part_size / MiB,
        seconds=seconds,
        gbps=moved / seconds / 1e9,
        tcp_gbps=2 * size / tcp_seconds / 1e9,
        ratio_vs_tcp=(moved / seconds) / (2 * size / tcp_seconds),
        gloo_seconds=gloo_seconds,
        ratio_vs_gloo=seconds / gloo_seconds if gloo_seconds else None,
        seconds_min=min(grpc_s),
        rounds=rounds,
        encode_s=statistics.mean(t["encode_s"] for t in traffic) / calls,
        decode_s=statistics.mean(t["decode_s"] for t in traffic) / calls,
    )


def print_rows(rows: list[Row], console: Console) -> None:
    """The rows as a table; a long matrix shortened to each configuration's largest size, with a
    line saying so (`--json FILE` keeps every row)."""
    shown, note = short_rows(rows, lambda r: r.size_mib, lambda size: f"{size:g} MiB")
    table = Table(
        "op", "MiB", "shards", "workers", "codec", "via", "ms", "GB/s", "TCP GB/s", "vs TCP", "gloo ms", "vs gloo",
        title="gradps bench transport (medians; GB/s = fp32 bytes pushed + pulled over all workers)",
    )  # fmt: skip
    for r in shown:
        table.add_row(
            r.op,
            f"{r.size_mib:g}",
            str(r.shards),
            str(r.workers),
            r.codec + ("" if r.pull_codec == "none" else f"/{r.pull_codec}"),
            r.transport
            + (" tls" if r.tls else "")
            + (" counted" if r.metrics else "")
            + ("" if r.device == "cpu" else f" {r.device}")
            + (f" {r.link}" if r.link else ""),
            f"{r.seconds * 1e3:.1f}",
            f"{r.gbps:.2f}",
            f"{r.tcp_gbps:.2f}",
            f"{r.ratio_vs_tcp:.0%}",
            f"{r.gloo_seconds * 1e3:.1f}" if r.gloo_seconds else "-",
            f"{r.ratio_vs_gloo:.2f}x" if r.ratio_vs_gloo else "-",
        )
    console.print(table)
    if note:
        console.print(note)


_MODES = {"off": (False,), "on": (True,), "both": (False, True)}


def _plot_path(ctx: click.Context, param: click.Parameter, path: Path | None) -> Path | None:
    """--plot, checked before the bench starts: a format matplotlib writes, in a folder we can."""
    if path is not None:
        try:
            check_path(path)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return output_file(ctx, param, path)


def _check_links(
    links: Sequence[str], transports: Sequence[str], shards: int, workers: int, layouts: Sequence[str]
) -> None:
    """--link's usage errors, before anything starts."""
    if click.get_current_context().get_parameter_source("transports") != click.core.ParameterSource.DEFAULT:
        raise click.UsageError(
            "--transport does not apply with --link: payloads take shared memory within a host and data "
            "streams between hosts; --hosts chooses where the shards are"
        )
    hosts = _hosts_needed(shards, workers, layouts)
    for text in links:
        try:
            parse_links(text, hosts)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--link") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--sizes", default="1,16,64,256", callback=parse_list(float), help="Parameter set sizes, MiB.")
@click.option("--shards", "shards_list", default="1,2", callback=parse_counts, help="Shard counts.")
@click.option("--workers", "workers_list", default="1,2", callback=parse_counts, help="Worker counts.")
@click.option("--codec", "codecs", default="none", callback=parse_codecs, help="Push codecs, e.g. none,int8.")
@click.option(
    "--pull-codec",
    "pull_codecs",
    default="none",
    callback=parse_codecs,
    help="Pull codecs (the weights), e.g. none,bf16; each with every push codec (shown as int8/bf16).",
)
@transport_option((*TRANSPORTS, COLOCATED))
@click.option("--rounds", default=5, type=click.IntRange(min=1), help="Timed rounds per configuration.")
@click.option(
    "--part-size", default=DEFAULT_PART_SIZE / MiB, type=click.FloatRange(min=0.001, max=64), help="Part size, MiB."
)
@click.option(
    "--round-mib", default=ROUND_MIB, type=click.FloatRange(min=0, min_open=True), help="Least MiB a round moves."
)
@device_option("Where the workers' tensors and the shards' parts live.", default="cpu")
@click.option(
    "--tls",
    type=click.Choice(["off", "on", "both"]),
    default="off",
    help="Every connection in TLS (a CA of the bench's own): off, on, or both, each configuration on "
    "a plaintext cluster and then on one in TLS.",
)
@click.option(
    "--metrics",
    type=click.Choice(["off", "on", "both"]),
    default="off",
    help="Every process serving Prometheus metrics and counting each call: off, on, or both (a "
    "cluster of each, measured side by side: the cost of metrics).",
)
@click.option(
    "--link",
    "links",
    multiple=True,
    metavar="RATE[,hostK=RATE]",
    help="Measure on an emulated network instead of loopback: every process (the TCP and gloo "
    "references too) on a host of its own, each host's link capped at RATE both ways, e.g. 10gbit, or "
    "10gbit,host1=1gbit for an uneven cluster. Repeat for several rates. Needs root; without it, one "
    "line says so and the bench runs on loopback.",
)
@click.option(
    "--hosts",
    "layouts",
    default="colocated",
    callback=parse_choices(LAYOUTS),
    help="With --link: where the shards are. colocated: shard k on worker k's host (shared memory "
    "with it); separate: each shard on a host of its own. Both: colocated,separate.",
)
@json_option()
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_plot_path,
    help="Draw the rows against the targets here (.png, .svg or .pdf).",
)
@one_line_errors
def transport(
    sizes: list[float],
    shards_list: list[int],
    workers_list: list[int],
    codecs: list[str],
    pull_codecs: list[str],
    transports: list[str],
    rounds: int,
    part_size: float,
    round_mib: float,
    device: str,
    tls: str,
    metrics: str,
    links: tuple[str, ...],
    layouts: list[str],
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """Push + pull through real shard processes beside loopback TCP and gloo all_reduce."""
    if any(s <= 0 for s in sizes):
        raise click.BadParameter("sizes must be positive", param_hint="--sizes")
    refuse_unread(click.get_current_context(), {} if links else {"layouts": "--link only"}, "this bench")
    console = Console(stderr=True)
    if links:
        _check_links(links, transports, max(shards_list), max(workers_list), layouts)
        if not Links.available(console):
            links = ()
    rows = measure_transport(
        sizes,
        shards_list,
        workers_list,
        codecs,
        transports,
        rounds=rounds,
        part_size=int(part_size * MiB),
        round_mib=round_mib,
        device=device,
        console=console,
        tls_modes=_MODES[tls],
        metrics_modes=_MODES[metrics],
        links=links,
        layouts=layouts,
        pull_codecs=pull_codecs,
    )
    print_rows(rows, table_console())
    if json_path:
        write_json(json_path, [asdict(r) for r in rows], console)
    if plot_path:
        if links:
            plot_links([asdict(r) for r in rows], plot_path)
        else:
            plot_transport([asdict(r) for r in rows], plot_path)
        console.log(f"wrote {plot_path}")
