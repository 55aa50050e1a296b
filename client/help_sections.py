"""`--help` in sections, the options a user reaches for first at the top, rather than one flat
list of fifty."""

from __future__ import annotations

import click

from gradps.schemes import PARAMS

# Section title -> option names (click's parameter names), in the order shown; options of a command
# that no section names come last, under "Other options".
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Run",
        ("scheme", "schemes", "workers", "model", "dataset", "optimizer", "lr", "momentum", "epochs", "steps"),
    ),
    ("Compression", ("codec", "pull_codec")),
    (
        "Output",
        (
            "target_accuracy",
            "until_target",
            "until_accuracy",
            "baseline",
            "repeats",
            "eval_every",
            "out",
            "tensorboard",
            "no_progress",
            "checkpoint_every",
            "resume",
        ),
    ),
    ("Cluster", ("coordinator", "local", "shards", "heartbeat_timeout", "device", "transport", "allow_import", "tls")),
    ("Optimizer details", ("nesterov", "weight_decay", "schedule", "step_size", "gamma", "warmup_steps")),
    ("Data", ("dataset_size", "batch_size", "seed", "part_size")),
    ("Imbalance (emulated)", ("straggler", "jitter")),
)
_SCHEME = "Scheme parameters (each names the schemes it applies to)"


class SectionedCommand(click.Command):
    """A click command whose --help groups its options by `SECTIONS`; the scheme registry's options
    (gradps.schemes.PARAMS) get a section of their own."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, tuple[str, str]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and param.name is not None:
                rows[param.name] = record
        shown: set[str] = set()
        sections = [*SECTIONS, (_SCHEME, tuple(n for n in rows if n in PARAMS))]
        for title, names in sections:
            records = [rows[n] for n in names if n in rows and n not in shown]
            shown.update(names)
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)
        if rest := [record for name, record in rows.items() if name not in shown]:
            with formatter.section("Other options"):
                formatter.write_dl(rest)
