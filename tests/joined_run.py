"""The test process as a run's workers: submit a run, join sessions, get the placement."""

from __future__ import annotations

import torch

from client.sdk import Client
from gradps.parameter_client import ParameterClient, tensor_specs
from gradps.v1 import run_pb2, shard_pb2, tensor_pb2
from gradps.worker_session import WorkerSession

NONE = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE)


def join_run(
    address: str,
    spec: run_pb2.RunSpec,
    tensors: dict[str, torch.Tensor],
    n_workers: int = 1,
    codec: tensor_pb2.CodecParams = NONE,
    transport: str = "shm",
    total_steps: int = 100,
) -> tuple[str, list[WorkerSession], list[ParameterClient], shard_pb2.Placement]:
    """Submit `spec`, join `n_workers` sessions as its workers and create the placement of a run
    of `total_steps`; returns (run_id, sessions, clients, placement). Close with `leave`."""
    with Client(address) as client:
        run_id = client.submit(spec)
    sessions = [WorkerSession(address, name=f"test-{i}") for i in range(n_workers)]
    assignments = [s.wait_for_assignment(wait_s=10) for s in sessions]
    assert all(a is not None and a.run_id == run_id for a in assignments)
    placement = sessions[0].placement(run_id, tensor_specs(tensors), total_steps=total_steps)
    clients = [
        ParameterClient(placement, run_id, s.worker_id, codec, NONE, timeout_s=10, transport=transport)
        for s in sessions
    ]
    return run_id, sessions, clients, placement


def asgd_steps(
    client: ParameterClient, tensors: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Register `tensors`, then pull and push each of `grads` in turn; the weights pulled last."""
    client.register(tensors)
    pulled = {n: torch.zeros_like(t) for n, t in tensors.items()}
    for step, grad in enumerate(grads):
        client.pull(pulled)
        client.push(grad, step)
    client.pull(pulled)
    return pulled


def leave(sessions: list[WorkerSession], clients: list[ParameterClient]) -> None:
    for c in clients:
        c.close()
    for s in sessions:
        s.close()
