"""wagma (WAGMA-SGD, Li et al. 2021): wait-avoiding group model averaging, held on the shards.

Each worker keeps its own model and deposits it for the round (step, group). The first arrival
fixes the round's average from every live member's latest deposit at that moment, left out where
it is more than `MAX_LAG` steps older than the round (a straggler's stale model would pull the
up-to-date ones back; it rejoins with the round's average when it arrives); nobody waits for a
straggler. A member whose older deposit the round used receives the average moved by how far its
model went since (`m + w_now - w_used`): its last step is kept rather than lost from the group's
sum. A member that comes to a round already fixed without any deposit of its own (a straggler:
its models are always older than its partners' rounds) hands in its last local step instead: the
shard knows the model it trained from (the mix of its last deposit and answer, by the workers'
rule), and the difference is added to the next round fixed, as a stale gradient is applied under
asgd; its data's steps reach the group instead of being lost. Only the global rounds the workers
ask to wait for (the run's first, so that they start together, and its final) wait for every
live member.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradps.errors import NotNow
from gradps.placement import PartKey
from ps_server.run_state import Push, RunState
from ps_server.saved_state import Saved, part_of
from ps_server.schemes.base import ShardRule

# Deposits kept per worker and part: the newest, and one older in case a newer step arrives
# before an older round is fixed (a newer deposit is never mixed into an older round).
_KEEP_DEPOSITS = 2
# A deposit at most this many steps older than a round is averaged into it. One step is the normal
# lag of a group's other members when the first one arrives (they deposited the previous step);
# measured on digits (docs/schemes.md), 1 converges in as many steps as sync, 2 and more slower.
MAX_LAG = 1
# A live member that has not reached a global round after this long is treated like a late member
# of a group round (its latest model is used): a global round must never hang the run.
_GLOBAL_WAIT_S = 30.0
_LOGGER = logging.getLogger("gradps.shard")

RoundKey = tuple[int, frozenset[int]]


@dataclass(frozen=True)
class _Answered:
    """A worker's last deposit and the answer it got (both fixed tensors, held, not copied): what
    it trains from next is derived from them only when a late deposit needs it."""

    deposit: dict[PartKey, torch.Tensor]
    answer: dict[PartKey, torch.Tensor]
    size: int
    is_global: bool

    def trained_from(self, key: PartKey) -> torch.Tensor:
        """By the workers' rule (gpu_worker/schemes/wagma.py): the answer after a global round,
        else `(S m + w) / (S + 1)` of the answer and the deposit."""
        if self.is_global:
            return self.answer[key]
        return torch.add(self.deposit[key], self.answer[key], alpha=self.size).div_(self.size + 1)


class WagmaRule(ShardRule):
    def __init__(self, run: RunState) -> None:
        super().__init__(run)
        # worker -> part -> [(step, values)], oldest first.
        self.deposits: dict[int, dict[PartKey, list[tuple[int, torch.Tensor]]]] = {}
        # Fixed results of rounds, kept while a member may still ask for them, and the step of
        # each member's deposit that a round used.
        self.rounds: dict[RoundKey, dict[PartKey, torch.Tensor]] = {}
        self.used: dict[RoundKey, dict[int, int]] = {}
        # Per worker, its last deposit and answer (its next deposit less its local step is the
        # model they make), the step of the last deposit whose step was carried, and the late
        # steps waiting for the next round fixed.
        self.answered: dict[int, _Answered] = {}
        self.carried: dict[int, int] = {}
        self.pending: dict[PartKey, torch.Tensor] = {}
        # Highest step deposited by anyone: a late worker skips ahead to it.
        self.frontier = 0

    def step(self) -> int:
        return self.frontier

    def save(self, saved: Saved) -> None:
        # Each worker's kept deposits and the fixed rounds a late member may still ask for.
        saved.fields["deposits"] = [
            [worker, *key, step, saved.put(values)]
            for worker, parts in self.deposits.items()
            for key, history in parts.items()
            for step, values in history
        ]
        saved.fields["rounds"] = [
            [step, sorted(members), *key, saved.put(values)]
            for (step, members), result in self.rounds.items()
            for key, values in result.items()
        ]
        saved.fields["used"] = [
            [step, sorted(members), worker, used]
            for (step, members), by_worker in self.used.items()
            for worker, used in by_worker.items()
        ]
        # Not what each worker was answered: after a restore every worker trains from the consensus instead.
        saved.fields["pending"] = [[*key, saved.put(values)] for key, values in self.pending.items()]
        saved.fields["frontier"] = self.frontier

    def load(self, saved: Saved) -> None:
        for worker, name, index, step, tensor in saved.fields["deposits"]:
            history = self.deposits.setdefault(int(worker), {}).setdefault(part_of([name, index]), [])
            history.append((int(step), saved.get(tensor)))  # saved oldest first
        for step, members, name, index, tensor in saved.fields["rounds"]:
            result = self.rounds.setdefault((int(step), frozenset(int(m) for m in members)), {})
            result[part_of([name, index])] = saved.get(tensor)
        for step, members, worker, used in saved.fields.get("used", []):
            self.used.setdefault((int(step), frozenset(int(m) for m in members)), {})[int(worker)] = int(used)
        self.pending = {
            part_of([name, index]): saved.get(tensor) for name, index, tensor in saved.fields.get("pending", [])
        }
        self.frontier = int(saved.fields["frontier"])

    def push(self, push: Push) -> int:
        raise NotNow("wagma workers exchange models with GroupAverage, not gradients")

    round_wait_s = _GLOBAL_WAIT_S

    def deposit(
        self, worker_id: int, step: int, members: frozenset[int], is_global: bool, deposit: dict[PartKey, torch.Tensor]
    ) -> Callable[[], bool] | None:
        if worker_id not in self.run.live_workers:
            raise NotNow(f"worker {worker_id} is not a live member of the run")
        round_key = (step, members)
        if round_key not in self.rounds:  # a fixed round answers a late member whatever its step
            self._check_kept(worker_id, step, deposit)
        elif worker_id not in self.used.get(round_key, {}):
            self._carry(worker_id, step, deposit)
        mine = self.deposits.setdefault(worker_id, {})
        for key, values in deposit.items():
            history = [d for d in mine.get(key, []) if d[0] != step]
            history.append((step, values))
            history.sort(key=lambda d: d[0])
            mine[key] = history[-_KEEP_DEPOSITS:]
        self.frontier = max(self.frontier, step)
        self.run.cond.notify_all()
        if not is_global or round_key in self.rounds:
            return None

        def everyone_deposited() -> bool:
            return round_key in self.rounds or all(
                self._deposit(m, key, step, exact=True) is not None
                for m in members & self.run.live_workers
                for key in deposit
            )

        return everyone_deposited

    def missed_round(self, step: int) -> None:
        _LOGGER.warning("run %s: global round %d fixed without every live member", self.run.run_id, step)

    def answer_round(
        self, worker_id: int, step: int, members: frozenset[int], is_global: bool, deposit: dict[PartKey, torch.Tensor]
    ) -> tuple[dict[PartKey, torch.Tensor], int]:
        round_key = (step, members)
        if round_key not in self.rounds:
            self.rounds[round_key], self.used[round_key] = self._fix_round(step, members, list(deposit), is_global)
            self._prune()
        answer = self._answer(worker_id, round_key, deposit)
        self.answered[worker_id] = _Answered(deposit, answer, len(members), is_global)
        return answer, self.frontier

    def _carry(self, worker_id: int, step: int, deposit: dict[PartKey, torch.Tensor]) -> None:
        """Keep the local step a late member's deposit holds (the deposit less the model it trained
        from) for the next round fixed; once per deposit, however often it is retried."""
        answered = self.answered.get(worker_id)
        if answered is None or self.carried.get(worker_id) == step:
            return
        for key, values in deposit.items():
            if key in answered.answer:
                change = values - answered.trained_from(key)
                self.pending[key] = change if key not in self.pending else self.pending[key].add_(change)
        self.carried[worker_id] = step

    def _answer(
        self, worker_id: int, round_key: RoundKey, deposit: dict[PartKey, torch.Tensor]
    ) -> dict[PartKey, torch.Tensor]:
        """The round's average for `worker_id`. Where the round used an older deposit of this
        worker, the average moved by what the worker's model did since (`m + w_now - w_used`):
        the worker then mixes that step in as if the round had seen it, so the group's sum of
        models keeps every member's step (the plain average would drop up to S/(S+1) of it)."""
        result = self.rounds[round_key]
        used = self.used.get(round_key, {}).get(worker_id)
        answer = {}
        for key, now in deposit.items():
            before = None if used is None or used == round_key[0] else self._kept(worker_id, key, used)
            answer[key] = result[key] if before is None else result[key] + (now - before)
        return answer

    def consensus(self, worker_id: int, keys: list[PartKey]) -> tuple[dict[PartKey, torch.Tensor], int]:
        """The average of every live member's latest deposit, as of the newest step (nothing is
        stored). A member with none yet (it joined, the run resumed) counts with its rank's
        newest deposit by an earlier holder; with no deposit at all, the registered model."""
        if worker_id not in self.run.live_workers:
            raise NotNow(f"worker {worker_id} is not a live member of the run")
        result = {}
        for key in keys:
            latest = (
                self._deposit(m, key, self.frontier) if self.deposits.get(m, {}).get(key) else self._inherited(m, key)
                for m in sorted(self.run.live_workers)
            )
            result[key] = _mean([v for v in latest if v is not None] or [self.run.parts[key].values])
        return result, self.frontier

    def _inherited(self, worker: int, key: PartKey) -> torch.Tensor | None:
        """The newest deposit of `key` by a worker that held `worker`'s rank before it."""
        rank = self.run.ranks[worker]
        histories = (self.deposits.get(w, {}).get(key) for w, r in self.run.ranks.items() if r == rank)
        newest = max((h[-1] for h in histories if h), key=lambda d: d[0], default=None)
        return None if newest is None else newest[1]

    def _check_kept(self, worker_id: int, step: int, deposit: dict[PartKey, torch.Tensor]) -> None:
        """Refuse, before anything changes, a deposit older than the rounds this shard still keeps:
        the worker's kept deposits are all newer, so its own would be dropped at once and the round
        could average nothing. The message names the step to jump to (the frontier)."""
        mine = self.deposits.get(worker_id, {})
        for key in deposit:
            if sum(s > step for s, _ in mine.get(key, [])) >= _KEEP_DEPOSITS:
                raise NotNow(
                    f"round at step {step} is gone: worker {worker_id} deposited {_KEEP_DEPOSITS} newer steps "
                    f"since; jump to step {self.frontier} (the frontier)"
                )

    def _deposit(self, worker: int, key: PartKey, step: int, exact: bool = False) -> torch.Tensor | None:
        """The worker's latest deposit of `key` made at or before `step` and at most MAX_LAG steps
        before it (exactly at, if `exact`)."""
        found = self._deposit_at(worker, key, step, exact)
        return None if found is None else found[1]

    def _deposit_at(self, worker: int, key: PartKey, step: int, exact: bool = False) -> tuple[int, torch.Tensor] | None:
        """As `_deposit`, with the step the deposit was made at."""
        for s, values in reversed(self.deposits.get(worker, {}).get(key, [])):
            if s <= step:
                return (s, values) if s == step or (not exact and step - s <= MAX_LAG) else None
        return None

    def _kept(self, worker: int, key: PartKey, step: int) -> torch.Tensor | None:
        """The worker's deposit of `key` made exactly at `step`, while it is kept."""
        return next((values for s, values in self.deposits.get(worker, {}).get(key, []) if s == step), None)

    def _fix_round(
        self, step: int, members: frozenset[int], keys: list[PartKey], is_global: bool
    ) -> tuple[dict[PartKey, torch.Tensor], dict[int, int]]:
        """The average of each live member's latest deposit at or before `step` (with the late
        steps pending, but for the final global round), and the step of the deposit used for each
        member; members that have not deposited yet, or only more than MAX_LAG steps before, are
        left out."""
        result, used = {}, {}
        for key in keys:
            found = {m: self._deposit_at(m, key, step) for m in sorted(members & self.run.live_workers)}
            averaged = [d[1] for d in found.values() if d is not None]
            result[key] = _mean(averaged)
            pending = self.pending.pop(key, None)
            # Late members' steps, shared out as each member's own step is; not into the final
            # global round, which holds every member's last model already and must equal the
            # consensus that evaluates it.
            if pending is not None and not is_global:
                result[key].add_(pending, alpha=1.0 / len(averaged))
            used.update({m: d[0] for m, d in found.items() if d is not None})
        return result, used

    def _prune(self) -> None:
        """Drop rounds older than every live worker's newest deposit: nobody will ask again."""
        newest = [max((h[-1][0] for h in self.deposits.get(w, {}).values()), default=0) for w in self.run.live_workers]
        oldest_needed = min(newest, default=0)
        for key in [k for k in self.rounds if k[0] < oldest_needed]:
            del self.rounds[key]
            self.used.pop(key, None)


def _mean(models: list[torch.Tensor]) -> torch.Tensor:
    """The elementwise mean of `models` (at least one), in a new tensor, summed in their order."""
    total = models[0].clone()
    for values in models[1:]:
        total.add_(values)
    return total.div_(len(models))
