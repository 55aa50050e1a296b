"""What the CLI accepts and how it refuses the rest: one line and a non-zero exit code, found before
any work starts where it can be (a bench must not fail on its output file after twelve minutes,
a run must not be submitted when its folder cannot be made)."""

from __future__ import annotations

import functools
import math
import os
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, ParamSpec, TypeVar

import click

from client.sdk import GradpsError

P = ParamSpec("P")
R = TypeVar("R")


class FiniteFloat(click.FloatRange):
    """click.FloatRange that also refuses nan and inf, which pass its comparisons."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class Count(click.IntRange):
    """An integer at least `min` that a protobuf field of `max` (its width) carries: --help shows
    the bound a user means ("x>=1"), not the width ("1<=x<=18446744073709551615")."""

    name = "integer"

    def _describe_range(self) -> str:  # what --help shows
        return f"x>={self.min}" if self.min is not None else ""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        number = int(click.INT.convert(value, param, ctx))
        if (self.min is not None and number < self.min) or (self.max is not None and number > self.max):
            self.fail(f"{number} is not in the range {click.IntRange._describe_range(self)}.", param, ctx)
        return number


def one_line_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn the errors a user can cause into one line and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (GradpsError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:  # a path that cannot be written, a full disk: the file and the reason
            raise click.ClickException(f"{e.filename or 'error'}: {e.strerror or e}") from None

    return wrapper


def make_dir(path: Path) -> Path:
    """Create `path` (and its parents) now, or fail with one line: before a run or a bench starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.ClickException(f"cannot create folder {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK):
        raise click.ClickException(f"cannot write to folder {path}")
    return path


def output_file(ctx: click.Context, param: click.Parameter, path: Path | None) -> Path | None:
    """Callback of an option naming a file to write at the end (--json, --out): its folder is made
    and checked writable now, so a long command cannot fail on it at the end."""
    if path is None:
        return None
    if path.is_dir():
        raise click.BadParameter(f"{path} is a folder", ctx, param)
    try:
        make_dir(path.parent)
    except click.ClickException as e:
        raise click.BadParameter(e.message, ctx, param) from None
    return path


def stop_on_sigterm() -> None:
    """Make SIGTERM (kill, `timeout`, a container stop) unwind like Ctrl-C: the embedded cluster's
    processes are stopped and a followed run is stopped, instead of being left orphaned."""

    def unwind(signum: int, frame: FrameType | None) -> NoReturn:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
