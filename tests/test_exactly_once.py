"""Exactly once, against shard servers in processes of their own: a push (Push, PushPull), an
upload of initial values (RegisterTensors with overwrite) or a wagma deposit (GroupAverage) whose
call is cut short (cancelled by its client, past its deadline, its request stream failing) at any
point of its stream changes nothing on the shard; the same call made again is applied once, and
is answered `applied = true` however often it is made again. Under sync, a run whose pushes are
cut and retried ends with weights bit-identical to a run without cuts."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from gradps import wire
from gradps.channel import open_channel
from gradps.parameter_client import ParameterClient, tensor_specs
from gradps.placement import place
from gradps.v1 import run_pb2, shard_pb2, shard_pb2_grpc, tensor_pb2

NONE = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE)
LR = 0.25
# The deadline of a call cut by its deadline: long enough for its first messages to arrive.
CUT_DEADLINE_S = 0.15
# How a call is cut: its client cancels it, its deadline passes while the shard waits for the rest,
# or its request stream raises (gRPC then cancels the call).
CUTS = ("cancel", "deadline", "raise")
# What the client sees of each cut.
CUT_CODES = {
    "cancel": {grpc.StatusCode.CANCELLED},
    "deadline": {grpc.StatusCode.DEADLINE_EXCEEDED},
    "raise": {grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED},
}

# A shard server as `python -m ps_server.shard` runs it, without the coordinator it registers with:
# the test opens its runs. It prints its port and serves until it is terminated.
_SHARD = """
import threading
import torch
from gradps.channel import bind, make_server
from gradps.data_stream import StreamListener
from ps_server.shard import ShardServicer, add_shard_servicer

server = make_server()
add_shard_servicer(ShardServicer(torch.device("cpu"), StreamListener(0)), server)
port = bind(server, 0)
server.start()
print(port, flush=True)
threading.Event().wait()
"""


@pytest.fixture(scope="module")
def shards() -> Iterator[list[str]]:
    """Two shard processes on loopback: their addresses."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _SHARD], stdout=subprocess.PIPE, env=env) for _ in range(2)]
    try:
        yield [f"127.0.0.1:{int(p.stdout.readline())}" for p in procs]  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


def _open(
    addresses: list[str], run_id: str, scheme: str, tensors: dict[str, torch.Tensor], workers: list[int], part_size: int
) -> shard_pb2.Placement:
    """Open a run on the shards at `addresses` as the coordinator would: its placement."""
    placement = place(tensor_specs(tensors), addresses, part_size)
    spec = run_pb2.RunSpec(
        scheme=scheme, workers=len(workers), steps=100, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=LR)
    )
    for index, address in enumerate(addresses):
        request = shard_pb2.OpenRunRequest(
            run_id=run_id, spec=spec, placement=placement, shard_index=index, workers=workers, total_steps=100
        )
        with open_channel(address) as channel:
            shard_pb2_grpc.ShardServiceStub(channel).OpenRun(request, timeout=10)
    return placement


def _part(p: shard_pb2.PartPlacement, values: np.ndarray) -> tensor_pb2.TensorPart:
    part = tensor_pb2.TensorPart(
        name=p.name, index=p.index, offset=p.offset, count=p.count, dtype=tensor_pb2.DTYPE_FLOAT32, codec=NONE
    )
    part.payload = values.astype(np.float32).tobytes()
    return part


def _state(stub: shard_pb2_grpc.ShardServiceStub, run_id: str) -> tuple[dict[tuple[str, int], tuple[int, bytes]], int]:
    """What the shard holds for the run: (version, value bytes) by part, and the pushes it applied."""
    parts = {}
    for response in stub.Pull(shard_pb2.PullRequest(run_id=run_id, worker_id=0, codec=NONE), timeout=10):
        for p in wire.parts_of(response):
            parts[(p.name, p.index)] = (p.version, bytes(p.payload))
    return parts, stub.GetStats(shard_pb2.GetStatsRequest(run_id=run_id), timeout=10).pushes


def _cut(start: Callable[[Iterator, float], grpc.Future], messages: Iterable, sent: int, how: str) -> grpc.StatusCode:
    """Make a call of `messages` (start(requests, timeout) starts it) that sends the first `sent`
    of them (fewer if there are fewer) and is then cut `how` (one of CUTS); the status code its
    client saw. A cancel waits until those messages are on their way (gRPC asks for the next only
    once one is sent)."""
    on_their_way, release = threading.Event(), threading.Event()

    def requests() -> Iterator:
        yield from itertools.islice(messages, sent)
        on_their_way.set()
        if how == "raise":
            raise RuntimeError("the worker failed in the middle of its call")
        release.wait(30)  # never half-closed: the call ends first

    call = start(requests(), CUT_DEADLINE_S if how == "deadline" else 30.0)
    try:
        if how == "cancel":
            assert on_their_way.wait(10)
            call.cancel()
        code = call.code()
    finally:
        release.set()
    assert code in CUT_CODES[how], (how, sent, code)
    return code


def _cuts(n: int, calls: int) -> Iterator[tuple[int, str, int, bool]]:
    """(call number, how it is cut, messages it sends first, whether nothing of it may be applied)
    for `calls` calls of `n` messages: every cut, at every point of the stream. A call cut short
    of its parts applies nothing; so does one whose deadline passes (even with every part sent:
    it was never half-closed). A cancel that comes after every part may cross the shard's check,
    which then applies it whole: all of it or nothing, never a part."""
    for i in range(calls):
        how, sent = CUTS[i % len(CUTS)], (i // len(CUTS)) % (n + 1)
        yield i, how, sent, sent < n or how == "deadline"


def _one_shard_run(shards: list[str], run_id: str, scheme: str, workers: list[int]) -> list[shard_pb2.PartPlacement]:
    """A run whose 7 parts (6 of `w`, 1 of `b`) all live on the first shard: its parts."""
    tensors = {"w": torch.zeros(6 * 256), "b": torch.zeros(10)}
    return list(_open(shards[:1], run_id, scheme, tensors, workers, part_size=4 * 256).parts)


def _register(stub: shard_pb2_grpc.ShardServiceStub, run_id: str, parts: list[tensor_pb2.TensorPart]) -> int:
    return stub.RegisterTensors(iter(_register_requests(run_id, parts)), timeout=10).initialised


def _register_requests(run_id: str, parts: list[tensor_pb2.TensorPart]) -> list[shard_pb2.RegisterTensorsRequest]:
    return [
        shard_pb2.RegisterTensorsRequest(run_id=run_id, part=part, overwrite=True, part_count=len(parts))
        for part in parts
    ]


def _push_requests(rpc: str, run_id: str, worker: int, step: int, parts: list[tensor_pb2.TensorPart]) -> list:
    """A push's messages, one part each: PushRequests, or PushPullRequests whose pull asks for the
    weights at once."""
    if rpc == "Push":
        return [
            shard_pb2.PushRequest(run_id=run_id, worker_id=worker, step=step, part=part, part_count=len(parts))
            for part in parts
        ]
    pull = shard_pb2.PullRequest(codec=NONE)
    return [
        shard_pb2.PushPullRequest(
            run_id=run_id, worker_id=worker, step=step, part=part, part_count=len(parts), pull=pull
        )
        for part in parts
    ]


def _starter(stub: shard_pb2_grpc.ShardServiceStub, rpc: str) -> Callable[[Iterator, float], grpc.Future]:
    """How `_cut` starts a call of `rpc`: a client stream's future, a bidi stream's call."""
    if rpc in ("Push", "RegisterTensors"):
        method = getattr(stub, rpc)
        return lambda requests, timeout: method.future(requests, timeout=timeout)
    method = getattr(stub, rpc)
    return lambda requests, timeout: method(requests, timeout=timeout)


def _pushed(stub: shard_pb2_grpc.ShardServiceStub, rpc: str, requests: list) -> shard_pb2.PushResponse:
    """A whole push: its answer."""
    if rpc == "Push":
        return stub.Push(iter(requests), timeout=10)
    responses = list(stub.PushPull(iter(requests), timeout=10))
    assert responses and all(r.push == responses[0].push for r in responses)
    return responses[0].push


# --- 1. asgd: a cut push applies nothing; made again, it is applied once ------------------------------


def test_cut_pushes_apply_nothing_and_their_retries_apply_once(shards):
    rng = np.random.default_rng(0)
    parts = _one_shard_run(shards, "asgd-cut", "asgd", [0])
    _one_shard_run(shards, "asgd-clean", "asgd", [0])  # the same pushes, never cut
    with open_channel(shards[0]) as channel:
        stub = shard_pb2_grpc.ShardServiceStub(channel)
        initial = [rng.standard_normal(p.count).astype(np.float32) for p in parts]
        for run_id in ("asgd-cut", "asgd-clean"):
            assert _register(stub, run_id, [_part(p, v) for p, v in zip(parts, initial, strict=True)]) == len(parts)
        for step, how, sent, nothing in _cuts(len(parts), 100):
            rpc = ("Push", "PushPull")[step % 2]
            grad = [_part(p, rng.standard_normal(p.count)) for p in parts]
            before = _state(stub, "asgd-cut")
            _cut(_starter(stub, rpc), _push_requests(rpc, "asgd-cut", 0, step, grad), sent, how)
            assert _pushed(stub, rpc, _push_requests(rpc, "asgd-clean", 0, step, grad)).applied
            once = _state(stub, "asgd-clean")
            now = _state(stub, "asgd-cut")
            if nothing:
                assert now == before, f"{how} after {sent} of {len(parts)} parts changed the shard"
            else:
                assert now in (before, once), f"{how} after every part applied some of them"
            # Made again, twice: applied once, answered as applied each time.
            for _ in range(2):
                response = _pushed(stub, rpc, _push_requests(rpc, "asgd-cut", 0, step, grad))
                assert response.applied and response.parts == len(parts)
                assert _state(stub, "asgd-cut") == once
        # A push overtaken by a later step is dropped, and says so.
        stale = _pushed(stub, "Push", _push_requests("Push", "asgd-cut", 0, 3, grad))
        assert not stale.applied and _state(stub, "asgd-cut") == once
    assert once[1] == 100 and {v for v, _ in once[0].values()} == {100}


def test_a_push_that_ends_short_of_its_parts_is_data_loss_and_changes_nothing(shards):
    parts = _one_shard_run(shards, "asgd-short", "asgd", [0])
    with open_channel(shards[0]) as channel:
        stub = shard_pb2_grpc.ShardServiceStub(channel)
        values = [_part(p, np.ones(p.count)) for p in parts]
        _register(stub, "asgd-short", values)
        before = _state(stub, "asgd-short")
        for rpc in ("Push", "PushPull"):
            requests = _push_requests(rpc, "asgd-short", 0, 0, values)
            for sent in range(1, len(parts)):  # half-closed early: the rest never comes
                with pytest.raises(grpc.RpcError) as err:
                    _pushed(stub, rpc, requests[:sent])
                assert err.value.code() == grpc.StatusCode.DATA_LOSS, err.value.details()
                assert f"after {sent} of its {len(parts)} parts" in err.value.details()
            # A count the parts contradict, or none, is refused before anything is applied.
            for count, words in ((2, "carries more parts"), (0, "announces its parts"), (8, "announces its parts")):
                announced = _push_requests(rpc, "asgd-short", 0, 0, values)
                for request in announced:
                    request.part_count = count
                with pytest.raises(grpc.RpcError) as err:
                    _pushed(stub, rpc, announced)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
                assert words in err.value.details() and "\n" not in err.value.details()
            # Every message repeats the count.
            mixed = _push_requests(rpc, "asgd-short", 0, 0, values)
            mixed[-1].part_count = len(parts) - 1
            with pytest.raises(grpc.RpcError) as err:
                _pushed(stub, rpc, mixed)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "part_count" in err.value.details()
        assert _state(stub, "asgd-short") == before


# --- 2. RegisterTensors(overwrite): all of an upload or none of it ------------------------------------


def test_cut_uploads_set_nothing_and_their_retries_set_every_part(shards):
    parts = _one_shard_run(shards, "register-cut", "wagma", [0])
    with open_channel(shards[0]) as channel:
        stub = shard_pb2_grpc.ShardServiceStub(channel)
        assert _register(stub, "register-cut", [_part(p, np.zeros(p.count)) for p in parts]) == len(parts)
        for i, how, sent, nothing in _cuts(len(parts), 40):
            # Every part of every upload holds its own value: a mix would show.
            upload = [_part(p, np.full(p.count, 10 * (i + 1) + j)) for j, p in enumerate(parts)]
            uploaded = {(p.name, p.index): u.payload for p, u in zip(parts, upload, strict=True)}
            before = _values(stub, "register-cut")
            _cut(_starter(stub, "RegisterTensors"), _register_requests("register-cut", upload), sent, how)
            now = _values(stub, "register-cut")
            if nothing:
                assert now == before, f"{how} after {sent} of {len(parts)} parts set some"
            else:
                assert now in (before, uploaded), f"{how} after every part set some of them"
            for _ in range(2):
                assert _register(stub, "register-cut", upload) == len(parts)
                assert _values(stub, "register-cut") == uploaded


# --- 3. a wagma deposit: stored whole or not at all -------------------------------------------------------


def _values(stub: shard_pb2_grpc.ShardServiceStub, run_id: str) -> dict[tuple[str, int], bytes]:
    return {key: payload for key, (_, payload) in _state(stub, run_id)[0].items()}


def _deposit_requests(run_id: str, worker: int, step: int, parts: list[tensor_pb2.TensorPart]) -> list:
    return [
        shard_pb2.GroupAverageRequest(
            run_id=run_id, worker_id=worker, step=step, members=[0, 1], part=part, part_count=len(parts)
        )
        for part in parts
    ]


def _average(stub: shard_pb2_grpc.ShardServiceStub, requests: list) -> dict[tuple[str, int], bytes]:
    return {(p.name, p.index): bytes(p.payload) for r in stub.GroupAverage(iter(requests), timeout=10) for p in r.parts}


def _moved(values: dict[tuple[str, int], bytes], by: float) -> dict[tuple[str, int], bytes]:
    """Every float32 value of `values` plus `by`."""
    return {key: (np.frombuffer(v, np.float32) + by).astype(np.float32).tobytes() for key, v in values.items()}


def _frozen(values: dict[tuple[str, int], bytes]) -> frozenset:
    return frozenset(values.items())


def test_cut_deposits_are_not_stored_and_their_retries_are(shards):
    parts = _one_shard_run(shards, "wagma-cut", "wagma", [0, 1])

    def model(worker: int, step: int) -> list[tensor_pb2.TensorPart]:
        # Whole numbers, distinct per worker, step and part, moving at a different pace per worker
        # (so the two possible rounds below differ): every average is exact.
        return [_part(p, np.full(p.count, 1000 * worker + 10 * (worker + 1) * step + j)) for j, p in enumerate(parts)]

    def mean(*models: list[tensor_pb2.TensorPart] | None) -> dict[tuple[str, int], bytes]:
        """The round's average of the members' deposits (None: a member that has not deposited)."""
        found = [m for m in models if m is not None]
        return {
            (p.name, p.index): (sum(np.frombuffer(m[j].payload, np.float32) for m in found) / len(found))
            .astype(np.float32)
            .tobytes()
            for j, p in enumerate(parts)
        }

    with open_channel(shards[0]) as channel:
        stub = shard_pb2_grpc.ShardServiceStub(channel)
        _register(stub, "wagma-cut", model(0, 0))
        # Round 0: worker 0 alone fixes it with its model.
        assert _average(stub, _deposit_requests("wagma-cut", 0, 0, model(0, 0))) == {
            (p.name, p.index): p.payload for p in model(0, 0)
        }
        for step, how, sent, nothing in _cuts(len(parts), 40):
            step += 1
            _cut(_starter(stub, "GroupAverage"), _deposit_requests("wagma-cut", 0, step, model(0, step)), sent, how)
            # Worker 1 then comes first to the round: worker 0's latest deposit is its last whole
            # one, and worker 0's retries get the round moved by the step it made since (+10 per
            # value). (Where a cancel may cross the check, the cut deposit may instead have been
            # stored whole and fixed the round with worker 1's previous model: then worker 1 gets
            # it moved by its own step since, +20, and worker 0's retries get it as it is.)
            by_worker_1 = mean(model(0, step - 1), model(1, step))
            answers = {_frozen(by_worker_1): _moved(by_worker_1, 10)}
            if not nothing:
                by_cut = mean(model(0, step), model(1, step - 1) if step > 1 else None)
                answers[_frozen(_moved(by_cut, 20) if step > 1 else by_cut)] = by_cut
            average = _average(stub, _deposit_requests("wagma-cut", 1, step, model(1, step)))
            assert _frozen(average) in answers, f"{how} after {sent} of {len(parts)} parts stored some"
            # Worker 0 makes its deposit again: the fixed round, and stored for the next one.
            for _ in range(2):
                again = _average(stub, _deposit_requests("wagma-cut", 0, step, model(0, step)))
                assert again == answers[_frozen(average)]


# --- 4. sync: cut and retried pushes train exactly as uncut ones -----------------------------------------


class _Dropped(grpc.RpcError):
    """What a worker sees when its connection drops in the middle of a call."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection dropped by the test"


class _Expired(grpc.RpcError):
    """What a worker sees when its call's deadline passes."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


def _cut_first_attempts(client: ParameterClient, cuts: Iterator[tuple[str, int]]) -> list[grpc.StatusCode]:
    """Cut the first attempt of each of the client's push_pull calls, per shard, as `cuts` says
    (how, messages sent first): by its deadline (the link retries after DEADLINE_EXCEEDED), or
    cancelled and reported as a dropped connection (the link retries after UNAVAILABLE). The real
    calls run; the codes the cut attempts saw are returned."""
    seen: list[grpc.StatusCode] = []
    lock = threading.Lock()
    for link in client.links:
        real = link._push_pull
        retrying = [False]

        def cut(messages: Iterator[bytes], out, timeout: float, real=real, retrying=retrying) -> Iterator[bytes]:
            if retrying[0]:  # the attempt after a cut one runs whole; the next call's first is cut
                retrying[0] = False
                return real(messages, out, timeout=timeout)
            retrying[0] = True
            with lock:
                how, sent = next(cuts)
            # Streamed, lazily: a streamed part's bytes follow its message only when the next is
            # asked for, and a call of one message is cut before its client half-closes it.
            code = _cut(lambda requests, t: real.streamed(requests, timeout=t), messages, sent, how)
            with lock:
                seen.append(code)
            raise _Dropped() if how == "cancel" else _Expired()

        link._push_pull = cut
    return seen


def _sync_run(shards: list[str], run_id: str, transport: str, steps: int, cut: bool) -> tuple[list, list[int]]:
    """Two sync workers push_pull `steps` steps; worker 0's first attempt of every call is cut
    when `cut`. (Each worker's weights after every step, the pushes each shard applied.)"""
    torch.manual_seed(5)
    # Large parts travel one per message, the small ones batched: several points to cut at.
    tensors = {"w": torch.randn(6 * 80_000), "b": torch.randn(100), "c": torch.randn(30)}
    placement = _open(shards, run_id, "sync", tensors, [0, 1], part_size=4 * 80_000)
    grads = [[{n: torch.randn_like(t) for n, t in tensors.items()} for _ in range(2)] for _ in range(steps)]
    clients = [ParameterClient(placement, run_id, w, NONE, NONE, timeout_s=10, transport=transport) for w in (0, 1)]
    try:
        for c in clients:
            c.register(tensors)
        if cut:
            plan = iter([(("deadline", "cancel")[i % 2], (i // 2) % 5) for i in range(2 * steps * len(shards))])
            codes = _cut_first_attempts(clients[0], plan)
        params = [{n: t.clone() for n, t in tensors.items()} for _ in clients]
        history = []

        def step_of(worker: int, step: int) -> None:
            clients[worker].push_pull(grads[step][worker], step, params[worker], min_version=step + 1)

        with ThreadPoolExecutor(2) as pool:
            for step in range(steps):  # the workers push together, as sync workers do
                list(pool.map(step_of, (0, 1), (step, step)))
                history.append([{n: t.clone() for n, t in p.items()} for p in params])
        pushes = []
        for address in shards:
            with open_channel(address) as channel:
                stats = shard_pb2_grpc.ShardServiceStub(channel).GetStats(shard_pb2.GetStatsRequest(run_id=run_id))
                pushes.append(stats.pushes)
        if cut:
            assert len(codes) == steps * len(shards)
        return history, pushes
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("transport", ["grpc", "stream"])
def test_sync_with_cut_pushes_is_bit_identical_to_sync_without(shards, transport):
    steps = 6
    clean, clean_pushes = _sync_run(shards, f"sync-clean-{transport}", transport, steps, cut=False)
    cut, cut_pushes = _sync_run(shards, f"sync-cut-{transport}", transport, steps, cut=True)
    assert clean_pushes == cut_pushes == [2 * steps] * len(shards)  # each push applied once
    for step, (a, b) in enumerate(zip(clean, cut, strict=True)):
        for worker in (0, 1):
            for name in a[worker]:
                assert torch.equal(a[worker][name], b[worker][name]), (step, worker, name)
