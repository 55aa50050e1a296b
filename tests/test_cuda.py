"""The shard's update and decoding on CUDA match the CPU (skipped without a CUDA device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradps.codec_table import parse_codec
from gradps.codecs import decode_part, encode_part
from gradps.optimizer import ShardOptimizer, kernels
from gradps.v1 import run_pb2
from tests.test_optimizer import SPECS, apply_calls

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-{s.schedule or 'constant'}")
def test_shard_update_on_cuda_matches_one_optimizer_per_part(spec):
    """The same calls as tests/test_optimizer.py, with the parts and gradients on the GPU."""
    got, expected, start = apply_calls(spec, "cuda")
    for key, values in got.items():
        torch.testing.assert_close(values, expected[key], rtol=1e-5, atol=1e-6, msg=str(key))
        assert not torch.equal(values, start[key])


def test_shard_update_on_cuda_uses_fused_kernels():
    values = {("w", i): torch.randn((1 << 20) + 17, device="cuda") for i in range(3)}  # no vector-width multiple
    opt = ShardOptimizer(values, run_pb2.OptimizerSpec(name="adam", lr=1e-3), total_steps=10)
    assert kernels(list(opt.params.values())) == {"fused": True}
    assert opt.opt.defaults["fused"]


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "topk:0.1", "sign"])
def test_decode_on_cuda_matches_cpu(codec):
    params = parse_codec(codec)
    values = torch.from_numpy(np.random.default_rng(1).standard_normal(4097).astype(np.float32))
    payload, lz4 = encode_part(values, params)
    on_cpu = decode_part(payload, lz4, params, values.numel(), "cpu")
    on_cuda = decode_part(payload, lz4, params, values.numel(), "cuda")
    assert on_cuda.device.type == "cuda"
    torch.testing.assert_close(on_cuda.cpu(), on_cpu, rtol=0, atol=0)


@pytest.mark.parametrize("transport", ["shm", "stream", "grpc"])
def test_push_and_pull_through_a_cuda_shard_match_a_cpu_optimizer(transport):
    """Gradients and weights on the worker's GPU too: shared memory takes them device to segment."""
    from client.local_cluster import LocalCluster
    from client.sdk import Client
    from gradps.parameter_client import ParameterClient, tensor_specs
    from gradps.v1 import tensor_pb2
    from gradps.worker_session import WorkerSession

    none = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE)
    spec = run_pb2.OptimizerSpec(name="adam", lr=1e-2)
    tensors = {"w": torch.randn(300, 700), "b": torch.randn(33)}
    with LocalCluster(shards=1, workers=0, device="cuda") as cluster:
        with Client(cluster.address) as client:
            run_spec = run_pb2.RunSpec(scheme="asgd", workers=1, steps=10, part_size=1 << 18, optimizer=spec)
            run_id = client.submit(run_spec)
        session = WorkerSession(cluster.address)
        try:
            assert session.wait_for_assignment(wait_s=10).run_id == run_id
            placement = session.placement(run_id, tensor_specs(tensors), total_steps=10)
            ps = ParameterClient(placement, run_id, session.worker_id, none, none, timeout_s=30, transport=transport)
            assert ps.shared_shards == ([0] if transport == "shm" else [])
            assert ps.streamed_shards == ([0] if transport == "stream" else [])
            ps.register(tensors)
            reference = {n: torch.nn.Parameter(t.clone()) for n, t in tensors.items()}
            opt = torch.optim.Adam(reference.values(), lr=spec.lr)
            for step in range(3):
                grads = {n: torch.randn_like(t) for n, t in tensors.items()}
                ps.push({n: g.cuda() for n, g in grads.items()}, step)
                for n, p in reference.items():
                    p.grad = grads[n]
                opt.step()
            on_gpu = {n: torch.zeros_like(t, device="cuda") for n, t in tensors.items()}
            ps.pull(on_gpu)
            pulled = {n: t.cpu() for n, t in on_gpu.items()}
            ps.close()
        finally:
            session.close()
    for name, p in reference.items():
        torch.testing.assert_close(pulled[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_pinned_segment_copies_to_and_from_the_gpu():
    """Segment.pin page-locks the segment once; copies through it stay exact, and its views stay
    valid after the segment (and its registration) is gone."""
    from gradps.shared_memory import ALIGN, Segment

    segment = Segment.create(1 << 22)
    try:
        assert segment.pin() and segment.pin() and segment.pinned
        values = torch.randn(1 << 20, device="cuda")
        segment.write(ALIGN, values)
        view = segment.floats(ALIGN, values.numel())
        assert torch.equal(view.cuda(), values)
        back = torch.empty_like(values)
        back.copy_(view)
        assert torch.equal(back, values)
    finally:
        segment.release()
    del segment
    assert torch.equal(view.cuda(), values)


def test_a_cuda_worker_and_shard_pin_their_segments():
    """The worker pins its segment when GPU tensors first use it (the shard pins its mapping)."""
    from client.local_cluster import LocalCluster
    from client.sdk import Client
    from gradps.parameter_client import ParameterClient, tensor_specs
    from gradps.v1 import tensor_pb2
    from gradps.worker_session import WorkerSession

    none = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE)
    tensors = {"w": torch.randn(1000, device="cuda")}
    with LocalCluster(shards=1, workers=0, device="cuda") as cluster:
        with Client(cluster.address) as client:
            client.submit(run_pb2.RunSpec(scheme="asgd", workers=1, steps=2))
        session = WorkerSession(cluster.address)
        try:
            run_id = session.wait_for_assignment(wait_s=10).run_id
            placement = session.placement(run_id, tensor_specs(tensors), total_steps=2)
            ps = ParameterClient(placement, run_id, session.worker_id, none, none, timeout_s=30)
            ps.register(tensors)
            segment = ps._areas[0][0].segment
            assert segment.pinned is None  # not before GPU tensors use it
            ps.push({"w": torch.ones(1000, device="cuda")}, 0)
            assert segment.pinned
            ps.close()
        finally:
            session.close()
