"""How a shard's handler waits on a run (a sync pull, an ssp clock, a wagma round) without
outliving its call, and without holding a thread while it waits (`call_park`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from gradps.channel import wait_for_call
from gradps.errors import Cancelled, Ended, RolledBack, TimedOut
from gradps.serving import Park, parked
from ps_server.run_state import RunState, Wait

# The slices in which a waiting call checks that its client is still there and its deadline not passed.
_WAIT_SLICE_S = 0.25


def call_park(run: RunState, ready: Callable[[], bool], timeout_s: float, key: object = None) -> Iterator[Park]:
    """For a handler generator, before it takes `run.cond` to wait with `call_wait`: parks the
    call, holding no thread, until `ready()` is (or the run ended, closed or went back to a
    checkpoint, or `timeout_s` passed, or the call ended). `call_wait` then finds it so at once,
    or waits out what is left: the decision is always made under the lock. `key`: what
    `ready` waits for, the same for calls that wait for the same (`gradps.serving.parked`)."""
    epoch = run.restore_epoch

    def settled() -> bool:
        return run.restore_epoch != epoch or run.closed or run.ended or ready()

    yield from parked(run.cond, settled, timeout_s, None if key is None else (epoch, key))


def call_wait(run: RunState, context: grpc.ServicerContext, waiting: str) -> Wait:
    """How a call waits on `run.cond` (held) for what `waiting` names: a call whose client
    cancelled or whose deadline passed frees its thread at once (Cancelled, TimedOut) rather than
    after its whole wait; a run that ended or closed meanwhile ends the wait (Ended), and one that
    went back to a checkpoint (RolledBack)."""
    epoch = run.restore_epoch

    def ready_or_over(ready: Callable[[], bool]) -> bool:
        if run.restore_epoch != epoch:
            raise RolledBack(run.run_id, run.restore_epoch, run.restored_step)
        if ready():
            return True
        if run.closed or run.ended:
            raise Ended(f"run {run.run_id!r} {'was closed on this shard' if run.closed else 'ended'}")
        return False

    def wait(ready: Callable[[], bool], timeout_s: float) -> bool:
        if wait_for_call(run.cond, lambda: ready_or_over(ready), timeout_s, context, _WAIT_SLICE_S):
            return True
        if not context.is_active():
            raise Cancelled(f"{waiting}: the call was cancelled")
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise TimedOut(f"{waiting}: the call's deadline passed")
        return False

    return wait
