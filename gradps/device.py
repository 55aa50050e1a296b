"""Choosing the torch device a service computes on."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when present, else CPU; asking for CUDA without one is an error."""
    import torch  # here, not above: the CLI declares its --device options without loading torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible")
    return torch.device(name)


def resolve_option(value: str) -> str:
    """A `--device` value resolved ('cpu' or 'cuda'); CUDA where there is none is a usage error."""
    try:
        return str(resolve_device(value))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--device'") from None


def device_option(help: str, default: str = "auto", envvar: str | None = None, resolve: bool = True) -> Callable:
    """The `--device` option of every command: auto, cpu or cuda, given to the command resolved
    (`resolve_option`), before anything starts. With resolve=False the command gets it as given
    and resolves it where it applies (`gradps train --local`, not `--coordinator`)."""
    callback = (lambda ctx, param, value: resolve_option(value)) if resolve else None
    return click.option(
        "--device",
        default=default,
        envvar=envvar,
        show_envvar=envvar is not None,
        type=click.Choice(DEVICES),
        callback=callback,
        help=help,
    )
