"""Your own training script as the workers of a run, started by `gradps launch` (as torchrun
starts a DDP script): `gradps.init()`, wrap the torch optimizer, loop over `gradps.batches`.

    import gradps
    gradps.init()
    sampler = DistributedSampler(train, num_replicas=gradps.world_size(), rank=gradps.rank())
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    optimizer = gradps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, test_data=test)
    for x, y in gradps.batches(loader):  # as many steps as `gradps launch --steps/--epochs` asks
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step(loss=loss)

`optimizer.step()` is the run's scheme step (gpu_worker.trainer.Trainer.step): the shards apply
the torch optimizer's translation (gradps.optimizer.spec_of), the torch optimizer itself never
steps. After the last step the model holds the final global parameters, and its buffers
(BatchNorm running statistics) the average of every rank's.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar

import grpc
import torch
from google.protobuf.json_format import MessageToDict
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from gpu_worker.trainer import Evaluate, Trainer
from gradps.launching import (
    COORDINATOR_ENV,
    LAUNCH_DIR_ENV,
    RANK_ENV,
    TRANSPORT_ENV,
    WORLD_SIZE_ENV,
    buffers_file,
    joined_file,
    rank_buffers_file,
    read_json,
    ready_file,
    run_file,
    worker_file,
    write_json,
)
from gradps.optimizer import spec_of
from gradps.worker_session import Assignment, RunAbandoned, WorkerSession

# How long rank 0 waits for the other ranks' buffers after its last step (a rank that died sends none).
_BUFFERS_WAIT_S = 60.0
_POLL_S = 0.05
Batch = TypeVar("Batch")


class LaunchError(RuntimeError):
    """A script that cannot run as launched workers; its message is one line (printed alone)."""


@dataclass
class _Launch:
    """This process as one of `gradps launch`'s scripts."""

    coordinator: str
    rank: int
    world: int
    launch_dir: Path
    transport: str
    session: WorkerSession
    launcher_pid: int
    optimizer: DistributedOptimizer | None = None


_launch: _Launch | None = None


def init() -> None:
    """Join the run's cluster as one worker (the coordinator and the rank come from `gradps
    launch`'s environment). LaunchError when the script was not started by `gradps launch`."""
    global _launch
    if _launch is not None:
        return
    _one_line_errors()
    coordinator, launch_dir = os.environ.get(COORDINATOR_ENV), os.environ.get(LAUNCH_DIR_ENV)
    if not coordinator or not launch_dir:
        raise LaunchError(
            f"gradps.init(): not started by gradps launch ({LAUNCH_DIR_ENV} is unset); "
            "run: gradps launch --workers N script.py"
        )
    rank, world = int(os.environ.get(RANK_ENV, "0")), int(os.environ.get(WORLD_SIZE_ENV, "1"))
    folder, launcher = Path(launch_dir), os.getppid()
    _wait_for(ready_file(folder), launcher)  # the local cluster starts while the scripts do
    if rank > 0:  # join in rank order: the run's rank k (by worker id) is then this launch's rank k
        _wait_for(joined_file(folder, rank - 1), launcher)
    # The launcher's stop (SIGTERM) is held while the script joins: a joined script must be able to
    # leave the cluster (atexit, the handler), so it gets both before the signal can end it.
    mask_before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        try:
            session = WorkerSession(coordinator, name=f"launch-rank-{rank}")
        except ConnectionError as e:
            raise LaunchError(str(e)) from None
        joined_file(folder, rank).touch()
        _launch = _Launch(coordinator, rank, world, folder, os.environ.get(TRANSPORT_ENV, "shm"), session, launcher)
        atexit.register(_leave)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # the launcher's stop: leave the cluster
            signal.signal(signal.SIGTERM, _stop)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask_before)


def _stop(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (the launcher's stop): exit, which leaves the cluster (atexit)."""
    _exiting()
    sys.exit(128 + signum)


def _exiting() -> None:
    """The script is on its way out: a SIGTERM now (the launcher stops the scripts once their run
    ended) must not cut short its leaving the cluster, or the coordinator counts it alive until its
    heartbeat times out. The launcher's SIGKILL after its grace still bounds the exit."""
    if signal.getsignal(signal.SIGTERM) is _stop and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def rank() -> int:
    """This script's rank among the launched ones, 0 to world_size() - 1: shard the data by it.
    It is the run's rank too: rank 0 measures the test accuracy."""
    return _require("gradps.rank()").rank


def world_size() -> int:
    """How many scripts `gradps launch` started (its --workers)."""
    return _require("gradps.world_size()").world


def _require(what: str) -> _Launch:
    if _launch is None:
        raise LaunchError(f"{what}: call gradps.init() first")
    return _launch


class DistributedOptimizer:
    """A torch optimizer whose `step()` is a step of the run: the gradients go to the shards,
    which apply this optimizer (SGD, Adam or AdamW, read from its param groups), and the model
    takes the run's weights as its scheme says. `test_data` (a torch Dataset or DataLoader of
    (input, label) pairs) or `evaluate` (`fn(model) -> (test_loss, test_accuracy)`) gives the
    run's test accuracy, measured on rank 0."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        test_data: Any = None,
        evaluate: Evaluate | None = None,
    ) -> None:
        launch = _require("gradps.DistributedOptimizer")
        if launch.optimizer is not None:
            raise LaunchError("one gradps.DistributedOptimizer per script: a run trains one model")
        try:
            self.spec = spec_of(optimizer)
        except ValueError as e:
            raise LaunchError(str(e)) from None
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if held != {id(p) for p in model.parameters()}:
            raise LaunchError("the optimizer must hold every parameter of the model and no other: the shards hold them")
        if test_data is not None and evaluate is not None:
            raise LaunchError("give DistributedOptimizer test_data or evaluate, not both")
        self.optimizer = optimizer
        self.model = model
        self._evaluate = evaluate if test_data is None else (lambda m: _classification_test(m, test_data))
        self.trainer: Trainer | None = None
        # Samples in the batch `batches` handed out last: the step's samples.
        self._samples = 0
        self._ended = False
        write_json(
            worker_file(launch.launch_dir, launch.rank),
            {"worker_id": launch.session.worker_id, "optimizer": MessageToDict(self.spec)},
        )
        launch.optimizer = self

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's param groups, as they were read: the shards apply those
        settings; changing them now changes nothing (the run's schedule is `gradps launch
        --schedule`, `--warmup-steps`)."""
        return self.optimizer.param_groups

    @property
    def finished(self) -> bool:
        """True once the run's last step is taken."""
        return self.trainer is not None and self.trainer.finished

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (a step clears them too)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, *, loss: Any = None) -> Any:
        """One step of the run, from the gradients in the parameters' .grad. `loss` (the batch's
        loss) is what the progress shows; a torch-style `closure` computes it. After the run's
        last step the model holds the final one."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        trainer = self._start(steps_per_epoch=None)
        if trainer.finished:
            raise LaunchError(
                f"the run's {trainer.total_steps} steps are done: loop over gradps.batches(loader), "
                "or stop once optimizer.finished"
            )
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss
        try:
            trainer.step(float(value) if value is not None else math.nan, self._samples)
            if trainer.finished:
                self._finish(trainer)
        except grpc.RpcError as e:
            raise _one_line(e) from None
        return loss

    def _start(self, steps_per_epoch: int | None) -> Trainer:
        """The run's Trainer, made at the first step, once the launcher's run is assigned."""
        if self.trainer is not None:
            return self.trainer
        launch = _require("gradps.DistributedOptimizer")
        assignment = _wait_for_run(launch)
        spec = assignment.spec
        if spec.steps:
            total = spec.steps
        elif steps_per_epoch:
            total = max(1, math.ceil(spec.epochs * steps_per_epoch))
        else:
            raise LaunchError(
                "the run counts epochs (gradps launch --epochs): loop over gradps.batches(loader) so that "
                "an epoch has a length, or give gradps launch --steps"
            )
        try:
            self.trainer = Trainer(
                self.model,
                launch.session,
                assignment,
                total,
                evaluate=self._evaluate,
                report_every=max(1, min(20, total // 50)),
                transport=launch.transport,
            )
            self.trainer.start()
        except grpc.RpcError as e:
            raise _one_line(e) from None
        return self.trainer

    def _finish(self, trainer: Trainer) -> None:
        """After the last step: the ranks' buffers averaged into rank 0's model, the final model
        evaluated and reported."""
        launch = _require("gradps.DistributedOptimizer")
        saved = self.model.state_dict().keys()  # not the non-persistent buffers a state_dict leaves out
        buffers = {name: b.detach().cpu().contiguous() for name, b in self.model.named_buffers() if name in saved}
        if buffers:
            _save(buffers, rank_buffers_file(launch.launch_dir, trainer.assignment.rank))
            if trainer.assignment.rank == 0:
                average = _average_buffers(launch.launch_dir, trainer.assignment.world, buffers)
                with torch.no_grad():
                    for name, b in self.model.named_buffers():
                        if name in average:
                            b.copy_(average[name])
                _save(average, buffers_file(launch.launch_dir))
        self._ended = True
        trainer.finish(exported=not buffers or trainer.assignment.rank == 0)

    def _fail(self, reason: str) -> None:
        """Fail the run with `reason` (this script broke before the run's end); best effort."""
        if self.trainer is None or self._ended:
            return
        self._ended = True
        try:
            self.trainer.fail(reason)
        except Exception:  # the coordinator may be gone already; the launcher reports the exit
            pass


def batches(loader: Iterable[Batch]) -> Iterator[Batch]:
    """The batches of `loader`, epoch after epoch (calling its sampler's `set_epoch`), until the
    run's last step: `gradps launch --steps N`, or `--epochs E` passes over `loader` (each rank's
    loader must have the same length: a DistributedSampler gives every rank an equal share)."""
    optimizer = _require("gradps.batches").optimizer
    if optimizer is None:
        raise LaunchError("gradps.batches(loader): create the gradps.DistributedOptimizer first")
    per_epoch = len(loader) if isinstance(loader, Sized) else None
    if per_epoch == 0:
        raise LaunchError("gradps.batches(loader): the loader has no batches")
    trainer = optimizer._start(per_epoch)
    epoch = 0
    while not trainer.finished:
        set_epoch = getattr(getattr(loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        before = trainer.steps_done
        for batch in loader:
            optimizer._samples = _batch_samples(batch)
            yield batch
            if trainer.finished:
                return
        if trainer.steps_done == before:
            raise LaunchError("a whole epoch of gradps.batches(loader) took no optimizer.step()")
        epoch += 1


def _batch_samples(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor."""
    while isinstance(batch, list | tuple | dict) and batch:
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(batch) if isinstance(batch, torch.Tensor) and batch.dim() else 0


def _one_line(e: grpc.RpcError) -> Exception:
    """A call to the cluster that failed, as one line: the run ended elsewhere (stopped, or
    failed by another rank: the launcher says why), or what the cluster answered."""
    launch = _require("gradps")
    if launch.session.stopping or e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
        return RunAbandoned(f"rank {launch.rank}: the run ended ({e.details()})")
    return LaunchError(f"rank {launch.rank}: {e.code().name}: {e.details()}")


def _wait_for_run(launch: _Launch) -> Assignment:
    """The assignment of the run the launcher submitted (once every script wrapped its optimizer)."""
    _wait_for(run_file(launch.launch_dir), launch.launcher_pid)
    run_id = str((read_json(run_file(launch.launch_dir)) or {})["run_id"])
    while (assignment := launch.session.wait_for_assignment(wait_s=5.0)) is None:
        pass
    if assignment.run_id != run_id:
        raise LaunchError(
            f"this worker was given run {assignment.run_id}, not the launched run {run_id}: the cluster at "
            f"{launch.coordinator} has runs of its own waiting (launch on a cluster of its own: gradps up --workers 0)"
        )
    return assignment


def _wait_for(path: Path, launcher_pid: int) -> None:
    """Until the launcher (or another rank) made `path`; LaunchError once the launcher is gone."""
    while not path.exists():
        if os.getppid() != launcher_pid:
            raise LaunchError("gradps launch is gone: no run will come")
        time.sleep(_POLL_S)


def _classification_test(model: torch.nn.Module, data: Any) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of `model` over (input, label) batches of `data`."""
    loader = data if isinstance(data, DataLoader) else DataLoader(data, batch_size=512)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            logits = model(x.to(device))
            y = y.to(device)
            loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=-1) == y).sum())
            count += y.numel()
    model.train(was_training)
    return (loss / count, correct / count) if count else (math.nan, math.nan)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors (never pickle), whole or not at all: a reader polls for the file."""
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    save_file(tensors, temp)
    temp.replace(path)


def _average_buffers(launch_dir: Path, world: int, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's floating-point buffers averaged (BatchNorm's running mean and variance); the
    others (BatchNorm's batch counter) are rank 0's. Waits a while for ranks still finishing."""
    deadline = time.monotonic() + _BUFFERS_WAIT_S
    paths = [rank_buffers_file(launch_dir, r) for r in range(world)]
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    ranks = [load_file(p) for p in paths if p.exists()]
    return {
        name: torch.stack([r[name] for r in ranks]).mean(dim=0) if b.is_floating_point() else b
        for name, b in own.items()
    }


def _leave() -> None:
    """At exit: a script that ends before the run's last step fails the run with that reason;
    then leave the cluster."""
    launch = _launch
    if launch is None:
        return
    _exiting()
    optimizer, trainer = launch.optimizer, launch.optimizer.trainer if launch.optimizer else None
    if optimizer is not None and trainer is not None:
        optimizer._fail(f"rank {launch.rank}'s script ended at step {trainer.steps_done} of {trainer.total_steps}")
    launch.session.close()


def _one_line_errors() -> None:
    """gradps's own refusals (and a stopped run) print as one line, not a traceback; any uncaught
    error fails the run with its reason first."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        _exiting()
        if _launch is not None and _launch.optimizer is not None:
            _launch.optimizer._fail(" ".join(f"rank {_launch.rank}: {kind.__name__}: {error}".split()))
        if issubclass(kind, LaunchError | RunAbandoned):
            print(f"gradps: {error}", file=sys.stderr)
        else:
            previous(kind, error, tb)

    sys.excepthook = hook
