"""Integration tests of compressed pushes: real shard processes decode (and reject) codec payloads,
the sync rule sums sparse parts, and compressed training on digits meets its targets."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import lz4.frame
import numpy as np
import pytest
import torch

from client.local_cluster import LocalCluster
from gradps.channel import open_channel
from gradps.codec_table import parse_codec
from gradps.codecs import (
    CodecError,
    ErrorFeedback,
    SparsePart,
    decode_part,
    decode_summand,
    encode_part,
)
from gradps.codecs.bench import bench_real_gradients, capture_gradients
from gradps.parameter_client import ParameterClient
from gradps.v1 import run_pb2, shard_pb2, shard_pb2_grpc, tensor_pb2
from ps_server.run_state import Push, RunState
from ps_server.schemes.sync import SyncRule
from tests.joined_run import join_run, leave

NONE = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE)
CPU = torch.device("cpu")
# A power of two: the shard's SGD step w - lr * g is then the same float arithmetic as the test's.
LR = 0.5


def _start_run(
    address: str,
    scheme: str,
    tensors: dict[str, torch.Tensor],
    codec: tensor_pb2.CodecParams = NONE,
    n_workers: int = 1,
    part_size: int = 16 << 10,
):
    """Submit a plain-SGD run, join `n_workers` sessions as its workers, create the placement and
    register `tensors`; returns (run_id, sessions, clients, placement). Small parts by default:
    tensors are cut into several, spread over the shards, each with its own scale or top-k."""
    spec = run_pb2.RunSpec(
        scheme=scheme,
        workers=n_workers,
        steps=100,
        part_size=part_size,
        optimizer=run_pb2.OptimizerSpec(name="sgd", lr=LR),
    )
    run_id, sessions, clients, placement = join_run(address, spec, tensors, n_workers, codec)
    clients[0].register(tensors)
    return run_id, sessions, clients, placement


def _pull(client: ParameterClient, like: dict[str, torch.Tensor], min_version: int = 0) -> dict[str, torch.Tensor]:
    pulled = {n: torch.full_like(t, math.nan) for n, t in like.items()}
    client.pull(pulled, min_version=min_version)
    return pulled


# --- malformed compressed payloads ----------------------------------------------------------------


def _sparse(indices: list[int], values: list[float]) -> bytes:
    return np.asarray(indices, np.uint32).tobytes() + np.asarray(values, np.float32).tobytes()


def _malformed_cases(count: int) -> list[tuple[str, tensor_pb2.CodecParams, bytes, bool, str]]:
    """(case, codec params, payload, lz4 flag, words the one-line error must contain)."""
    int8 = parse_codec("int8")
    topk = parse_codec("topk:0.01")
    sign = parse_codec("sign")
    no_ratio = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_TOPK)
    good_int8 = struct.pack("<f", 0.01) + bytes(count)
    good_sign = struct.pack("<f", 0.01) + bytes((count + 7) // 8)
    return [
        ("int8 truncated", int8, good_int8[:-1], False, f"expected {4 + count}"),
        ("int8 header only", int8, good_int8[:3], False, "expected"),
        ("int8 one byte too long", int8, good_int8 + b"\0", False, "more than"),
        ("int8 NaN scale", int8, struct.pack("<f", math.nan) + bytes(count), False, "scale is nan"),
        ("int8 Inf scale", int8, struct.pack("<f", math.inf) + bytes(count), False, "scale is inf"),
        ("int8 overflowing scale", int8, struct.pack("<f", 3e38) + bytes(count), False, "too large"),
        ("sign -Inf scale", sign, struct.pack("<f", -math.inf) + good_sign[4:], False, "scale is -inf"),
        ("sign truncated", sign, good_sign[:-1], False, "expected"),
        ("fp16 wrong length", parse_codec("fp16"), bytes(2 * count - 2), False, "expected"),
        ("topk ragged length", topk, _sparse([1], [1.0]) + b"\0\0\0", False, "8 * k"),
        ("topk index out of range", topk, _sparse([0, count], [1.0, 1.0]), False, "out of range"),
        ("topk index far out of range", topk, _sparse([2**32 - 1], [1.0]), False, "out of range"),
        ("topk repeated index", topk, _sparse([3, 3], [1.0, 2.0]), False, "strictly increasing"),
        ("topk unsorted indices", topk, _sparse([5, 4], [1.0, 2.0]), False, "strictly increasing"),
        ("topk NaN value", topk, _sparse([1, 2], [1.0, math.nan]), False, "NaN"),
        ("randk Inf value", parse_codec("randk:0.5"), _sparse([1], [math.inf]), False, "NaN or Inf"),
        ("unknown codec", tensor_pb2.CodecParams(codec=99), good_int8, False, "unknown codec 99"),
        ("ratio on int8", tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_INT8, ratio=0.5), good_int8, False, "ratio"),
        ("topk without ratio", no_ratio, _sparse([1], [1.0]), False, "ratio"),
        ("corrupt lz4 frame", int8, lz4.frame.compress(good_int8)[:-6], True, "lz4"),
        ("lz4 frame too large", int8, lz4.frame.compress(good_int8 + bytes(100)), True, "beyond"),
    ]


@pytest.mark.parametrize("case", _malformed_cases(64), ids=lambda case: case[0].replace(" ", "-"))
def test_decode_summand_rejects_what_decode_part_rejects(case) -> None:
    name, params, payload, is_lz4, words = case
    messages = []
    for decode in (decode_part, decode_summand):
        with pytest.raises(CodecError) as err:
            decode(payload, is_lz4, params, 64, CPU)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and words.lower() in messages[0].lower(), (name, messages)


def test_sparse_part_adds_only_to_a_tensor_of_its_size() -> None:
    params = parse_codec("topk:0.1")
    payload, _ = encode_part(torch.arange(20.0), params, lz4_threshold=None)
    part = decode_summand(payload, False, params, 20, CPU)
    assert isinstance(part, SparsePart) and part.indices.tolist() == [18, 19]
    assert torch.equal(part.add_to(torch.ones(20), alpha=2.0), 1 + 2 * part.to_dense())
    with pytest.raises(ValueError, match="20 values"):
        part.add_to(torch.zeros(21))
    assert isinstance(
        decode_summand(*encode_part(torch.ones(20), parse_codec("int8")), parse_codec("int8"), 20, CPU), torch.Tensor
    )


def test_real_gradient_bench_counts_what_is_sent() -> None:
    gradients = capture_gradients("mlp", "digits", steps=3, every=1)
    assert len(gradients) == 3 and len(gradients[0]) == 6
    rows = {r["codec"]: r for r in bench_real_gradients(gradients, ("none", "int8", "topk:0.01"))}
    assert rows["none"]["ratio"] == 1.0
    assert 0.25 < rows["int8"]["ratio"] < 0.26 and rows["int8"]["sent_ratio"] <= rows["int8"]["ratio"]
    for r in rows.values():
        assert r["lz4_gain"] == pytest.approx(r["ratio"] / r["sent_ratio"]) and 0 <= r["framed"] <= 1


@pytest.mark.parametrize("scheme", ["sync", "asgd"])
def test_malformed_compressed_pushes_are_rejected_and_change_nothing(shards_only, scheme: str) -> None:
    torch.manual_seed(0)
    tensors = {"w": torch.randn(64, 32), "b": torch.randn(100)}
    run_id, sessions, clients, placement = _start_run(shards_only.address, scheme, tensors, part_size=2048)
    try:
        worker = sessions[0].worker_id
        target = next(p for p in placement.parts if p.name == "w")

        def part(params: tensor_pb2.CodecParams, payload: bytes, is_lz4: bool) -> tensor_pb2.TensorPart:
            return tensor_pb2.TensorPart(
                name=target.name,
                index=target.index,
                offset=target.offset,
                count=target.count,
                dtype=tensor_pb2.DTYPE_FLOAT32,
                codec=params,
                payload=payload,
                lz4=is_lz4,
            )

        # A well-formed int8 part of another tensor, sent first in the same push: it must not be
        # applied when the bad part after it is rejected.
        key = (target.name, target.index)
        lead = next((q for q in placement.parts if q.shard == target.shard and (q.name, q.index) != key), None)
        lead_payload, lead_lz4 = encode_part(torch.ones(lead.count), parse_codec("int8")) if lead else (b"", False)

        with open_channel(placement.shards[target.shard]) as channel:
            stub = shard_pb2_grpc.ShardServiceStub(channel)
            for case, params, payload, is_lz4, words in _malformed_cases(target.count):
                count = 2 if lead is not None else 1  # the parts this push announces
                requests = [shard_pb2.PushRequest(run_id=run_id, worker_id=worker, step=0, part_count=count)]
                if lead is not None:
                    requests[0].part.CopyFrom(
                        tensor_pb2.TensorPart(
                            name=lead.name,
                            index=lead.index,
                            offset=lead.offset,
                            count=lead.count,
                            dtype=tensor_pb2.DTYPE_FLOAT32,
                            codec=parse_codec("int8"),
                            payload=lead_payload,
                            lz4=lead_lz4,
                        )
                    )
                    requests.append(shard_pb2.PushRequest(run_id=run_id, worker_id=worker, step=0, part_count=count))
                requests[-1].part.CopyFrom(part(params, payload, is_lz4))
                with pytest.raises(grpc.RpcError) as err:
                    stub.Push(iter(requests), timeout=10)
                details = err.value.details()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, details)
                assert words.lower() in details.lower(), (case, details)
                assert "\n" not in details and f"{target.name}/{target.index}" in details, (case, details)
            stats = stub.GetStats(shard_pb2.GetStatsRequest(run_id=run_id))
            assert stats.pushes == 0 and stats.bytes_pushed == 0 and stats.min_version == 0

        pulled = _pull(clients[0], tensors)
        for name, t in tensors.items():
            assert torch.equal(pulled[name], t), f"{name} changed after rejected pushes"
    finally:
        leave(sessions, clients)


# --- compressed pushes change the weights by the decoded gradient ----------------------------------


def _decoded_update(
    grads: dict[str, torch.Tensor], placement, params: tensor_pb2.CodecParams, feedback: ErrorFeedback
) -> dict[str, torch.Tensor]:
    """What the shards should decode from a client's push of `grads`: each part through the same
    codec and a replica of the client's error feedback (deterministic codecs only)."""
    decoded = {n: torch.empty(g.numel()) for n, g in grads.items()}
    for p in placement.parts:
        values = grads[p.name].reshape(-1)[p.offset : p.offset + p.count]
        payload, is_lz4 = encode_part(values, params, feedback=feedback, key=(p.name, p.index))
        decoded[p.name][p.offset : p.offset + p.count] = decode_part(payload, is_lz4, params, p.count, CPU)
    return {n: d.view_as(grads[n]) for n, d in decoded.items()}


@pytest.mark.parametrize("scheme", ["asgd", "sync"])
@pytest.mark.parametrize("text", ["int8", "topk:0.05", "sign"])
def test_compressed_push_applies_exactly_the_decoded_gradient(shards_only, scheme: str, text: str) -> None:
    generator = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(300, 70, generator=generator), "b": torch.randn(33, generator=generator)}
    params = parse_codec(text)
    run_id, sessions, clients, placement = _start_run(shards_only.address, scheme, tensors, codec=params)
    replica = ErrorFeedback()
    try:
        weights = {n: t.clone() for n, t in tensors.items()}
        for step in range(3):  # later steps carry error feedback residuals
            grads = {n: torch.randn(t.shape, generator=generator) for n, t in tensors.items()}
            clients[0].push(grads, step)
            expected = _decoded_update(grads, placement, params, replica)
            pulled = _pull(clients[0], tensors, min_version=step + 1)
            for name, w in weights.items():
                w.add_(expected[name], alpha=-LR)
                torch.testing.assert_close(pulled[name], w, rtol=0, atol=1e-6, msg=f"{text} step {step} {name}")
                if text.startswith("topk"):
                    untouched = expected[name] == 0  # not sent: bit-exactly unchanged
                    assert torch.equal(pulled[name][untouched], w[untouched])
                weights[name] = pulled[name]  # continue from the shard's exact values
        assert clients[0].traffic.bytes_pushed < sum(4 * t.numel() for t in tensors.values()) * 3 / 3.9
    finally:
        leave(sessions, clients)


def test_sync_mean_of_two_topk_workers(shards_only) -> None:
    generator = torch.Generator().manual_seed(2)
    tensors = {"w": torch.randn(200, 50, generator=generator)}
    params = parse_codec("topk:0.02")
    run_id, sessions, clients, placement = _start_run(shards_only.address, "sync", tensors, params, n_workers=2)
    try:
        grads = [{"w": torch.randn(200, 50, generator=generator)} for _ in clients]
        for client, grad in zip(clients, grads, strict=True):
            client.push(grad, 0)
        decoded = [_decoded_update(g, placement, params, ErrorFeedback()) for g in grads]
        expected = tensors["w"] - LR * ((decoded[0]["w"] + decoded[1]["w"]) / 2)
        pulled = _pull(clients[0], tensors, min_version=1)
        torch.testing.assert_close(pulled["w"], expected, rtol=0, atol=1e-6)
    finally:
        leave(sessions, clients)


def test_sync_rule_sums_sparse_parts_like_dense_ones() -> None:
    """SparsePart gradients (decode_summand) reduce to the same mean as dense decoded ones."""
    count, workers = 10_000, 3
    placement = shard_pb2.Placement(parts=[shard_pb2.PartPlacement(name="w", index=0, offset=0, count=count)])
    spec = run_pb2.RunSpec(scheme="sync", workers=workers, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=LR))
    request = shard_pb2.OpenRunRequest(
        run_id="r", spec=spec, placement=placement, workers=range(workers), total_steps=10
    )
    params = parse_codec("topk:0.01")
    generator = torch.Generator().manual_seed(3)
    payloads = [encode_part(torch.randn(count, generator=generator), params)[0] for _ in range(workers)]
    results = []
    for sparse in (False, True):
        run = RunState.open(request, CPU)
        run.parts[("w", 0)].values.copy_(torch.linspace(-1, 1, count))
        rule = SyncRule(run)
        for worker, payload in enumerate(payloads):
            grad = (decode_summand if sparse else decode_part)(payload, False, params, count, CPU)
            assert isinstance(grad, SparsePart) == sparse
            rule.push(Push(worker, 0, {("w", 0): grad}, {("w", 0): 0}))
        assert run.parts[("w", 0)].version == 1
        results.append(run.parts[("w", 0)].values.clone())
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-7)
    dense = sum(decode_part(p, False, params, count, CPU) for p in payloads)
    torch.testing.assert_close(results[0], torch.linspace(-1, 1, count) - LR * dense / workers, rtol=0, atol=1e-6)


# --- convergence through the real CLI ---------------------------------------------------------------


def _compare(coordinator: str, codec: str, out: Path) -> dict:
    """`gradps compare` of sync on digits (4 workers, MLP) with `codec`; the sync row."""
    command = [sys.executable, "-m", "client.cli", "compare", "--coordinator", coordinator, "--schemes", "sync"]
    command += ["--workers", "4", "--codec", codec, "--eval-every", "0", "--no-progress", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads((out / "compare.json").read_text())["schemes"]
    assert row["state"] == "completed", row
    return row


@pytest.mark.slow
def test_compressed_sync_training_meets_byte_and_accuracy_targets(tmp_path: Path) -> None:
    # One cluster (2 shards, 4 workers) for the three runs: its start-up is most of a run's cost.
    with LocalCluster(shards=2, workers=4, log_dir=tmp_path / "logs") as cluster:
        base = _compare(cluster.address, "none", tmp_path / "none")
        int8 = _compare(cluster.address, "int8", tmp_path / "int8")
        topk = _compare(cluster.address, "topk:0.01", tmp_path / "topk")
    assert base["final_test_accuracy"] >= 0.93, base
    assert base["bytes_pushed"] >= 3.5 * int8["bytes_pushed"], (base["bytes_pushed"], int8["bytes_pushed"])
    assert int8["final_test_accuracy"] >= base["final_test_accuracy"] - 0.01, (base, int8)
    assert base["bytes_pushed"] >= 20 * topk["bytes_pushed"], (base["bytes_pushed"], topk["bytes_pushed"])
    assert topk["final_test_accuracy"] >= base["final_test_accuracy"] - 0.02, (base, topk)
