"""The seam between the shard service and a scheme's update rule."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from gradps.errors import NotNow
from gradps.placement import PartKey
from gradps.v1 import run_pb2, shard_pb2
from ps_server.run_state import Part, Push, RunState, Wait
from ps_server.saved_state import Saved


class ShardRule(ABC):
    """How a shard turns pushes into updates for one run. Every hook is called with `run.cond` held."""

    # True when push() only sums gradients: topk/randk parts then arrive as SparsePart.
    sums_sparse_parts: ClassVar[bool] = False
    # True when an update can land on a part while a worker pulls it (asgd, ssp): a pull that
    # sends a part's bytes over time (a data stream) sends a snapshot. False for sync, where the
    # next update waits for the puller's own next push.
    pulls_race_updates: ClassVar[bool] = True
    # True where the model lives on the workers and one hands its replica in at checkpoint steps
    # (pseudosync): a RegisterTensors with replica_step is taken, and hand_in told.
    takes_replicas: ClassVar[bool] = False

    def __init__(self, run: RunState) -> None:
        self.run = run

    @staticmethod
    def updates_per_step(spec: run_pb2.RunSpec, workers: int) -> float:
        """Updates each part gets per step of a worker: the learning-rate schedule counts a part's
        updates, so its horizon is the run's steps times this (one mean per step by default)."""
        return 1.0

    @staticmethod
    def optimizer(spec: run_pb2.RunSpec, workers: int) -> run_pb2.OptimizerSpec:
        """The optimizer this scheme's shards apply (the run's, by default)."""
        return spec.optimizer

    @abstractmethod
    def push(self, push: Push) -> int:
        """Take a validated push; return its staleness. Raise NotNow to refuse it whole."""

    def step(self) -> int:
        """The run's step as this shard sees it, which RunSpec.checkpoint_every_steps counts: the
        steps pushed (the highest step applied, plus one) by default."""
        return max((max(steps) + 1 for steps in self.run.applied.values() if steps), default=0)

    def save(self, saved: Saved) -> None:  # noqa: B027 (optional hook)
        """Put the rule's own state (what it keeps beyond the parts and the optimizer) in `saved`,
        for a checkpoint; tensors are copied by `saved.put`."""

    def load(self, saved: Saved) -> None:  # noqa: B027 (optional hook)
        """Take back what `save` put (tensors on the run's device): a restarted shard. Raises
        KeyError or ValueError (TypeError) for a checkpoint that does not hold it."""

    def cut_ready(self) -> bool:
        """Whether the run's state here is one a checkpoint may be taken of now: what a worker
        hands in for it (hand_in) is here too. Always, by default."""
        return True

    def hand_in(self, step: int) -> None:  # noqa: B027 (optional hook)
        """A worker's replica at the start of `step` was just written into the parts (a
        RegisterTensors with replica_step; only where `takes_replicas`)."""

    def membership_changed(self) -> None:  # noqa: B027 (optional hook)
        """The live workers changed; finish anything that was waiting for the dead."""

    def weights_final(self) -> bool:
        """Whether no push can change the weights any more: the run's final ones, which a pull
        answered now sends (PullResponse.final_weights). False by default: the schemes whose
        workers all end on the same model tell them so themselves."""
        return False

    def pull_ready(self, parts: list[Part], request: shard_pb2.PullRequest) -> bool:
        """May this pull be answered now? (Re-evaluated whenever the run changes.) It depends on
        the request's min_version, clock, gradient and gradient_step only, never on who asks:
        pulls that ask the same are looked at once (gradps.serving.parked)."""
        if request.gradient:
            raise NotNow(f"scheme {self.run.spec.scheme!r} keeps no reduced gradients")
        return all(p.initialised and p.version >= request.min_version for p in parts)

    def pull_values(self, part: Part, request: shard_pb2.PullRequest) -> torch.Tensor:
        """What a pull of `part` returns (the weights, by default)."""
        return part.values

    def on_pull(self, worker_id: int, parts: list[Part]) -> None:  # noqa: B027 (optional hook)
        """A pull of `parts` by `worker_id` is being answered."""

    # How long a round that waits for its members (wagma's global round) waits at most.
    round_wait_s = 0.0

    def group_average(
        self,
        worker_id: int,
        step: int,
        members: frozenset[int],
        is_global: bool,
        deposit: dict[PartKey, torch.Tensor],
        wait: Wait | None = None,
    ) -> tuple[dict[PartKey, torch.Tensor], int]:
        """A group round (wagma) whole: `deposit`, the wait for the other members where the
        round has one, `answer_round`. `wait` is how the round waits (the caller's: it ends when
        the call does, with Cancelled or TimedOut); `run.cond.wait_for` when None."""
        everyone = self.deposit(worker_id, step, members, is_global, deposit)
        if everyone is not None:
            wait = wait or (lambda ready, timeout_s: self.run.cond.wait_for(ready, timeout=timeout_s))
            if not wait(everyone, self.round_wait_s):
                self.missed_round(step)
        return self.answer_round(worker_id, step, members, is_global, deposit)

    def deposit(
        self, worker_id: int, step: int, members: frozenset[int], is_global: bool, deposit: dict[PartKey, torch.Tensor]
    ) -> Callable[[], bool] | None:
        """Store a member's deposit for a round (`run.cond` held). Returns what the round waits
        for before it is answered (every live member's deposit, for a global round), or None.
        `deposit` holds every part of the run on this shard (the service checks it)."""
        raise NotNow(f"scheme {self.run.spec.scheme!r} has no group rounds")

    def missed_round(self, step: int) -> None:  # noqa: B027 (optional hook)
        """The round of `step` waited `round_wait_s` and is fixed without every member."""

    def answer_round(
        self, worker_id: int, step: int, members: frozenset[int], is_global: bool, deposit: dict[PartKey, torch.Tensor]
    ) -> tuple[dict[PartKey, torch.Tensor], int]:
        """The round's averages for the member that deposited `deposit` (fixing the round if no
        member did yet), and the highest step deposited."""
        raise NotNow(f"scheme {self.run.spec.scheme!r} has no group rounds")

    def consensus(self, worker_id: int, keys: list[PartKey]) -> tuple[dict[PartKey, torch.Tensor], int]:
        """The run's consensus model of `keys` (wagma: the average of the latest deposits) and the
        highest step deposited."""
        raise NotNow(f"scheme {self.run.spec.scheme!r} has no group rounds")
