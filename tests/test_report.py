"""The live progress display of `gradps train` and `gradps compare` (client/report.py)."""

import io

from rich.console import Console

from client.report import run_progress


def _render(total: float | None, completed: float) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, no_color=True, width=160)
    with run_progress(console) as progress:
        task = progress.add_task("sync r-1", total=total, stats="waiting")
        progress.update(task, completed=completed)
    return out.getvalue()


def test_a_run_not_yet_placed_shows_an_unknown_total():
    # The total is 0 (unknown) until the run is placed: the display must not fail on it.
    assert "step 0/?" in _render(None, 0)


def test_steps_are_shown_as_done_of_total():
    assert "step  37/400 " in _render(400, 37.5)
