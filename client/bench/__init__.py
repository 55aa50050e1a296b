"""`gradps bench`: measurements of the transport, a training step and a shard's memory, each
against a reference measured in the same run (this machine is shared and noisy)."""

from __future__ import annotations

import click

from client.bench.adam import adam
from client.bench.memory import memory
from client.bench.step import step
from client.bench.transport import transport


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def bench() -> None:
    """Benchmarks: transport, step, memory, adam."""


bench.add_command(transport)
bench.add_command(step)
bench.add_command(memory)
bench.add_command(adam)

__all__ = ["bench"]
