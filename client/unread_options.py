"""Options given that a command would not read: refused in one line that says what each applies
to, since a run that silently ignores `--tau 4` under sync or `--gamma` without the step schedule
is not the run its user asked for."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import click
from click.core import ParameterSource

from gradps.schemes import PARAMS, schemes_of
from gradps.tasks import FIXED_SIZE

# Options that define a run beside the spec options; a resumed run keeps its own spec.
RUN_OPTIONS = ("scheme", "workers", "checkpoint_every")
# Options only an embedded cluster (--local) reads.
LOCAL_OPTIONS = ("shards", "heartbeat_timeout", "device", "transport", "allow_import")


def unread_run_options(options: Mapping[str, Any], schemes: Collection[str]) -> dict[str, str]:
    """Option name -> what it applies to, for each run option that a run of one of `schemes` with
    these `options` (the spec options, by click name) would not read."""
    unread = {
        name: f"{'/'.join(schemes_of(param))} only"
        for name, param in PARAMS.items()
        if not set(schemes_of(param)) & set(schemes)
    }
    if options.get("schedule") != "step":
        unread |= {"step_size": "--schedule step only", "gamma": "--schedule step only"}
    if options.get("optimizer") != "sgd":
        unread |= {"momentum": "--optimizer sgd only", "nesterov": "--optimizer sgd only"}
    if options.get("dataset") in FIXED_SIZE:
        unread["dataset_size"] = f"{options['dataset']} has a fixed size"
    return unread


def refuse_unread(ctx: click.Context, unread: Mapping[str, str], subject: str = "this run") -> None:
    """A usage error naming every option in `unread` (name -> what it applies to) that the user gave,
    on the command line or from the environment, rather than left at its default."""
    given = [
        (param, unread[param.name])
        for param in ctx.command.params
        if param.name in unread
        and ctx.get_parameter_source(param.name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    ]
    if given:
        names = ", ".join(f"{param.opts[0]} ({applies})" for param, applies in given)
        raise click.UsageError(f"{subject} would ignore {names}")
