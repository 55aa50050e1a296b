"""A small Python SDK over the coordinator's API: submit, watch, stop, delete and export runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message

from gradps.auth.tls import TlsFiles
from gradps.channel import open_channel
from gradps.codec_table import parse_codec
from gradps.run_spec import default_spec, validate, with_defaults
from gradps.schemes import DEFAULT_SCHEME, PARAMS
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc, run_pb2, tensor_pb2

if TYPE_CHECKING:
    import torch

_OPTIMIZER_FIELDS = frozenset(run_pb2.OptimizerSpec.DESCRIPTOR.fields_by_name) - {"name"}
_RUN_FIELDS = frozenset(f.name for f in run_pb2.RunSpec.DESCRIPTOR.fields if f.message_type is None)


def run_spec(scheme: str = DEFAULT_SCHEME, **options: object) -> run_pb2.RunSpec:
    """A RunSpec as `gradps train` builds it from the same options: what is not given keeps its
    default (`gradps.run_spec.default_spec`: ssp's staleness bound 2, evaluation every 50 steps,
    ...), so a script and the CLI get the same run for the same choices.

    Options are the CLI's, as keywords: RunSpec fields (workers=4, steps=100), OptimizerSpec
    fields (lr=0.1; optimizer="adam" names it), SchemeParams fields (staleness=3), and codec or
    pull_codec as a CLI string ("topk:0.01") or CodecParams. TypeError on an unknown option,
    ValueError on a spec the coordinator would refuse.
    """
    spec = default_spec()
    spec.scheme = scheme
    for key, value in options.items():
        _set_option(spec, key, value)
    validate(with_defaults(spec))
    return spec


def _set_option(spec: run_pb2.RunSpec, key: str, value: object) -> None:
    if key == "optimizer":
        spec.optimizer.name = str(value)
    elif key in _OPTIMIZER_FIELDS:
        setattr(spec.optimizer, key, value)
    elif key in PARAMS:
        setattr(spec.scheme_params, key, value)
    elif key in ("codec", "pull_codec"):
        codec = parse_codec(value) if isinstance(value, str) else value
        if not isinstance(codec, tensor_pb2.CodecParams):
            raise TypeError(f"{key} must be a codec string or CodecParams, got {type(value).__name__}")
        getattr(spec, key).CopyFrom(codec)
    elif key in _RUN_FIELDS and key != "scheme":
        setattr(spec, key, value)
    else:
        raise TypeError(f"run_spec() got an unknown option {key!r}")


class GradpsError(Exception):
    """A failure a user can act on; its message is one line."""


def _describe(e: grpc.RpcError, address: str) -> GradpsError:
    if e.code() == grpc.StatusCode.UNAVAILABLE:
        return GradpsError(f"no coordinator reachable at {address}")
    if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a shard's port, or another gRPC server
        return GradpsError(f"{address} is not a gradps coordinator ({e.details()})")
    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
        return GradpsError(f"UNAUTHENTICATED: {e.details()}; give an admin token (GRADPS_TOKEN or GRADPS_TOKEN_FILE)")
    return GradpsError(f"{e.code().name}: {e.details()}")


class Client:
    """Talks to one coordinator."""

    def __init__(
        self, coordinator: str, timeout_s: float = 30.0, token: str | None = None, tls: TlsFiles | None = None
    ) -> None:
        """`token`: an admin token (default: `gradps.auth.client_tokens.client_token`'s: GRADPS_TOKEN, ...);
        `tls`: the CA (and for mTLS the certificate) to connect with (default: `gradps.auth.tls.client_tls`'s:
        GRADPS_TLS_CA, ...)."""
        self.address = coordinator
        self.timeout_s = timeout_s
        self._channel = open_channel(coordinator, token, tls)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Message, timeout: float | None = None) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.timeout_s)
        except grpc.RpcError as e:
            raise _describe(e, self.address) from None

    def submit(self, spec: run_pb2.RunSpec) -> str:
        """Queue a run; returns its id. Build `spec` with `run_spec` for the CLI's defaults: in a
        RunSpec made by hand, a field left at 0 means what the proto says (ssp's staleness 0
        waits like sync)."""
        return self._call("SubmitRun", cpb.SubmitRunRequest(spec=spec)).run_id

    def run(self, run_id: str) -> cpb.GetRunResponse:
        """A run's status and placement table."""
        return self._call("GetRun", cpb.GetRunRequest(run_id=run_id))

    def runs(self) -> list[cpb.RunStatus]:
        """Every run, oldest first."""
        return list(self._call("ListRuns", cpb.ListRunsRequest()).runs)

    def stop(self, run_id: str, reason: str = "") -> None:
        """Stop a run; `reason` (one line) becomes its message, "stopped by a client" without one."""
        self._call("StopRun", cpb.StopRunRequest(run_id=run_id, reason=reason))

    def scale(self, run_id: str, workers: int) -> cpb.ScaleRunResponse:
        """Train the running run with `workers` of its ranks (1 to its spec's workers): the
        highest ranks' workers leave it, or idle workers take its empty ranks."""
        return self._call("ScaleRun", cpb.ScaleRunRequest(run_id=run_id, workers=workers))

    def checkpoint(self, run_id: str) -> list[cpb.ShardCheckpoint]:
        """Every shard of the run writes a checkpoint of it now; each shard's, once on disk."""
        return list(self._call("TakeCheckpoint", cpb.TakeCheckpointRequest(run_id=run_id)).checkpoints)

    def checkpoints(self, run_id: str) -> cpb.ListRunCheckpointsResponse:
        """The steps every shard holding parts of the run has a checkpoint of, oldest first (what
        `export_state_dict(checkpoint_step=...)` takes), and each shard's own steps."""
        return self._call("ListRunCheckpoints", cpb.ListRunCheckpointsRequest(run_id=run_id))

    def resume(self, run_id: str) -> None:
        """Take up a failed or stopped run again from its newest step checkpointed on every shard
        (the shards need a state dir and the run --checkpoint-every): it waits for
        free workers as a new run does."""
        self._call("ResumeRun", cpb.ResumeRunRequest(run_id=run_id))

    def delete(self, run_id: str) -> None:
        """Delete an ended run (its status, metrics and the parameters its shards keep); a
        pending or running run is refused (FAILED_PRECONDITION): stop it first."""
        self._call("DeleteRun", cpb.DeleteRunRequest(run_id=run_id))

    def cluster(self) -> cpb.GetClusterResponse:
        """The live shards and workers (and those declared dead lately)."""
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

    def export_state_dict(self, run_id: str, checkpoint_step: int | None = None) -> dict[str, torch.Tensor]:
        """The run's current parameters, assembled from all shards (through the coordinator), as a
        state_dict; with `checkpoint_step`, those of its checkpoint at that step (`checkpoints`)."""
        # torch is loaded by the calls that return tensors alone: the CLI's other commands start
        # in a fraction of a second without it.
        import torch

        from gradps.parameter_client import copy_part_into

        placement = self.run(run_id).placement
        if not placement.tensors:
            raise GradpsError(f"run {run_id} has no parameters on the shards yet")
        state = {t.name: torch.zeros(tuple(t.shape), dtype=torch.float32) for t in placement.tensors}
        flat = {name: t.view(-1) for name, t in state.items()}
        received = 0
        request = cpb.ExportRunRequest(run_id=run_id, checkpoint_step=checkpoint_step)
        try:
            for response in self._stub.ExportRun(request, timeout=max(self.timeout_s, 300)):
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
