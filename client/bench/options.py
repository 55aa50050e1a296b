"""The benches' shared options, parsed and checked by click callbacks: a bad value is a one-line
usage error before anything starts."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import click
from rich.console import Console

from client.usage import output_file
from gradps.codec_table import CodecError, check_pull_codec, parse_codec
from gradps.transport import TRANSPORTS


def parse_list(kind: Callable) -> Callable:
    """A callback that reads "a,b,c" as [kind(a), kind(b), kind(c)] (at least one)."""

    def parse(ctx: click.Context, param: click.Parameter, value: str) -> list:
        try:
            items = [kind(v.strip()) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list, got {value!r}") from None
        if not items:
            raise click.BadParameter("empty list")
        return items

    return parse


def parse_counts(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    """Positive integers, e.g. worker or shard counts."""
    items = parse_list(int)(ctx, param, value)
    if any(v < 1 for v in items):
        raise click.BadParameter("every value must be >= 1")
    return items


def parse_codecs(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    """Codec strings, each one `gradps.codecs.parse_codec` accepts (and, for `--pull-codec`, one
    that a pull may ask for)."""
    items = parse_list(str)(ctx, param, value)
    for codec in items:
        try:
            params = parse_codec(codec)
            if param.name == "pull_codecs":
                check_pull_codec(params)
        except (ValueError, CodecError) as e:
            raise click.BadParameter(str(e)) from None
    return items


def parse_choices(allowed: Sequence[str]) -> Callable:
    """A callback for a list whose every item is one of `allowed`."""

    def parse(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
        items = parse_list(str)(ctx, param, value)
        if unknown := [v for v in items if v not in allowed]:
            raise click.BadParameter(f"unknown value {unknown[0]!r}: expected {' or '.join(allowed)}")
        return items

    return parse


# `gradps bench transport` also emulates BytePS's colocated placement on one machine: worker k
# shares a host with shard k (mod shards), so it uses shared memory with that shard and data
# streams with the others; between hosts, only the other shards' share crosses the network.
COLOCATED = "colocated"


def transport_option(choices: Sequence[str] = TRANSPORTS) -> Callable:
    """`--transport shm,stream,grpc` (any of `choices`), given to the command as `transports`."""
    text = (
        "Where payloads travel: shm (shared memory), stream (raw TCP data streams), grpc (in the "
        "messages); calls go through gRPC in all three."
    )
    if COLOCATED in choices:
        text += " colocated: each worker shares a host with one shard (shm with it, streams with the others)."
    return click.option(
        "--transport", "transports", default=",".join(TRANSPORTS), callback=parse_choices(choices), help=text
    )


def json_option(help: str = "Write the rows here.") -> Callable:  # noqa: A002 (click's name)
    """`--json FILE`, given to the command as `json_path`; its folder is made and checked first."""
    return click.option(
        "--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=output_file, help=help
    )


def write_json(path: Path, data: object, console: Console) -> None:
    """Write a bench's result (dataclasses as dicts) where `--json` names."""
    path.write_text(json.dumps(data, indent=2) + "\n")
    console.log(f"wrote {path}")
