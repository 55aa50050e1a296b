"""Stopping the processes a client started (a local cluster's services, a launch's scripts, the
DDP baseline's ranks): politely first, and never leaving one running on its own."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence

from client.fork_server import Service


def terminate(processes: Sequence[Service], grace_s: float) -> list[int]:
    """SIGTERM `processes`, wait up to `grace_s` for them all, SIGKILL the rest; exit codes.
    Interrupted while it waits (a second Ctrl-C), it SIGKILLs them all at once."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    codes = []
    try:
        for p in processes:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
    except BaseException:
        for p in processes:
            p.kill()
        raise
    return codes
