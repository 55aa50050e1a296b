"""A worker's view of its run's checkpoint cuts (gradps/cuts.py), and the error-feedback residual
sent whole in the push before one, so that a cut holds no residual."""

from __future__ import annotations

import time

import torch

from gradps.codecs import ErrorFeedback, get_codec
from gradps.cuts import DECLARE_AHEAD, Cuts
from gradps.v1 import run_pb2, tensor_pb2


def test_the_scheduled_cuts_are_every_checkpoint_step():
    cuts = Cuts(run_pb2.RunSpec(checkpoint_every_steps=20), declares=True)
    assert [s for s in range(1, 61) if cuts.is_cut(s)] == [20, 40, 60]
    assert [cuts.declaration(s) for s in range(5)] == [0] * 5  # no seconds, nothing asked
    assert not any(Cuts(run_pb2.RunSpec(), declares=True).is_cut(s) for s in range(1, 100))


def test_rank_0_declares_a_cut_ahead_once_its_interval_passed_or_one_is_asked_for():
    rank0 = Cuts(run_pb2.RunSpec(checkpoint_every_seconds=0.05), declares=True)
    other = Cuts(run_pb2.RunSpec(checkpoint_every_seconds=0.05), declares=False)
    assert rank0.declaration(7) == 0
    time.sleep(0.06)
    assert other.declaration(7) == 0  # only rank 0 keeps the clock
    cut = rank0.declaration(7)
    assert cut == 7 + DECLARE_AHEAD and rank0.is_cut(cut)
    assert rank0.declaration(8) == 0  # the interval starts again
    assert not other.is_cut(cut)
    other.learn(cut)  # a shard's answer names it
    assert other.is_cut(cut) and not other.is_cut(cut + 1)
    assert not other.is_cut(cut + 5) and not other.is_cut(cut)  # past cuts are forgotten

    other.learn(0, asked=True)  # asked: only the declaring worker acts on it
    assert other.declaration(20) == 0
    rank0.learn(0, asked=True)
    assert rank0.declaration(20) == 20 + DECLARE_AHEAD
    assert rank0.declaration(21) == 0


def test_the_push_before_a_cut_sends_gradient_and_residual_whole_leaving_none():
    """What the worker sent up to and including the push before a cut sums to the gradients
    exactly: a run that goes back to the cut (with no residual, as a new or restored worker has
    it) has lost nothing."""
    topk = get_codec(tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_TOPK, ratio=0.05))
    feedback, sent = ErrorFeedback(), torch.zeros(400, dtype=torch.float64)
    total = torch.zeros(400, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        grad = torch.randn(400, generator=g)
        total += grad.double()
        if step < 5:
            payload = feedback.compress("w", grad, topk)
            sent += topk.decode(payload, 400, "cpu").double()
        else:
            sent += feedback.drain("w", grad).double()
    assert torch.allclose(sent, total, atol=1e-5), (sent - total).abs().max()
    # The residual is gone: the next push starts from its gradient alone.
    grad = torch.randn(400, generator=g)
    assert torch.equal(feedback.drain("w", grad), grad)
