"""A shard's ShardOptimizer (one fused step over the parts a push updates) gives exactly what one
optimizer per part gives, each part at its own place in the learning-rate schedule."""

from __future__ import annotations

import pytest
import torch

from gradps.optimizer import ShardOptimizer, make_optimizer
from gradps.optimizer_spec import asynchrony_aware, learning_rate, model_averaged, validate
from gradps.v1 import run_pb2

SPECS = [
    run_pb2.OptimizerSpec(name="sgd", lr=0.1),
    run_pb2.OptimizerSpec(name="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    run_pb2.OptimizerSpec(name="adam", lr=1e-3),
    run_pb2.OptimizerSpec(name="adamw", lr=1e-3, weight_decay=0.01, schedule="cosine", warmup_steps=2),
    run_pb2.OptimizerSpec(name="adam", lr=1e-2, schedule="step", step_size=2, gamma=0.5),
]
COUNTS = {("w", 0): 1000, ("w", 1): 37, ("b", 0): 5}
# Calls as a shard makes them: every part at once, a subset, a part twice (a sync part that
# completes two steps in one call), and parts of one call at different staleness scales.
CALLS = [
    [(("w", 0), 1.0), (("w", 1), 1.0), (("b", 0), 1.0)],
    [(("w", 0), 1.0), (("b", 0), 1.0)],
    [(("w", 1), 1.0), (("w", 1), 1.0), (("w", 0), 1.0)],
    [(("w", 0), 0.5), (("w", 1), 1.0), (("b", 0), 0.25)],
    [(("b", 0), 1.0), (("w", 0), 1.0), (("w", 1), 1.0)],
]


def apply_calls(spec: run_pb2.OptimizerSpec, device: str) -> tuple[dict, dict, dict]:
    """(values after CALLS through a ShardOptimizer, values after CALLS through one torch optimizer
    per part in float64, stepped one at a time with the part's scheduled lr, the start values)."""
    generator = torch.Generator().manual_seed(0)
    start = {key: torch.randn(n, generator=generator) for key, n in COUNTS.items()}
    grads = [[(key, torch.randn(COUNTS[key], generator=generator), s) for key, s in call] for call in CALLS]
    shard = ShardOptimizer({k: v.clone().to(device) for k, v in start.items()}, spec, total_steps=10)
    reference = {k: torch.nn.Parameter(v.clone().double(), requires_grad=False) for k, v in start.items()}
    per_part = {k: make_optimizer([p], spec) for k, p in reference.items()}
    updates = dict.fromkeys(COUNTS, 0)
    for call in grads:
        shard.apply([(key, g.to(device), s) for key, g, s in call])
        for key, g, s in call:
            reference[key].grad = g.double()
            per_part[key].param_groups[0]["lr"] = learning_rate(spec, updates[key], 10) * s
            per_part[key].step()
            updates[key] += 1
    assert shard.updates == updates == {("w", 0): 5, ("w", 1): 5, ("b", 0): 4}
    assert all(p.grad is None for p in shard.params.values())
    got = {k: p.detach().cpu() for k, p in shard.params.items()}
    return got, {k: p.detach().float() for k, p in reference.items()}, start


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-{s.schedule or 'constant'}")
def test_a_fused_step_over_parts_matches_one_optimizer_per_part(spec):
    got, expected, start = apply_calls(spec, "cpu")
    for key in COUNTS:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=str(key))
        assert not torch.equal(got[key], start[key])


def test_the_parts_share_the_shards_memory():
    """The optimizer updates the tensors the shard serves, not copies of them."""
    values = {("w", 0): torch.zeros(8)}
    opt = ShardOptimizer(values, run_pb2.OptimizerSpec(name="sgd", lr=1.0), total_steps=1)
    opt.apply([(("w", 0), torch.ones(8), 1.0)])
    assert torch.equal(values[("w", 0)], -torch.ones(8))


def test_a_shard_without_parts_has_nothing_to_update():
    opt = ShardOptimizer({}, run_pb2.OptimizerSpec(name="adam", lr=1e-3), total_steps=1)
    opt.apply([])
    with pytest.raises(KeyError):
        opt.apply([(("w", 0), torch.ones(1), 1.0)])


def test_asynchrony_aware_momentum_lowers_sgd_momentum_by_what_p_workers_add():
    spec = run_pb2.OptimizerSpec(name="sgd", lr=0.05, momentum=0.9, nesterov=True, schedule="constant")
    four = asynchrony_aware(spec, 4)
    assert four.momentum == pytest.approx(0.15) and four.nesterov
    # A push's effective step lr / (1 - mu) is 1/P of the run's: 0.5 / 4.
    assert four.lr / (1 - four.momentum) == pytest.approx(0.05 / (1 - 0.9) / 4)
    # One worker adds nothing; many leave no explicit momentum (nor Nesterov, which needs it).
    one = asynchrony_aware(spec, 1)
    assert (one.momentum, one.lr) == (pytest.approx(0.9), pytest.approx(0.05))
    many = asynchrony_aware(spec, 20)
    assert many.momentum == 0 and not many.nesterov and many.lr == pytest.approx(0.5 / 20)
    validate(many)
    plain = run_pb2.OptimizerSpec(name="sgd", lr=0.2)
    assert asynchrony_aware(plain, 4) == plain
    adam = run_pb2.OptimizerSpec(name="adam", lr=0.001, beta1=0.9)
    assert asynchrony_aware(adam, 4) == adam
    assert spec.momentum == pytest.approx(0.9)  # the run's own spec is not changed


def test_a_model_averaged_adam_steps_sqrt_p_further_and_sgd_as_it_is():
    adam = run_pb2.OptimizerSpec(name="adamw", lr=0.001, beta1=0.9, weight_decay=0.01)
    four = model_averaged(adam, 4)
    assert four.lr == pytest.approx(0.002) and four.beta1 == adam.beta1
    assert four.lr * four.weight_decay == pytest.approx(adam.lr * adam.weight_decay)  # decoupled decay as it was
    assert model_averaged(adam, 1) == adam
    l2 = run_pb2.OptimizerSpec(name="adam", lr=0.001, weight_decay=0.01)  # Adam's decay is in the gradient
    assert model_averaged(l2, 4).weight_decay == pytest.approx(0.01)
    assert adam.lr == pytest.approx(0.001)  # the run's own spec is not changed
    sgd = run_pb2.OptimizerSpec(name="sgd", lr=0.05, momentum=0.9)
    assert model_averaged(sgd, 4) == sgd
