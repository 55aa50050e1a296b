"""Integration tests of the shard and coordinator services: real processes, the test as worker."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from gradps.channel import open_channel
from gradps.data_stream import CallReceiver, CallSender
from gradps.placement import ITEMSIZE
from gradps.v1 import run_pb2, shard_pb2, shard_pb2_grpc, tensor_pb2
from tests.joined_run import NONE, join_run, leave


def _shard_bytes(placement: shard_pb2.Placement) -> list[int]:
    """Bytes of parameters each shard holds under `placement`."""
    itemsize = {t.name: ITEMSIZE[t.dtype] for t in placement.tensors}
    load = [0] * len(placement.shards)
    for p in placement.parts:
        load[p.shard] += p.count * itemsize[p.name]
    return load


def test_parts_balanced_over_three_shards_and_large_tensor_round_trips(shards_only):
    torch.manual_seed(0)
    # 1 MiB parts: "big" (3 MiB + a bit) is cut into 4 parts.
    tensors = {
        "big": torch.randn(1024, 770),
        "w1": torch.randn(300, 300),
        "w2": torch.randn(256, 512),
        "b": torch.randn(17),
    }
    spec = run_pb2.RunSpec(scheme="asgd", workers=1, part_size=1 << 20, steps=100)
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors)
    try:
        clients[0].register(tensors)
        load = _shard_bytes(placement)
        largest_part = max(p.count for p in placement.parts) * 4
        assert len(load) == 3 and all(b > 0 for b in load)
        assert max(load) - min(load) <= largest_part, load
        # The shards report the same split.
        for address, expected in zip(placement.shards, load, strict=True):
            with open_channel(address) as ch:
                stats = shard_pb2_grpc.ShardServiceStub(ch).GetStats(shard_pb2.GetStatsRequest(run_id=run_id))
            assert stats.param_bytes == expected and stats.parts > 0
        assert len([p for p in placement.parts if p.name == "big"]) == 4
        pulled = {n: torch.zeros_like(t) for n, t in tensors.items()}
        clients[0].pull(pulled)
        for name, t in tensors.items():
            assert torch.equal(pulled[name], t), name  # bit-exact
    finally:
        leave(sessions, clients)


def _push_raw(stub, run_id: str, worker_id: int, part: tensor_pb2.TensorPart, step: int = 0):
    request = shard_pb2.PushRequest(run_id=run_id, worker_id=worker_id, step=step, part=part, part_count=1)
    return stub.Push(iter([request]))


def test_bad_pushes_are_rejected_and_change_nothing(shards_only):
    tensors = {"w": torch.randn(64, 32), "v": torch.randn(100)}
    lr = 0.05
    spec = run_pb2.RunSpec(scheme="asgd", workers=1, steps=100, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=lr))
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors)
    try:
        clients[0].register(tensors)
        p = next(p for p in placement.parts if p.name == "w")
        good = np.ones(p.count, dtype=np.float32).tobytes()

        def part(**overrides) -> tensor_pb2.TensorPart:
            fields = dict(
                name="w",
                index=0,
                offset=p.offset,
                count=p.count,
                dtype=tensor_pb2.DTYPE_FLOAT32,
                codec=NONE,
                payload=good,
            )
            fields.update(overrides)
            return tensor_pb2.TensorPart(**fields)

        cases = [
            ("no-such-run", part(), grpc.StatusCode.NOT_FOUND, "unknown run"),
            (run_id, part(name="nope"), grpc.StatusCode.NOT_FOUND, "unknown tensor"),
            (run_id, part(count=p.count - 1), grpc.StatusCode.INVALID_ARGUMENT, "shape mismatch"),
            (run_id, part(dtype=tensor_pb2.DTYPE_FLOAT16), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
            (run_id, part(payload=good[:-3]), grpc.StatusCode.INVALID_ARGUMENT, ""),
            (
                run_id,
                part(payload=np.full(p.count, np.nan, np.float32).tobytes()),
                grpc.StatusCode.INVALID_ARGUMENT,
                "NaN",
            ),
        ]
        with open_channel(placement.shards[p.shard]) as ch:
            stub = shard_pb2_grpc.ShardServiceStub(ch)
            for rid, bad, code, words in cases:
                with pytest.raises(grpc.RpcError) as err:
                    _push_raw(stub, rid, sessions[0].worker_id, bad)
                assert err.value.code() == code, (bad.name, err.value.details())
                assert words in err.value.details()
                assert "\n" not in err.value.details()
            # A push whose second part is bad is rejected whole: its good first part is not applied.
            other = (
                next(q for q in placement.parts if q.shard == p.shard and q.name != "w")
                if any(q.shard == p.shard and q.name != "w" for q in placement.parts)
                else None
            )
            if other is not None:
                first = tensor_pb2.TensorPart(
                    name=other.name,
                    index=other.index,
                    offset=other.offset,
                    count=other.count,
                    dtype=tensor_pb2.DTYPE_FLOAT32,
                    codec=NONE,
                    payload=np.ones(other.count, np.float32).tobytes(),
                )
                with pytest.raises(grpc.RpcError):
                    stub.Push(
                        iter(
                            [
                                shard_pb2.PushRequest(
                                    run_id=run_id, worker_id=sessions[0].worker_id, step=0, part=first, part_count=2
                                ),
                                shard_pb2.PushRequest(
                                    run_id=run_id,
                                    worker_id=sessions[0].worker_id,
                                    step=0,
                                    part=part(payload=good[:5]),
                                    part_count=2,
                                ),
                            ]
                        )
                    )
        pulled = {n: torch.zeros_like(t) for n, t in tensors.items()}
        clients[0].pull(pulled)
        for name, t in tensors.items():
            assert torch.equal(pulled[name], t), f"{name} changed after rejected pushes"
        # And a good push still works afterwards, and is applied exactly once when made again (the
        # retry is answered as the push was: applied).
        with open_channel(placement.shards[p.shard]) as ch:
            stub = shard_pb2_grpc.ShardServiceStub(ch)
            assert _push_raw(stub, run_id, sessions[0].worker_id, part(), step=5).applied
            assert _push_raw(stub, run_id, sessions[0].worker_id, part(), step=5).applied
        clients[0].pull(pulled)
        assert torch.allclose(pulled["w"].view(-1)[: p.count], tensors["w"].view(-1)[: p.count] - lr)
    finally:
        leave(sessions, clients)


def test_sync_reduction_equals_sgd_on_concatenated_batches(shards_only):
    from gradps.datasets import load_dataset
    from gradps.evaluation import compute_loss
    from gradps.models import build_model

    data = load_dataset("digits")
    torch.manual_seed(3)
    reference = build_model("mlp", data)
    replicas = [build_model("mlp", data) for _ in range(2)]
    for r in replicas:
        r.load_state_dict(reference.state_dict())
    params = dict(reference.named_parameters())
    lr, momentum = 0.1, 0.9
    spec = run_pb2.RunSpec(
        scheme="sync",
        workers=2,
        steps=100,
        optimizer=run_pb2.OptimizerSpec(name="sgd", lr=lr, momentum=momentum),
    )
    run_id, sessions, clients, _ = join_run(
        shards_only.address, spec, {n: p.detach() for n, p in params.items()}, n_workers=2
    )
    try:
        clients[0].register(params)
        clients[1].register(params)
        opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=momentum)
        for step in range(3):
            batches = [torch.arange(64 * step + 32 * i, 64 * step + 32 * (i + 1)) for i in range(2)]
            for replica, client, idx in zip(replicas, clients, batches, strict=True):
                replica.zero_grad()
                compute_loss(replica, data.train_x[idx], data.train_y[idx], data.task).backward()
                client.push({n: p.grad for n, p in replica.named_parameters()}, step)
            for replica, client in zip(replicas, clients, strict=True):
                with torch.no_grad():
                    client.pull(dict(replica.named_parameters()), min_version=step + 1)
            opt.zero_grad()
            idx = torch.cat(batches)
            compute_loss(reference, data.train_x[idx], data.train_y[idx], data.task).backward()
            opt.step()
            for replica in replicas:
                for (name, p), q in zip(reference.named_parameters(), replica.parameters(), strict=True):
                    torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        leave(sessions, clients)


def test_pull_times_out_cleanly_when_version_never_comes(shards_only):
    tensors = {"w": torch.randn(8)}
    spec = run_pb2.RunSpec(scheme="sync", workers=1, steps=10)
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors)
    try:
        clients[0].register(tensors)
        with open_channel(placement.shards[placement.parts[0].shard]) as ch:
            stub = shard_pb2_grpc.ShardServiceStub(ch)
            began = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Pull(shard_pb2.PullRequest(run_id=run_id, min_version=5, wait_ms=300)))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - began < 10
    finally:
        leave(sessions, clients)


@pytest.mark.parametrize("transport", ["grpc", "stream", "shm"])
def test_many_small_parts_travel_in_batches_both_ways(shards_only, transport):
    # 16 MiB in 256 KiB parts: ~21 parts per shard, more than one 4 MiB batch each way.
    torch.manual_seed(1)
    tensors = {"w": torch.randn(4 << 20), "b": torch.randn(10)}
    lr = 0.5
    spec = run_pb2.RunSpec(
        scheme="asgd", workers=1, steps=100, part_size=256 << 10, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=lr)
    )
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors, transport=transport)
    try:
        assert len(placement.parts) == 65
        client = clients[0]
        client.register(tensors)
        grad = {n: torch.randn_like(t) for n, t in tensors.items()}
        client.push(grad, 0)
        pulled = {n: torch.zeros_like(t) for n, t in tensors.items()}
        client.pull(pulled)
        for name, t in tensors.items():
            torch.testing.assert_close(pulled[name], t - lr * grad[name], rtol=0, atol=1e-6, msg=name)
        assert client.traffic.bytes_pushed == client.traffic.bytes_pulled == 4 * ((4 << 20) + 10)
    finally:
        leave(sessions, clients)


class _BrokenStream(grpc.RpcError):
    """What a push sees when its stream breaks (a restarted proxy, a dropped connection)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "stream broken by the test"


@pytest.mark.parametrize("transport", ["grpc", "stream", "shm"])
def test_a_push_whose_stream_breaks_is_retried_whole(shards_only, transport):
    # Small parts (batched) before and after large ones (a message each): the stream breaks after
    # the push's first message, while small parts wait in a batch; the retry must send them all.
    torch.manual_seed(2)
    tensors = {f"b{i}": torch.randn(100) for i in range(6)} | {"w": torch.randn(3 << 18)} | {"c": torch.randn(7)}
    lr = 0.5
    spec = run_pb2.RunSpec(
        scheme="asgd", workers=1, steps=100, part_size=1 << 20, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=lr)
    )
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors, transport=transport)
    try:
        client = clients[0]
        client.register(tensors)
        broken = []
        for shard, link in enumerate(client.links):  # the real call, with a fault injected once
            call = link._push

            def flaky(messages, out, timeout, call=call, shard=shard):
                if shard not in broken:
                    broken.append(shard)
                    next(messages)
                    raise _BrokenStream()
                return call(messages, out, timeout=timeout)

            link._push = flaky
        grad = {n: torch.randn_like(t) for n, t in tensors.items()}
        client.push(grad, 0)
        assert sorted(broken) == sorted({p.shard for p in placement.parts})
        pulled = {n: torch.zeros_like(t) for n, t in tensors.items()}
        client.pull(pulled)
        for name, t in tensors.items():
            torch.testing.assert_close(pulled[name], t - lr * grad[name], rtol=0, atol=1e-6, msg=name)
    finally:
        leave(sessions, clients)


@pytest.mark.parametrize("transport", ["shm", "stream", "grpc"])
def test_a_group_average_moves_large_and_batched_small_parts(shards_only, transport, monkeypatch):
    # One large part per shard at most (1 MiB parts) and many small ones (batched, > 4 MiB per shard).
    streamed = {"sent": 0, "received": 0}  # a spy on the data streams: the real methods run
    send, receive_into = CallSender.send, CallReceiver.receive_into

    def counting_send(self, payload):
        streamed["sent"] += len(payload)
        return send(self, payload)

    def counting_receive_into(self, view):
        streamed["received"] += len(view)
        return receive_into(self, view)

    monkeypatch.setattr(CallSender, "send", counting_send)
    monkeypatch.setattr(CallReceiver, "receive_into", counting_receive_into)
    torch.manual_seed(3)
    tensors = {"big": torch.randn(3 << 18)} | {f"s{i}": torch.randn(50_000) for i in range(90)}
    spec = run_pb2.RunSpec(scheme="wagma", workers=1, steps=100, part_size=1 << 20)
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors, transport=transport)
    try:
        client = clients[0]
        assert client.shared_shards == ([0, 1, 2] if transport == "shm" else [])
        assert client.streamed_shards == ([0, 1, 2] if transport == "stream" else [])
        client.register(tensors)
        average, frontier = client.group_average(tensors, step=3, members=[sessions[0].worker_id], is_global=False)
        assert frontier == 3
        for name, t in tensors.items():
            assert torch.equal(average[name], t), name  # the average of one deposit is the deposit
        # On streams, the large part's deposit and average (3 MiB) go on them, the rest inline.
        big = 4 * tensors["big"].numel()
        assert streamed == ({"sent": big, "received": big} if transport == "stream" else {"sent": 0, "received": 0})
        with open_channel(placement.shards[0]) as channel:
            stub = shard_pb2_grpc.ShardServiceStub(channel)
            empty = shard_pb2.GroupAverageRequest(run_id=run_id, worker_id=sessions[0].worker_id, step=4, part_count=1)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.GroupAverage(iter([empty])))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "without a part" in err.value.details()
            # A part whose bytes would follow on a data stream the call does not name.
            (p,) = [p for p in placement.parts if p.shard == 0 and 4 * p.count > (256 << 10)][:1]
            streamed = shard_pb2.GroupAverageRequest(
                run_id=run_id, worker_id=sessions[0].worker_id, step=4, part_count=1
            )
            streamed.part.CopyFrom(
                tensor_pb2.TensorPart(
                    name=p.name, index=p.index, offset=p.offset, count=p.count, dtype=tensor_pb2.DTYPE_FLOAT32
                )
            )
            streamed.part.streamed = 4 * p.count
            with pytest.raises(grpc.RpcError) as err:
                list(stub.GroupAverage(iter([streamed])))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is streamed, but the call has no stream" in err.value.details()
    finally:
        leave(sessions, clients)


def test_asgd_schedule_spans_every_workers_updates(shards_only):
    # Under asgd each of P workers' pushes is an update of every part, so a cosine schedule over
    # the run's 100 steps per worker spans 2 x 100 updates with 2 workers (it reached lr 0 after
    # the first 100, half the run, before).
    spec = run_pb2.RunSpec(
        scheme="asgd", workers=2, steps=100, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=1.0, schedule="cosine")
    )
    tensors = {"w": torch.zeros(8)}
    run_id, sessions, clients, _ = join_run(shards_only.address, spec, tensors, n_workers=2)  # 100 steps
    try:
        clients[0].register(tensors)
        ones, pulled = {"w": torch.ones(8)}, {"w": torch.zeros(8)}
        for step in range(99):
            clients[step % 2].push(ones, step // 2)
        clients[0].pull(pulled)
        before = pulled["w"][0].item()
        clients[1].push(ones, 99)  # the 100th update: half way through 200
        clients[0].pull(pulled)
        assert before - pulled["w"][0].item() == pytest.approx(0.5 * (1 + math.cos(math.pi * 99 / 200)), rel=1e-5)
    finally:
        leave(sessions, clients)


@pytest.mark.parametrize("transport", ["shm", "stream", "grpc"])
def test_push_pull_applies_the_step_and_returns_its_weights_in_one_call(shards_only, transport):
    # Two sync workers push_pull step 0 at once: each call answers once the step completes, with
    # w - lr * mean(g); a retry of the same push is not applied again and answers the same weights.
    torch.manual_seed(11)
    tensors = {"w": torch.randn(3 << 18), "b": torch.randn(50)}  # large (streamed) and small parts
    lr = 0.5
    spec = run_pb2.RunSpec(
        scheme="sync", workers=2, steps=100, part_size=1 << 20, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=lr)
    )
    run_id, sessions, clients, placement = join_run(
        shards_only.address, spec, tensors, n_workers=2, transport=transport
    )
    try:
        for client in clients:
            client.register(tensors)
        grads = [{n: torch.randn_like(t) for n, t in tensors.items()} for _ in clients]
        outs = [{n: torch.zeros_like(t) for n, t in tensors.items()} for _ in clients]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda i: clients[i].push_pull(grads[i], 0, outs[i], min_version=1), range(2)))
        expected = {n: t - lr * (grads[0][n] + grads[1][n]) / 2 for n, t in tensors.items()}
        for out in outs:
            for name in tensors:
                torch.testing.assert_close(out[name], expected[name], rtol=0, atol=1e-6, msg=name)
        assert set(clients[0].versions.values()) == {1}  # the pulled weights' versions, for the next push
        again = {n: torch.zeros_like(t) for n, t in tensors.items()}
        clients[0].push_pull(grads[0], 0, again, min_version=1)  # a retry: applied once only
        for name in tensors:
            torch.testing.assert_close(again[name], expected[name], rtol=0, atol=1e-6, msg=name)
        assert clients[0].traffic.bytes_pulled == 2 * 4 * sum(t.numel() for t in tensors.values())
    finally:
        leave(sessions, clients)


@pytest.mark.parametrize("scheme", ["asgd", "ssp"])
def test_a_pull_says_the_weights_are_final_once_every_worker_pushed_its_last_step(shards_only, scheme):
    # A worker that finishes first holds a snapshot the other's last pushes still change; the one
    # whose pull came after every last push holds the model the run ends with, and is told so.
    spec = run_pb2.RunSpec(scheme=scheme, workers=2, steps=3, part_size=1024)
    tensors = {"w": torch.zeros(600), "b": torch.zeros(300)}
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors, n_workers=2, total_steps=3)
    try:
        assert len({p.shard for p in placement.parts}) > 1  # every shard must say so
        clients[0].register(tensors)
        grads, pulled = (
            {n: torch.ones_like(t) for n, t in tensors.items()},
            {n: torch.zeros_like(t) for n, t in tensors.items()},
        )
        finals = []
        for step in range(3):
            clients[0].push(grads, step)
        clients[0].pull(pulled)
        finals.append(clients[0].pulled_final_weights)
        for step in range(2):
            clients[1].push(grads, step)
        clients[0].pull(pulled)
        finals.append(clients[0].pulled_final_weights)
        clients[1].push(grads, 3)  # asgd's remainder after the last step counts as a last push
        clients[1].pull(pulled)
        finals.append(clients[1].pulled_final_weights)
        clients[0].pull(pulled)
        finals.append(clients[0].pulled_final_weights)
        assert finals == [False, False, True, True]
    finally:
        leave(sessions, clients)
