"""asgd (GPU A-SGD, Downpour style): apply every push at once."""

from __future__ import annotations

from ps_server.run_state import Push
from ps_server.schemes.base import ShardRule


class AsgdRule(ShardRule):
    """w <- opt(w, g) on arrival; staleness = version now - version the gradient was computed on."""

    def push(self, push: Push) -> int:
        staleness = 0
        for key, grad in push.grads.items():
            part = self.run.parts[key]
            staleness = max(staleness, part.version - push.versions[key])
            part.optimizer.apply(grad)
            part.version += 1
        return staleness
