"""Shard-side update rules, one module per scheme."""

from __future__ import annotations

from ps_server.schemes.asgd import AsgdRule
from ps_server.schemes.base import ShardRule
from ps_server.schemes.sync import SyncRule

RULES: dict[str, type[ShardRule]] = {
    "asgd": AsgdRule,
    "sync": SyncRule,
}

__all__ = ["RULES", "ShardRule"]
