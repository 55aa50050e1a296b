"""Shard-side update rules, one module per scheme."""

from __future__ import annotations

from gradps.schemes import check_implemented
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

__all__ = ["RULES", "ShardRule"]
