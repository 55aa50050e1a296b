"""Bad requests to the shard service, against real shards: each gets its status code and a one-line
message, never a crash or a hang, and leaves weights, versions, membership and run state as they
were. Waiting calls (a pull's long poll, a global round) end with their call."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
import torch

from client.sdk import Client
from gradps import wire
from gradps.codec_table import parse_codec
from gradps.codecs import encode_part
from gradps.parameter_client import tensor_specs
from gradps.placement import place
from gradps.v1 import run_pb2, shard_pb2, shard_pb2_grpc, tensor_pb2
from tests.joined_run import NONE, join_run, leave
from tests.test_data_stream import _in_process_shards, _open_run, _part, _push_request, _rejected, _shard

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
FP16 = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_FP16)
BAD_DTYPE = 99  # no DType has this number


def _spec(scheme: str = "asgd", workers: int = 1, lr: float = 0.1) -> run_pb2.RunSpec:
    return run_pb2.RunSpec(
        scheme=scheme, workers=workers, steps=100, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=lr)
    )


@contextmanager
def _joined(address: str, spec: run_pb2.RunSpec, tensors: dict[str, torch.Tensor], workers: int = 1):
    """A run joined by `workers` sessions of this test, its tensors registered: (run_id, worker
    ids, placement)."""
    run_id, sessions, clients, placement = join_run(address, spec, tensors, n_workers=workers)
    try:
        clients[0].register(tensors)
        yield run_id, [s.worker_id for s in sessions], placement
    finally:
        leave(sessions, clients)


def _weights(stub, run_id: str, worker: int) -> dict[tuple[str, int], tuple[int, bytes]]:
    """Every part the shard holds for the run: (version, payload) by (name, index)."""
    out = {}
    for response in stub.Pull(shard_pb2.PullRequest(run_id=run_id, worker_id=worker), timeout=10):
        for p in wire.parts_of(response):
            out[(p.name, p.index)] = (p.version, bytes(p.payload))
    return out


def _values(p: shard_pb2.PartPlacement, value: float) -> bytes:
    return np.full(p.count, value, np.float32).tobytes()


def _push(stub, run_id: str, worker: int, step: int, part: tensor_pb2.TensorPart) -> shard_pb2.PushResponse:
    return stub.Push(iter([_push_request(run_id, worker, step, part)]), timeout=10)


def _register(stub, run_id: str, part: tensor_pb2.TensorPart, overwrite: bool = False):
    request = shard_pb2.RegisterTensorsRequest(run_id=run_id, overwrite=overwrite, part_count=1)
    request.part.CopyFrom(part)
    return stub.RegisterTensors(iter([request]), timeout=10)


def _deposit_requests(
    run_id: str,
    worker: int,
    step: int,
    members: list[int],
    parts: list[tensor_pb2.TensorPart],
    is_global=False,
    part_count: int | None = None,
) -> Iterator[shard_pb2.GroupAverageRequest]:
    """A deposit's messages, one part each, announcing `part_count` parts (default: all of `parts`)."""
    for part in parts:
        request = shard_pb2.GroupAverageRequest(
            run_id=run_id,
            worker_id=worker,
            step=step,
            members=members,
            is_global=is_global,
            part_count=len(parts) if part_count is None else part_count,
        )
        request.part.CopyFrom(part)
        yield request


def _group_average(stub, *args, **kwargs) -> dict[tuple[str, int], np.ndarray]:
    """A deposit (see _deposit_requests) and the round's average, by part."""
    responses = stub.GroupAverage(_deposit_requests(*args, **kwargs), timeout=10)
    return {(p.name, p.index): np.frombuffer(p.payload, np.float32) for r in responses for p in wire.parts_of(r)}


# --- 1. waiting calls end with their call -------------------------------------------------------------


@pytest.mark.parametrize("waiting", ["pull", "global round"])
def test_a_waiting_call_frees_its_thread_when_its_client_gives_up(waiting):
    """More waiting calls than the server has threads (8), given up by their clients (deadline or
    cancel): the shard still answers at once. Each would otherwise hold a thread for its whole wait
    (a pull's wait_ms up to 49 days, a global round 30 s). The calls come over three connections,
    as many callers (one may hold half the threads: 4 calls)."""
    tensors = {"w": torch.zeros(4)}
    with _in_process_shards([None]) as (address,), _shard(address) as stub:
        callers: list[shard_pb2_grpc.ShardServiceStub] = []
        made = iter(range(1_000_000))
        if waiting == "pull":
            _open_run([address], tensors, [0], 1 << 20)  # never registered: no pull is ever ready

            def call(timeout=None):
                request = shard_pb2.PullRequest(run_id="r1", worker_id=0, min_version=5, wait_ms=2**32 - 1)
                return callers[next(made) % 3].Pull(request, timeout=timeout)
        else:
            placement = place(tensor_specs(tensors), [address], 1 << 20)
            stub.OpenRun(
                shard_pb2.OpenRunRequest(
                    run_id="r1", spec=_spec("wagma", 2), placement=placement, workers=[0, 1], total_steps=10
                ),
                timeout=10,
            )
            deposit = [_part(placement.parts[0], payload=_values(placement.parts[0], 1.0))]

            def call(timeout=None):  # worker 1 never deposits: the round waits for it
                return callers[next(made) % 3].GroupAverage(
                    _deposit_requests("r1", 0, 0, [0, 1], deposit, is_global=True), timeout=timeout
                )

        for timeout in (0.5, None):  # given up at the deadline, then cancelled without one
            channels = [
                grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(3)
            ]
            callers[:] = [shard_pb2_grpc.ShardServiceStub(c) for c in channels]  # new callers each time
            calls = [call(timeout) for _ in range(12)]
            time.sleep(0.5)
            for c in calls:
                c.cancel()  # past its deadline already, or cancelled now
            start = time.monotonic()
            stats = stub.GetStats(shard_pb2.GetStatsRequest(run_id="r1"), timeout=3)
            assert stats.parts == 1 and time.monotonic() - start < 2
            codes = set()
            for c in calls:
                with pytest.raises(grpc.RpcError) as err:
                    list(c)
                codes.add(err.value.code())
            assert codes <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
            for channel in channels:
                channel.close()


# --- 2. a deposit covers the shard's parts once, for members of the run -------------------------------


@pytest.mark.parametrize("bad", ["partial", "part twice", "stranger member"])
def test_a_bad_deposit_is_rejected_and_stores_nothing(shards_only, bad):
    tensors = {"a": torch.randn(1000), "b": torch.randn(1000), "c": torch.randn(10), "d": torch.randn(10)}
    with _joined(shards_only.address, _spec("wagma", 2), tensors, workers=2) as (run_id, (w0, w1), placement):
        shard = max(range(len(placement.shards)), key=lambda s: sum(p.shard == s for p in placement.parts))
        mine = [p for p in placement.parts if p.shard == shard]
        assert len(mine) >= 2
        with _shard(placement.shards[shard]) as stub:
            zeros = [_part(p, payload=_values(p, 0.0)) for p in mine]
            members, parts, words = {
                "partial": ([w0, w1], zeros[:1], "missing"),
                "part twice": ([w0, w1], [zeros[0], *zeros], "deposited twice"),
                "stranger member": ([w0, w1, 777], zeros, "not workers of run"),
            }[bad]
            count = min(len(parts), len(mine))  # what the shard holds: the second copy is the fault
            requests = _deposit_requests(run_id, w0, 5, members, parts, part_count=count)
            _rejected(lambda: list(stub.GroupAverage(requests)), INVALID, words)
            # w1 arrives first at the round: w0 deposited nothing, so the average is w1's own model.
            ones = [_part(p, payload=_values(p, 1.0)) for p in mine]
            average = _group_average(stub, run_id, w1, 5, [w0, w1], ones)
            assert sorted(average) == sorted((p.name, p.index) for p in mine)
            assert all((v == 1.0).all() for v in average.values())
            # And w0, late, gets the same fixed round.
            late = _group_average(stub, run_id, w0, 5, [w0, w1], zeros)
            assert all((late[k] == v).all() for k, v in average.items())


# --- 3. unknown dtype enum ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rpc", ["Push", "RegisterTensors", "GroupAverage"])
def test_an_unknown_dtype_is_invalid_argument(shards_only, rpc):
    tensors = {"w": torch.randn(64)}
    with _joined(shards_only.address, _spec(), tensors) as (run_id, (worker,), placement):
        (p,) = placement.parts
        with _shard(placement.shards[p.shard]) as stub:
            before = _weights(stub, run_id, worker)
            bad = _part(p, payload=_values(p, 1.0))
            bad.dtype = BAD_DTYPE
            call = {
                "Push": lambda: _push(stub, run_id, worker, 0, bad),
                "RegisterTensors": lambda: _register(stub, run_id, bad, overwrite=True),
                "GroupAverage": lambda: list(stub.GroupAverage(_deposit_requests(run_id, worker, 0, [worker], [bad]))),
            }[rpc]
            _rejected(call, INVALID, f"dtype {BAD_DTYPE}")
            assert _weights(stub, run_id, worker) == before


# --- 4. pull codecs and weights a pull cannot send ----------------------------------------------------


@pytest.mark.parametrize(
    "codec",
    [
        tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_FP16, ratio=0.5),
        tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_FP16, stochastic_rounding=True),
        tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE, ratio=0.5),
    ],
    ids=["fp16 ratio", "fp16 stochastic", "none ratio"],
)
def test_a_pull_codec_with_bad_parameters_is_invalid_argument(shards_only, codec):
    tensors = {"w": torch.randn(64)}
    with _joined(shards_only.address, _spec(), tensors) as (run_id, (worker,), placement):
        with _shard(placement.shards[placement.parts[0].shard]) as stub:
            request = shard_pb2.PullRequest(run_id=run_id, worker_id=worker, codec=codec)
            _rejected(lambda: list(stub.Pull(request, timeout=10)), INVALID, "pull codec")


@pytest.mark.parametrize(
    "weights, pull_codec, code, words",
    [
        (1e6, FP16, grpc.StatusCode.OUT_OF_RANGE, "do not fit fp16"),
        (float("inf"), NONE, PRECONDITION, "not finite"),
        (float("inf"), FP16, PRECONDITION, "not finite"),
    ],
    ids=["fp16 overflow", "diverged none", "diverged fp16"],
)
def test_weights_a_pull_cannot_send_give_a_clean_status(shards_only, weights, pull_codec, code, words):
    start = 1e6 if weights == 1e6 else 3e38
    tensors = {"w": torch.full((64,), start)}
    with _joined(shards_only.address, _spec(lr=1.0), tensors) as (run_id, (worker,), placement):
        (p,) = placement.parts
        with _shard(placement.shards[p.shard]) as stub:
            if weights == float("inf"):  # 3e38 + 3e38 overflows: the run diverged
                assert _push(stub, run_id, worker, 0, _part(p, payload=_values(p, -3e38))).applied
            request = shard_pb2.PullRequest(run_id=run_id, worker_id=worker, codec=pull_codec)
            _rejected(lambda: list(stub.Pull(request, timeout=10)), code, words)


# --- 5. membership ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "epoch, live, words",
    [(1, [999], "not workers of run"), (2**64 - 1, None, "beyond")],
    ids=["stranger", "absurd epoch"],
)
def test_a_bad_membership_is_rejected_and_changes_nothing(shards_only, epoch, live, words):
    tensors = {"w": torch.randn(64)}
    with _joined(shards_only.address, _spec(), tensors) as (run_id, (worker,), placement):
        (p,) = placement.parts
        with _shard(placement.shards[p.shard]) as stub:
            request = shard_pb2.SetMembershipRequest(
                run_id=run_id, epoch=epoch, live_workers=[worker] if live is None else live
            )
            _rejected(lambda: stub.SetMembership(request, timeout=10), INVALID, words)
            # The worker is still live, and the coordinator's next epoch still counts.
            assert _push(stub, run_id, worker, 0, _part(p, payload=_values(p, 1.0))).applied
            stub.SetMembership(shard_pb2.SetMembershipRequest(run_id=run_id, epoch=1, live_workers=[]), timeout=10)
            _rejected(lambda: _push(stub, run_id, worker, 1, _part(p, payload=_values(p, 1.0))), PRECONDITION, "live")


@pytest.mark.parametrize(
    "fields, code, words",
    [
        (dict(), INVALID, "needs a cut"),
        (dict(keep=True, live_workers=[999]), INVALID, "not workers of run"),
        (dict(keep=True, membership_epoch=2**32 - 1), INVALID, "beyond"),
        (dict(step=4), PRECONDITION, "no state dir"),
        (dict(run_id="no-such-run", keep=True), grpc.StatusCode.NOT_FOUND, "unknown run"),
    ],
    ids=["no cut", "stranger", "absurd membership epoch", "no checkpoints", "unknown run"],
)
def test_a_bad_restore_is_refused_and_changes_nothing(shards_only, fields, code, words):
    """RestoreRun is the coordinator's after a shard restarted; refused, it leaves the run served
    as it was, at its restore epoch."""
    tensors = {"w": torch.randn(64)}
    with _joined(shards_only.address, _spec(), tensors) as (run_id, (worker,), placement):
        (p,) = placement.parts
        with _shard(placement.shards[p.shard]) as stub:
            request = shard_pb2.RestoreRunRequest(**{"run_id": run_id, "epoch": 1, **fields})
            _rejected(lambda: stub.RestoreRun(request, timeout=10), code, words)
            listed = stub.ListCheckpoints(shard_pb2.ListCheckpointsRequest(run_id=run_id), timeout=10)
            assert (listed.restore_epoch, listed.restored, list(listed.checkpoints)) == (0, False, [])
            assert _push(stub, run_id, worker, 0, _part(p, payload=_values(p, 1.0))).applied


# --- 6. OpenRun -------------------------------------------------------------------------------------------


def _placement(*parts: tuple[str, int, int]) -> shard_pb2.Placement:
    return shard_pb2.Placement(parts=[shard_pb2.PartPlacement(name=n, index=i, count=c, shard=0) for n, i, c in parts])


_O = run_pb2.OptimizerSpec


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(placement=_placement(("x", 0, 2**62))), "a part may hold"),
        (dict(optimizer=_O(name="bogus", lr=0.1)), "unknown optimizer"),
        (dict(optimizer=_O(name="sgd", lr=0.1, schedule="step", step_size=0, gamma=0.5)), "step"),
        (dict(optimizer=_O(name="adam", lr=0.1, beta1=2.0)), "beta"),
        (dict(optimizer=_O(name="adam", lr=0.1, eps=-1)), "eps"),
        (dict(placement=_placement(("x", 0, 4), ("x", 0, 8))), "placed twice"),
        (dict(run_id=""), "run_id"),
        (dict(workers=[]), "worker"),
    ],
    ids=["huge part", "bogus optimizer", "step_size 0", "beta1 2", "eps -1", "duplicate part", "no id", "no workers"],
)
def test_a_bad_open_run_is_invalid_argument_and_opens_nothing(shards_only, fields, words):
    request = shard_pb2.OpenRunRequest(
        run_id=fields.get("run_id", "probe-bad"),
        spec=run_pb2.RunSpec(scheme="asgd", optimizer=fields.get("optimizer", _O(name="sgd", lr=0.1))),
        placement=fields.get("placement", _placement(("x", 0, 4))),
        workers=fields.get("workers", [1]),
        total_steps=10,
    )
    with Client(shards_only.address) as client, _shard(client.cluster().shards[0]) as stub:
        _rejected(lambda: stub.OpenRun(request, timeout=10), INVALID, words)
        stats = shard_pb2.GetStatsRequest(run_id=request.run_id)
        _rejected(lambda: stub.GetStats(stats, timeout=10), grpc.StatusCode.NOT_FOUND, "unknown run")


def test_open_run_again_is_idempotent_and_a_different_one_already_exists(shards_only):
    tensors = {"w": torch.randn(64)}
    with _joined(shards_only.address, _spec(), tensors) as (run_id, (worker,), placement):
        with _shard(placement.shards[0]) as stub:
            request = shard_pb2.OpenRunRequest(
                run_id="probe-again", spec=_spec(), placement=_placement(("x", 0, 4)), workers=[1], total_steps=10
            )
            stub.OpenRun(request, timeout=10)
            try:
                stub.OpenRun(request, timeout=10)  # a retry
                before = _weights(stub, run_id, worker)
                for other in ("probe-again", run_id):
                    changed = shard_pb2.OpenRunRequest()
                    changed.CopyFrom(request)
                    changed.run_id = other
                    changed.placement.parts[0].count = 8
                    _rejected(
                        lambda r=changed: stub.OpenRun(r, timeout=10), grpc.StatusCode.ALREADY_EXISTS, "already open"
                    )
                assert stub.GetStats(shard_pb2.GetStatsRequest(run_id="probe-again"), timeout=10).param_bytes == 16
                assert _weights(stub, run_id, worker) == before
            finally:
                stub.CloseRun(shard_pb2.CloseRunRequest(run_id="probe-again"), timeout=10)


# --- 7. steps past the run's end, lossy initial values ----------------------------------------------------


@pytest.mark.parametrize("rpc", ["Push", "GroupAverage"])
def test_a_step_past_the_runs_end_is_invalid_argument(shards_only, rpc):
    tensors = {"w": torch.randn(64)}
    with _joined(shards_only.address, _spec(), tensors) as (run_id, (worker,), placement):
        (p,) = placement.parts
        with _shard(placement.shards[p.shard]) as stub:
            before = _weights(stub, run_id, worker)
            part = _part(p, payload=_values(p, 1.0))
            call = {
                "Push": lambda: _push(stub, run_id, worker, 2**64 - 1, part),
                "GroupAverage": lambda: list(
                    stub.GroupAverage(_deposit_requests(run_id, worker, 101, [worker], [part]))
                ),
            }[rpc]
            _rejected(call, INVALID, "beyond the run's 100 steps")
            assert _weights(stub, run_id, worker) == before
            # The worker's next push is not taken for a duplicate of the rejected one.
            assert _push(stub, run_id, worker, 1, part).applied


@pytest.mark.parametrize("codec", ["fp16", "topk:1.0"])
def test_initial_values_with_a_lossy_codec_are_invalid_argument(shards_only, codec):
    tensors = {"w": torch.randn(64)}
    with _joined(shards_only.address, _spec(), tensors) as (run_id, (worker,), placement):
        (p,) = placement.parts
        with _shard(placement.shards[p.shard]) as stub:
            before = _weights(stub, run_id, worker)
            params = parse_codec(codec)
            payload, _ = encode_part(torch.ones(p.count), params, lz4_threshold=None)
            part = _part(p, params, payload=payload)
            _rejected(lambda: _register(stub, run_id, part, overwrite=True), INVALID, "codec none")
            assert _weights(stub, run_id, worker) == before


@pytest.mark.parametrize(
    "scheme, fields, words",
    [
        ("sync", dict(overwrite=True, replica_step=1), "takes no replica from its workers"),
        ("pseudosync", dict(overwrite=False, replica_step=1), "set overwrite"),
        ("pseudosync", dict(overwrite=True, replica_step=101), "beyond the run's 100 steps"),
    ],
)
def test_a_bad_replica_hand_in_is_invalid_argument_and_changes_nothing(shards_only, scheme, fields, words):
    tensors = {"w": torch.randn(64)}
    with _joined(shards_only.address, _spec(scheme), tensors) as (run_id, (worker,), placement):
        (p,) = placement.parts
        with _shard(placement.shards[p.shard]) as stub:
            before = _weights(stub, run_id, worker)
            request = shard_pb2.RegisterTensorsRequest(run_id=run_id, part_count=1, **fields)
            request.part.CopyFrom(_part(p, payload=_values(p, 1.0)))
            _rejected(lambda: stub.RegisterTensors(iter([request]), timeout=10), INVALID, words)
            assert _weights(stub, run_id, worker) == before


def test_an_ended_run_ends_its_waits_and_refuses_updates(shards_only, client: Client):
    tensors = {"w": torch.zeros(64)}
    grads = {"w": torch.ones(64)}
    run_id, sessions, clients, _ = join_run(shards_only.address, _spec("sync", workers=2), tensors, n_workers=2)
    try:
        clients[0].register(tensors)
        clients[0].push(grads, 0)  # worker 1 never pushes step 0: the pull of step 1 waits (10 s)
        ended: list[BaseException | float] = []

        def pull() -> None:
            start = time.monotonic()
            try:
                clients[0].pull({"w": torch.zeros(64)}, min_version=1)
            except grpc.RpcError as e:
                ended.extend([e, time.monotonic() - start])

        waiting = threading.Thread(target=pull)
        waiting.start()
        time.sleep(1.0)
        client.stop(run_id)  # the coordinator ends the run on its shards (EndRun)
        waiting.join(timeout=15)
        error, seconds = ended
        assert error.code() == PRECONDITION and "ended" in error.details(), error
        assert seconds < 5, seconds  # at once, not at the pull's 10 s wait: its worker is free
        with pytest.raises(grpc.RpcError) as refused:
            clients[1].push(grads, 0)
        assert refused.value.code() == PRECONDITION and "ended: no more pushes" in refused.value.details()
        exported = client.export_state_dict(run_id)  # the parts stay readable
        assert torch.equal(exported["w"], torch.zeros(64))
    finally:
        leave(sessions, clients)
