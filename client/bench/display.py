"""What a bench shows: one progress line on stderr while it measures (what it measures now, how
many of its parts are done), then a short table on stdout. A log line per configuration would bury
the table; `--json FILE` keeps every row."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Beyond this many rows a table shows the rows of the largest value of one column only.
SHORT_TABLE_ROWS = 24
Row = TypeVar("Row")


class ProgressLine:
    """The bench's one progress line, gone when the bench ends (the table follows); nothing shows
    without a console. Use it as a context manager around the measurements."""

    def __init__(self, console: Console | None, total: int, description: str) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=console is None,
        )
        self._task = self._progress.add_task(description, total=total)

    def __enter__(self) -> ProgressLine:
        self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._progress.stop()

    def measuring(self, description: str) -> None:
        """Say what is measured now."""
        self._progress.update(self._task, description=description)

    def done(self) -> None:
        """One more part measured."""
        self._progress.advance(self._task)


def short_rows(
    rows: Sequence[Row], key: Callable[[Row], float], label: Callable[[float], str]
) -> tuple[list[Row], str | None]:
    """The rows a table shows and the line to print under it: every row and None, or past
    SHORT_TABLE_ROWS the rows whose `key` is the largest and a line that says so (`label` names
    that value, e.g. "256 MiB")."""
    if len(rows) <= SHORT_TABLE_ROWS:
        return list(rows), None
    largest = max(key(r) for r in rows)
    note = f"{len(rows)} rows measured; shown: the {label(largest)} ones. --json FILE keeps every row."
    return [r for r in rows if key(r) == largest], note
