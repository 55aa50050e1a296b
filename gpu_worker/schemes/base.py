"""The seam between the Trainer and a scheme's worker-side rule."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from gradps.parameter_client import ParameterClient
from gradps.v1 import run_pb2
from gradps.worker_session import Assignment


@dataclass
class Replica:
    """What a scheme works with: this worker's model replica, its run and its link to the shards."""

    model: torch.nn.Module
    # The parameters that live on the shards, by name.
    params: dict[str, torch.Tensor]
    client: ParameterClient
    spec: run_pb2.RunSpec
    assignment: Assignment
    total_steps: int
    # Where this worker starts: 0, a resumed run's step, or where it joins a running run.
    start_step: int = 0

    def grads(self) -> dict[str, torch.Tensor]:
        """The current gradient of every parameter (zeros where backward left none)."""
        return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.params.items()}


class WorkerScheme(ABC):
    """What a worker exchanges with the shards at the start, after each backward, and at the end."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.client = replica.client
        self.params = replica.params

    @abstractmethod
    def start(self) -> None:
        """Take the initial global weights."""

    @abstractmethod
    def after_backward(self, step: int) -> int:
        """Gradients of step `step` are in the parameters' .grad; returns the next step (a scheme
        may skip steps, as a late wagma worker does)."""

    def went_back(self, step: int) -> None:
        """The run went back to its checkpoint at `step` (a shard restarted): take the global
        weights of that step (default: pull them)."""
        self.client.pull(self.params)

    def finish(self, steps_done: int) -> None:
        """Bring the replica to the final global model after `steps_done` steps (default: pull it)."""
        self.client.pull(self.params)

    def holds_final_model(self) -> bool:
        """After `finish`: whether the replica holds the model the run ends with (Metrics.final_model).
        By default, when the shards answered its last pull with final weights (asgd, ssp: a
        worker that finished before another's last push holds a snapshot)."""
        return self.client.pulled_final_weights

    def eval_model(self) -> torch.nn.Module:
        """The model whose test accuracy is reported: the replica, holding global weights."""
        return self.replica.model
