"""State as a shard's checkpoint holds it: fields a JSON manifest can carry and the tensors they
name by key (ps_server/checkpoint.py writes and reads both). A scheme's rule puts its own state
in one (ShardRule.save) and takes it back from one (ShardRule.load)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gradps.placement import PartKey


@dataclass
class Saved:
    """JSON-able `fields`, and `tensors` by key (keys are made here: `prefix` and a number)."""

    prefix: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def put(self, tensor: torch.Tensor) -> str:
        """Name `tensor` for the checkpoint (which copies it before the run's lock is released:
        checkpoint.take); returns the key a field names it by."""
        key = f"{self.prefix}{len(self.tensors)}"
        self.tensors[key] = tensor.detach()
        return key

    def get(self, key: str) -> torch.Tensor:
        """The tensor a field names; KeyError (a checkpoint that does not hold it) otherwise."""
        if not isinstance(key, str) or key not in self.tensors:
            raise KeyError(f"no tensor {key!r}")
        return self.tensors[key]


def part_of(named: Any) -> PartKey:
    """A part key as a field carries it ([name, index]), checked."""
    name, index = named
    if not isinstance(name, str) or not isinstance(index, int):
        raise ValueError(f"not a part: {named!r}")
    return name, index
