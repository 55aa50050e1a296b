"""Which steps of a run are checkpoint cuts, as a worker knows them.

A cut is a step whose checkpoint holds everything the run needs to go on from it. Its workers
know each cut before they push the step before it, for two reasons: a worker sends its
error-feedback residual whole in that push (so no residual is left over at a cut: a run that
goes back there, or resumes there, loses none), and pseudosync's rank 0 hands its replica in at
the cut's start.

The cuts are every RunSpec.checkpoint_every_steps-th step, and, where the shards must
checkpoint one step together (Scheme.common_cut: sync, pseudosync), the steps rank 0 declares:
every checkpoint_every_seconds by its own clock, and when the shards ask for a checkpoint
(PushResponse.cut_asked). It declares DECLARE_AHEAD steps ahead in its push
(PushRequest.cut_step): the shards' answers to every worker's exchange of the step after that
push name the cut, before any worker pushes the step before it.
"""

from __future__ import annotations

import threading
import time

from gradps.v1 import run_pb2

# How far ahead of the step it pushes rank 0 declares a cut (ps_server/checkpointing.py refuses
# a cut declared later than that).
DECLARE_AHEAD = 3


class Cuts:
    """A worker's view of its run's cuts: the scheduled ones, and those declared (by itself, when
    `declares`, or by rank 0 as the shards' answers name them). Safe to share between the
    threads that exchange with the shards."""

    def __init__(self, spec: run_pb2.RunSpec, declares: bool) -> None:
        self.every_steps = spec.checkpoint_every_steps
        self.every_s = spec.checkpoint_every_seconds
        self.declares = declares
        self._declared: set[int] = set()
        self._asked = False
        self._since = time.monotonic()
        self._lock = threading.Lock()

    def is_cut(self, step: int) -> bool:
        """Whether `step` is a cut (its checkpoint is taken at its start)."""
        if self.every_steps and step % self.every_steps == 0:
            return True
        with self._lock:
            self._declared -= {cut for cut in self._declared if cut < step}  # the past ones go
            return step in self._declared

    def learn(self, cut_step: int, asked: bool = False) -> None:
        """A shard's answer named `cut_step` as declared (0: none) and said whether a checkpoint
        is asked for."""
        with self._lock:
            if cut_step:
                self._declared.add(cut_step)
            self._asked |= asked and self.declares

    def declaration(self, step: int) -> int:
        """The cut to declare in this worker's push of `step` (0: none): rank 0's, once its
        interval has passed or a checkpoint is asked for."""
        if not self.declares:
            return 0
        now = time.monotonic()
        with self._lock:
            if not (self._asked or (self.every_s and now - self._since >= self.every_s)):
                return 0
            self._asked, self._since = False, now
            cut = step + DECLARE_AHEAD
            self._declared.add(cut)
            return cut
