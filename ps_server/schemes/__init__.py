"""Shard-side update rules, one module per scheme."""

from __future__ import annotations

import torch

from gradps.errors import Invalid, TooLarge, one_line
from gradps.schemes import check_implemented
from gradps.v1 import shard_pb2
from ps_server.run_state import RunState
from ps_server.schemes.asgd import AsgdRule
from ps_server.schemes.base import ShardRule
from ps_server.schemes.pseudosync import PseudosyncRule
from ps_server.schemes.ssp import SspRule
from ps_server.schemes.sync import SyncRule
from ps_server.schemes.wagma import WagmaRule

RULES: dict[str, type[ShardRule]] = {
    "asgd": AsgdRule,
    "sync": SyncRule,
    "ssp": SspRule,
    "wagma": WagmaRule,
    "pseudosync": PseudosyncRule,
}
check_implemented(RULES, "shard rules")


def open_run(request: shard_pb2.OpenRunRequest, device: torch.device) -> tuple[RunState, ShardRule]:
    """A run's state on this shard and its scheme's rule, as `request` opens it (checked first by
    run_checks.check_open_run): Invalid for an optimizer torch refuses, TooLarge when its parts do
    not fit the device."""
    try:
        rule_type = RULES[request.spec.scheme]
        workers = len(request.workers)
        per_step = rule_type.updates_per_step(request.spec, workers)
        run = RunState.open(request, device, per_step, rule_type.optimizer(request.spec, workers))
        return run, rule_type(run)
    except ValueError as e:  # what torch's optimizers refuse (betas, eps out of range)
        raise Invalid(f"run {request.run_id!r}: {one_line(e)}") from None
    except (RuntimeError, MemoryError) as e:  # the parts do not fit the device
        raise TooLarge(f"run {request.run_id!r}: cannot allocate its parts: {one_line(e)}") from None


__all__ = ["RULES", "ShardRule", "open_run"]
