"""A small Python SDK over the coordinator's API: submit, watch, stop and export runs."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import torch

from gpu_worker.ps_client import copy_part_into
from gradps.channel import open_channel
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc, run_pb2


class GradpsError(Exception):
    """A failure a user can act on; its message is one line."""


def _describe(e: grpc.RpcError, address: str) -> GradpsError:
    if e.code() == grpc.StatusCode.UNAVAILABLE:
        return GradpsError(f"no coordinator reachable at {address}")
    if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a shard's port, or another gRPC server
        return GradpsError(f"{address} is not a gradps coordinator ({e.details()})")
    return GradpsError(f"{e.code().name}: {e.details()}")


class Client:
    """Talks to one coordinator."""

    def __init__(self, coordinator: str, timeout_s: float = 30.0) -> None:
        self.address = coordinator
        self.timeout_s = timeout_s
        self._channel = open_channel(coordinator)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, request, timeout: float | None = None):
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.timeout_s)
        except grpc.RpcError as e:
            raise _describe(e, self.address) from None

    def submit(self, spec: run_pb2.RunSpec) -> str:
        """Queue a run; returns its id."""
        return self._call("SubmitRun", cpb.SubmitRunRequest(spec=spec)).run_id

    def run(self, run_id: str) -> cpb.GetRunResponse:
        """A run's status and placement table."""
        return self._call("GetRun", cpb.GetRunRequest(run_id=run_id))

    def runs(self) -> list[cpb.RunStatus]:
        """Every run, oldest first."""
        return list(self._call("ListRuns", cpb.ListRunsRequest()).runs)

    def stop(self, run_id: str) -> None:
        """Stop a run."""
        self._call("StopRun", cpb.StopRunRequest(run_id=run_id))

    def cluster(self) -> cpb.GetClusterResponse:
        """The shards and workers that joined."""
        return self._call("GetCluster", cpb.GetClusterRequest())

    def watch(self, run_id: str) -> Iterator[cpb.WatchRunResponse]:
        """Events of a run until it ends."""
        try:
            yield from self._stub.WatchRun(cpb.WatchRunRequest(run_id=run_id))
        except grpc.RpcError as e:
            raise _describe(e, self.address) from None

    def wait_for_cluster(self, shards: int, workers: int, timeout_s: float = 60.0) -> cpb.GetClusterResponse:
        """Block until at least `shards` shards and `workers` live workers joined."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                cluster = self._stub.GetCluster(cpb.GetClusterRequest(), timeout=5)
                alive = sum(w.alive for w in cluster.workers)
                if len(cluster.shards) >= shards and alive >= workers:
                    return cluster
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise _describe(e, self.address) from None
            if time.monotonic() > deadline:
                raise GradpsError(f"cluster at {self.address} did not reach {shards} shards and {workers} workers")
            time.sleep(0.1)

    def export_state_dict(self, run_id: str) -> dict[str, torch.Tensor]:
        """The run's current parameters, assembled from all shards (through the coordinator), as a
        state_dict."""
        placement = self.run(run_id).placement
        if not placement.tensors:
            raise GradpsError(f"run {run_id} has no parameters on the shards yet")
        state = {t.name: torch.zeros(tuple(t.shape), dtype=torch.float32) for t in placement.tensors}
        flat = {name: t.view(-1) for name, t in state.items()}
        received = 0
        try:
            for response in self._stub.ExportRun(cpb.ExportRunRequest(run_id=run_id), timeout=max(self.timeout_s, 300)):
                part = response.part
                if part.name not in flat or part.offset + part.count > flat[part.name].numel():
                    raise GradpsError(f"run {run_id}: part {part.name}/{part.index} is not in the run's placement")
                copy_part_into(flat[part.name][part.offset : part.offset + part.count], part, part.payload)
                received += part.count
        except grpc.RpcError as e:
            raise GradpsError(f"cannot export run {run_id}: {e.code().name}: {e.details()}") from None
        expected = sum(t.numel() for t in state.values())
        if received != expected:
            raise GradpsError(f"run {run_id}: export received {received:,} of {expected:,} values")
        return state
