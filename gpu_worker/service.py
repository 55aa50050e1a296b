"""The worker service: join, wait for a run, train it with the built-in models and datasets."""

from __future__ import annotations

import logging
import threading
import time

import click
import grpc
import torch

from gpu_worker.trainer import Trainer
from gradps.auth.options import allow_import_option, client_tls_options, option_token, token_options, use_client_tls
from gradps.channel import coordinator_option, metrics_options, serve_metrics, stop_on_signal
from gradps.datasets import ShardSampler, load_dataset
from gradps.device import device_option
from gradps.evaluation import compute_loss, evaluate
from gradps.logs import configure_logging, log_options, set_log_context
from gradps.models import build_model
from gradps.run_spec import total_steps
from gradps.slowdown import Slowdown
from gradps.transport import TRANSPORTS
from gradps.v1 import coordinator_pb2
from gradps.worker_session import Assignment, RunAbandoned, WorkerSession

_LOGGER = logging.getLogger("gradps.worker")


def train(
    session: WorkerSession,
    assignment: Assignment,
    device: torch.device,
    stop: threading.Event,
    transport: str = "shm",
    allow_import: tuple[str, ...] = (),
) -> None:
    """Train one assigned run to the end (or until it is stopped, or the service shuts down).
    A model or dataset import path outside `allow_import` fails the run: nothing is imported."""
    spec = assignment.spec
    dataset = load_dataset(spec.dataset, spec.dataset_size, spec.seed, allow_import=allow_import)
    torch.manual_seed(spec.seed)  # every replica starts from the same weights
    model = build_model(spec.model, dataset, allow_import=allow_import).to(device)
    steps = total_steps(assignment.spec, assignment.world, len(dataset.train_x))
    sampler = ShardSampler(len(dataset.train_x), assignment.rank, assignment.world, spec.batch_size, spec.seed)
    trainer = Trainer(
        model,
        session,
        assignment,
        steps,
        evaluate=lambda m: evaluate(m, dataset),
        report_every=max(1, min(20, steps // 50)),
        transport=transport,
        seek=sampler.seek,
    )
    slowdown = Slowdown(spec, assignment.rank)
    try:
        trainer.start()
        model.train()
        while not trainer.finished:
            if stop.is_set():
                raise RunAbandoned(f"run {assignment.run_id}: worker shutting down")
            began = time.perf_counter()
            idx = sampler.next_batch()
            x, y = dataset.train_x[idx].to(device), dataset.train_y[idx].to(device)
            loss = compute_loss(model, x, y, dataset.task)
            loss.backward()
            trainer.step(loss.item(), len(idx))
            slowdown.after(time.perf_counter() - began)
        m = trainer.finish()
        _LOGGER.info("run %s done: %d steps, test accuracy %.4f", assignment.run_id, steps, m.test_accuracy)
    except RunAbandoned as e:
        _LOGGER.warning("%s", e)
        trainer.client.close()
    except grpc.RpcError as e:
        if session.stopping:
            why = "left: worker shutting down" if stop.is_set() else "stopped"
            _LOGGER.warning("run %s %s", assignment.run_id, why)
            trainer.client.close()
            return
        _LOGGER.error("run %s: %s %s", assignment.run_id, e.code().name, e.details())
        trainer.fail(f"{e.code().name}: {e.details()}")


def serve(
    coordinator: str,
    device: torch.device,
    name: str | None,
    stop: threading.Event,
    transport: str = "shm",
    allow_import: tuple[str, ...] = (),
    token: str | None = None,
) -> None:
    """Join (with `token`, default GRADPS_TOKEN's) and train assignments until `stop` is set."""
    session = WorkerSession(coordinator, name=name, device=str(device), stop=stop, token=token)
    lost = False
    try:
        while not stop.is_set():
            try:
                assignment = session.wait_for_assignment(wait_s=1.0)
            except grpc.RpcError as e:
                # The coordinator restarts, or is stopping with us: wait for it (the heartbeat
                # thread rejoins once it answers), or leave quietly on our own SIGTERM.
                if not lost:
                    _LOGGER.warning("coordinator %s: %s; waiting for it", coordinator, e.code().name)
                lost = True
                stop.wait(1.0)
                continue
            if lost:
                _LOGGER.info("coordinator %s is back", coordinator)
                lost = False
            if assignment is None:
                continue
            set_log_context(run_id=assignment.run_id, worker_id=session.worker_id)
            _LOGGER.info("run %s: rank %d of %d", assignment.run_id, assignment.rank, assignment.world)
            try:
                train(session, assignment, device, stop, transport, allow_import)
            except Exception as e:  # a broken model or dataset fails the run, not the service
                _LOGGER.exception("run %s failed", assignment.run_id)
                try:
                    session.report(assignment.run_id, _failure(e))
                except (grpc.RpcError, RunAbandoned):
                    pass
            finally:
                set_log_context(run_id=None)
    finally:
        session.close()


def _failure(e: Exception) -> coordinator_pb2.Metrics:
    """A report that fails the run: the model or dataset could not be built, or training broke."""
    # An RpcError prints as a multi-line dump of the call; its code and details are what matter.
    why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
    return coordinator_pb2.Metrics(error=" ".join(why.split())[:2000], test_accuracy=-1.0)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@coordinator_option
@device_option("Where the model trains (auto: CUDA when present).", envvar="GRADPS_DEVICE")
@click.option(
    "--name", envvar="GRADPS_WORKER_NAME", show_envvar=True, default=None, help="Name shown in `gradps status`."
)
@click.option(
    "--threads",
    envvar="GRADPS_THREADS",
    show_envvar=True,
    default=1,
    type=click.IntRange(min=1),
    help="torch intra-op threads.",
)
@click.option(
    "--transport",
    envvar="GRADPS_TRANSPORT",
    show_envvar=True,
    type=click.Choice(TRANSPORTS),
    default="shm",
    help="Where payloads travel: shm (shared memory with shards on this host, a data stream to others), "
    "stream (a data stream to every shard: raw TCP beside gRPC), grpc (in the gRPC messages).",
)
@allow_import_option
@token_options
@client_tls_options
@metrics_options
@log_options
def main(
    coordinator: str,
    device: str,
    name: str | None,
    threads: int,
    transport: str,
    allow_import: tuple[str, ...],
    token: str | None,
    token_file: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
    metrics_port: int,
    metrics_host: str,
    metrics_port_file: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """gradps worker: joins the coordinator and trains the runs assigned to it."""
    configure_logging("worker", log_level, log_format)
    use_client_tls(tls_cert, tls_key, tls_ca)
    serve_metrics(metrics_port, metrics_host, metrics_port_file)  # what its Trainer records
    torch.set_num_threads(threads)
    stop = stop_on_signal()
    try:
        serve(coordinator, torch.device(device), name, stop, transport, allow_import, option_token(token, token_file))
    except ConnectionError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    main()
