"""Where the CLI prints its tables: stdout at the terminal's width (or $COLUMNS), or, piped into a
file or another program, wide enough that no cell is cut (rich would assume 80 columns and shorten
them: `gradps runs | grep` found "comp…" and "0.81…")."""

from __future__ import annotations

import os
import sys

from rich.console import Console

# Columns a table may take when stdout is not a terminal: more than any of the CLI's tables needs.
PIPED_WIDTH = 160


def table_console() -> Console:
    """A console for a table on stdout."""
    sized = sys.stdout.isatty() or "COLUMNS" in os.environ
    return Console(width=None if sized else PIPED_WIDTH)
