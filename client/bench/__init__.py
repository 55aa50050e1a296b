"""`gradps bench`: measurements of the transport, a training step and a shard's memory, each
against a reference measured in the same run (this machine is shared and noisy).

Each bench is imported when it runs (or `gradps bench --help` lists them): what they import
(their workers, references and plots) would otherwise slow every other command of the CLI."""

from __future__ import annotations

import importlib

import click

# Each bench: the click command of the same name in client.bench.<name>.
BENCHES = ("transport", "step", "memory", "adam")


class _Benches(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(BENCHES)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in BENCHES:
            return None
        command: click.Command = getattr(importlib.import_module(f"client.bench.{cmd_name}"), cmd_name)
        return command


@click.group(cls=_Benches, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def bench() -> None:
    """Benchmarks: transport, step, memory, adam."""


__all__ = ["bench"]
