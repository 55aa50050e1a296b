"""The seam between the Trainer and a scheme's worker-side rule."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpu_worker.trainer import Trainer


class WorkerScheme(ABC):
    """What a worker exchanges with the shards at the start, after each backward, and at the end."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.client = trainer.client
        self.params = trainer.params

    @abstractmethod
    def start(self) -> None:
        """Take the initial global weights."""

    @abstractmethod
    def after_backward(self, step: int) -> int:
        """Gradients of step `step` are in the parameters' .grad; returns the next step (a scheme
        may skip steps, as a late wagma worker does)."""

    def finish(self) -> None:
        """Bring the replica to the final global model (default: pull it)."""
        self.client.pull(self.params)

    def eval_model(self) -> torch.nn.Module:
        """The model whose test accuracy is reported: the replica, holding global weights."""
        return self.trainer.model
