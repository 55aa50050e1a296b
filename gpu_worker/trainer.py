"""The training loop as a library: wrap a model, call `step()` after each backward pass.

    trainer = Trainer(model, session, assignment, total_steps=1000, evaluate=evaluate)
    trainer.start()
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        trainer.step(loss.item(), samples=len(x))
    trainer.finish()

The scheme (sync, asgd, ...) decides what `start`, `step` and `finish` exchange with the shards.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

import torch

from gpu_worker.schemes import WORKER_SCHEMES
from gpu_worker.schemes.base import Replica
from gradps import metrics
from gradps.cuts import Cuts
from gradps.errors import RolledBack
from gradps.parameter_client import ParameterClient, tensor_specs
from gradps.schemes import get_scheme
from gradps.v1 import coordinator_pb2 as cpb
from gradps.worker_session import Assignment, RunAbandoned, WorkerSession

Evaluate = Callable[[torch.nn.Module], tuple[float, float]]
# Mixes seed, rank and step into one 63-bit seed (a large prime).
_MIX = 1_000_000_007
_SEED_MASK = (1 << 63) - 1
_LOGGER = logging.getLogger("gradps.worker")


def weights_digest(params: dict[str, torch.Tensor]) -> bytes:
    """SHA-256 over the parameters' bytes, in name order: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


class Trainer:
    """One worker's side of a run: its model replica, its shard connections, its scheme."""

    def __init__(
        self,
        model: torch.nn.Module,
        session: WorkerSession,
        assignment: Assignment,
        total_steps: int,
        evaluate: Evaluate | None = None,
        report_every: int = 10,
        transport: str = "shm",
        seek: Callable[[int], None] | None = None,
    ) -> None:
        """`transport`: where payloads travel (gradps.transport.TRANSPORTS, see ParameterClient).
        `seek(step)`: puts the data where it was before step `step`, for a worker that starts past
        step 0 or goes back to a checkpoint after a shard restarted (None: the data stays put)."""
        self.model = model
        self.session = session
        self.assignment = assignment
        self.spec = assignment.spec
        self.total_steps = total_steps
        self.evaluate = evaluate
        self.report_every = max(1, report_every)
        # Only parameters live on the shards; models with buffers keep them local.
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters())
        placed = session.placed(assignment.run_id, tensor_specs(self.params), total_steps)
        self.client = ParameterClient(
            placed.placement,
            assignment.run_id,
            session.worker_id,
            self.spec.codec,
            self.spec.pull_codec,
            transport=transport,
            # Rank 0 declares the cuts where the shards must checkpoint one step together.
            cuts=Cuts(self.spec, declares=assignment.rank == 0 and get_scheme(self.spec.scheme).common_cut),
            abandoned=lambda: session.stopping,
        )
        # 0, the step a resumed run's shards went back to, or where a worker joining a running run enters.
        self.steps_done = placed.start_step
        replica = Replica(model, self.params, self.client, self.spec, assignment, total_steps, placed.start_step)
        self.scheme = WORKER_SCHEMES[self.spec.scheme](replica)
        self.client.restore_epoch = placed.restore_epoch
        self.samples = 0
        self._loss_sum = 0.0
        self._loss_n = 0
        self._last_loss = float("nan")
        # Seconds the training loop spent blocked in the scheme's exchanges with the shards.
        self._wait_s = 0.0
        self._started = 0.0
        # Prometheus series of this process (served where the service serves /metrics).
        self._series = metrics.WorkerSeries(self.spec.scheme, self.spec.codec, self.spec.pull_codec, transport)
        self._step_began = 0.0
        self._seek = seek
        if self.steps_done and seek is not None:
            seek(self.steps_done)

    def start(self) -> None:
        """Upload this replica's initial weights (first upload wins) and take the global ones.
        The clock (Metrics.elapsed_s, wait_s) starts after: start-up is not training time, as the
        DDP baseline's clock starts after its ranks' barrier (wagma's first round waits for
        every worker, which a partner slower to start would otherwise add to this one's time)."""
        with torch.no_grad():
            self.client.register(self.params)
        try:
            self.scheme.start()
        except RolledBack as e:  # the run went back while this worker joined it
            self.steps_done = self._go_back(e, self.steps_done)
        self._started = self._step_began = time.perf_counter()
        self._seed_step()

    def step(self, loss: float, samples: int) -> None:
        """Exchange with the shards after one backward pass, then clear the gradients."""
        if self.session.stopping:
            raise RunAbandoned(f"run {self.assignment.run_id} was stopped")
        before = self.steps_done
        with torch.no_grad():
            began = time.perf_counter()
            self.steps_done = min(self._exchange(before), self.total_steps)
            now = time.perf_counter()
            self._wait_s += now - began
        self._series.step(max(0, self.steps_done - before), samples, now - self._step_began, now - began)
        self._series.traffic(self.client.traffic.bytes_pushed, self.client.traffic.bytes_pulled)
        self._step_began = now
        for p in self.params.values():
            p.grad = None
        self._seed_step()
        self.samples += samples
        self._loss_sum += loss
        self._loss_n += 1

        def crossed(every: int) -> bool:  # a scheme may skip steps, so look for a crossed multiple
            return every > 0 and before // every != self.steps_done // every

        evaluate_now = (
            self.evaluate is not None
            and self.assignment.rank == 0
            and crossed(self.spec.eval_every)
            and not self.finished
        )
        if evaluate_now or crossed(self.report_every):
            self._report(evaluate_now, done=False)

    def _seed_step(self) -> None:
        """Seed torch's generator from the run's seed, this rank and the step about to be computed:
        dropout and the randomized codecs draw the same when a step is done again (after a go-back,
        in a resumed run), so no generator state needs handing in with a checkpoint."""
        seed = ((self.spec.seed * _MIX + self.assignment.rank) * _MIX + self.steps_done) & _SEED_MASK
        # Not torch.manual_seed: before CUDA is initialized it captures the call's stack for each
        # kind of accelerator, every step (8% of a small model's step in a profile).
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)

    def _exchange(self, step: int) -> int:
        """The scheme's exchange after step `step`'s backward; the step to go on from, which is
        earlier when the run went back to a checkpoint (a shard of it restarted)."""
        try:
            return self.scheme.after_backward(step)
        except RolledBack as e:
            return self._go_back(e, step)

    def _go_back(self, told: RolledBack, step: int) -> int:
        """The run went back to a checkpoint (`told` by a shard at step `step`): the scheme takes
        that step's state and the data goes back there; the step to go on from."""
        if not self.session.still_in_run():  # a stopped run resumed: its next part is this worker's
            raise RunAbandoned(f"run {self.assignment.run_id} was stopped")
        while True:  # told again while going back (another shard restarted): go back there
            _LOGGER.warning(
                "run %s: a shard restarted; going back from step %d to %d", self.assignment.run_id, step, told.step
            )
            self.client.go_back(told.epoch)
            try:
                self.scheme.went_back(told.step)
                break
            except RolledBack as e:
                told = e
        if self._seek is not None:
            self._seek(told.step)
        return told.step

    @property
    def finished(self) -> bool:
        """True once the scheme's step counter reached the run's total steps."""
        return self.steps_done >= self.total_steps

    def finish(self, exported: bool = True) -> cpb.Metrics:
        """Bring the replica to the final global model, evaluate it, report done. `exported`:
        False where this replica is not the model the run exports even with the final weights
        (a launched run's rank other than 0 keeps buffers of its own)."""
        with torch.no_grad():
            self.scheme.finish(self.steps_done)
        final_model = exported and self.scheme.holds_final_model()
        metrics = self._report(self.evaluate is not None, done=True, final_model=final_model)
        self.client.close()
        return metrics

    def fail(self, error: str) -> None:
        """Report that this worker failed; the run fails."""
        m = self._metrics()
        m.error = error[:2000]
        try:
            self.session.report(self.assignment.run_id, m)
        finally:
            self.client.close()

    def _metrics(self) -> cpb.Metrics:
        t = self.client.traffic
        self._series.traffic(t.bytes_pushed, t.bytes_pulled)  # Prometheus agrees with each report
        return cpb.Metrics(
            rank=self.assignment.rank,
            step=self.steps_done,
            loss=self._loss_sum / self._loss_n if self._loss_n else self._last_loss,
            test_accuracy=-1.0,
            samples=self.samples,
            elapsed_s=time.perf_counter() - self._started,
            bytes_pushed=t.bytes_pushed,
            bytes_pulled=t.bytes_pulled,
            staleness_sum=t.staleness_sum,
            pushes=t.pushes,
            staleness_max=t.staleness_max,
            wait_s=self._wait_s,
            total_steps=self.total_steps,
        )

    def _report(self, evaluate: bool, done: bool, final_model: bool = False) -> cpb.Metrics:
        m = self._metrics()
        if evaluate and self.evaluate is not None:
            was_training = self.model.training
            model = self.scheme.eval_model()
            m.test_loss, m.test_accuracy = self.evaluate(model)
            self.model.train(was_training)
        m.done = done
        m.final_model = final_model
        if done:
            m.weights_digest = weights_digest(self.params)
        self._last_loss = m.loss
        self._loss_sum, self._loss_n = 0.0, 0
        self.session.report(self.assignment.run_id, m)
        return m
