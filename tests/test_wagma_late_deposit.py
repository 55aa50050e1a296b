"""A wagma deposit that arrives after the shard stopped keeping its round, sent to a real shard
server over gRPC: FAILED_PRECONDITION naming the step to jump to, never UNKNOWN, and the shard's
rounds go on as before."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from gradps import wire
from gradps.parameter_client import tensor_specs
from gradps.placement import place
from gradps.v1 import run_pb2, shard_pb2
from tests.test_data_stream import _in_process_shards, _part, _shard

WORKERS = [0, 1]


def _deposit(stub, worker: int, step: int, placement: shard_pb2.Placement, value: float) -> tuple[float, int]:
    """Worker `worker`'s model (every element `value`) for the round (step, both workers): the
    round's average (one element of it) and the frontier the shard answers with."""
    requests = []
    for p in placement.parts:
        request = shard_pb2.GroupAverageRequest(
            run_id="r1", worker_id=worker, step=step, members=WORKERS, part_count=len(placement.parts)
        )
        request.part.CopyFrom(_part(p, payload=np.full(p.count, value, np.float32).tobytes()))
        requests.append(request)
    parts = [p for response in stub.GroupAverage(iter(requests), timeout=10) for p in wire.parts_of(response)]
    return float(np.frombuffer(parts[0].payload, np.float32)[0]), max(p.version for p in parts)


def test_a_deposit_older_than_the_kept_rounds_gets_failed_precondition_with_the_frontier():
    with _in_process_shards([None]) as (address,), _shard(address) as stub:
        placement = place(tensor_specs({"w": torch.zeros(16)}), [address], 1 << 20)
        sgd = run_pb2.OptimizerSpec(name="sgd", lr=0.1)
        spec = run_pb2.RunSpec(scheme="wagma", workers=2, steps=100, optimizer=sgd)
        stub.OpenRun(
            shard_pb2.OpenRunRequest(run_id="r1", spec=spec, placement=placement, workers=WORKERS, total_steps=100),
            timeout=10,
        )
        assert _deposit(stub, 0, 5, placement, 5.0) == (5.0, 5)
        assert _deposit(stub, 0, 6, placement, 6.0) == (6.0, 6)
        # Worker 0's step-3 deposit, delayed behind its two newer ones.
        with pytest.raises(grpc.RpcError) as err:
            _deposit(stub, 0, 3, placement, 3.0)
        details = err.value.details() or ""
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (err.value.code(), details)
        assert "round at step 3 is gone" in details and "jump to step 6" in details and "\n" not in details
        # Nothing changed: worker 1, arriving first at step 7, mixes with worker 0's step-6 model.
        assert _deposit(stub, 1, 7, placement, 8.0) == (7.0, 7)
