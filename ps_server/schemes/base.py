"""The seam between the shard service and a scheme's update rule."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ps_server.run_state import Push, RunState


class ShardRule(ABC):
    """How a shard turns pushes into updates for one run. Called with `run.cond` held."""

    def __init__(self, run: RunState) -> None:
        self.run = run

    @abstractmethod
    def push(self, push: Push) -> int:
        """Take a validated push; return its staleness. Raise PushRejected to refuse it whole."""

    def membership_changed(self) -> None:  # noqa: B027 (optional hook)
        """The live workers changed; finish anything that was waiting for the dead."""
