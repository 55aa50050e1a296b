"""Datasets, the per-rank sampler, the built-in models and evaluation, all in-process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from gradps import datasets as datasets_module
from gradps.datasets import Dataset, ShardSampler, builtin_dataset_names, load_dataset
from gradps.evaluation import compute_loss, evaluate, loss_fn
from gradps.models import build_model, model_names
from gradps.run_spec import default_spec, validate
from gradps.tasks import DATASET_TASKS, MODEL_TASKS

# (model, dataset) pairs that every built-in model is exercised on; small sizes keep the tests fast.
_MODEL_CASES = [
    ("mlp", "digits"),
    ("cnn", "digits"),
    ("cnn", "synthetic-images"),
    ("resnet18", "synthetic-images"),
    ("transformer", "synthetic-tokens"),
    ("transformer", "synthetic-tokens-varlen"),
]


def _dataset(name: str) -> Dataset:
    return load_dataset(name, size=0 if name == "digits" else 128)


def tiny_dataset(size: int, seed: int) -> Dataset:
    """A user dataset loaded by import path in the tests below."""
    generator = torch.Generator().manual_seed(seed)
    n = size or 16
    x = torch.randn(n, 4, generator=generator)
    y = (x[:, 0] > 0).long()
    return Dataset("tiny", x, y, x[:8], y[:8], "classification", (4,), 2)


def tiny_model(dataset: Dataset) -> nn.Module:
    """A user model built by import path in the tests below."""
    return nn.Linear(dataset.input_shape[0], dataset.num_classes)


def test_digits_shapes_and_fixed_stratified_split() -> None:
    digits = load_dataset("digits")
    assert digits.task == "classification" and digits.input_shape == (64,) and digits.num_classes == 10
    assert digits.train_x.shape == (1437, 64) and digits.test_x.shape == (360, 64)
    assert digits.train_x.dtype == torch.float32 and digits.train_y.dtype == torch.int64
    assert 0.0 <= float(digits.train_x.min()) and float(digits.train_x.max()) <= 1.0
    # Stratified: every class has 36 +- 1 test samples.
    assert all(35 <= int(c) <= 37 for c in torch.bincount(digits.test_y, minlength=10))
    # The split ignores the seed, so every process agrees on it.
    other = load_dataset("digits", seed=7)
    assert torch.equal(other.train_x, digits.train_x) and torch.equal(other.test_y, digits.test_y)
    # Cached in-process.
    assert load_dataset("digits") is digits


def test_the_shipped_digits_are_scikit_learns_split_bit_for_bit() -> None:
    """gradps/data/digits.npz holds scikit-learn's digits split 80/20, stratified, seed 0: the
    dataset equals what train_test_split gives (after a change, `python scripts/make_digits.py`)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x, y = (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)
    expected = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    digits = load_dataset("digits")
    for got, want in zip((digits.train_x, digits.test_x, digits.train_y, digits.test_y), expected, strict=True):
        assert got.dtype == torch.from_numpy(want).dtype and torch.equal(got, torch.from_numpy(want))


def test_synthetic_datasets_sizes_and_determinism() -> None:
    images = load_dataset("synthetic-images")
    assert images.train_x.shape == (2048, 3, 32, 32) and images.test_x.shape == (512, 3, 32, 32)
    assert images.train_x.dtype == torch.float32 and int(images.train_y.max()) == 9

    small = load_dataset("synthetic-images", size=100, seed=3)
    assert small.train_x.shape[0] == 100 and small.test_x.shape[0] == 64
    # Rebuilt past the in-process cache, as another process would build it.
    again = datasets_module._load_builtin.__wrapped__("synthetic-images", 100, 3)
    assert torch.equal(small.train_x, again.train_x) and torch.equal(small.test_y, again.test_y)
    assert not torch.equal(load_dataset("synthetic-images", size=100, seed=4).train_x, small.train_x)

    tokens = load_dataset("synthetic-tokens")
    assert tokens.task == "language_model" and tokens.num_classes == 256 and tokens.input_shape == (64,)
    assert tokens.train_x.shape == (1024, 64) and tokens.test_y.shape == (128, 64)
    # Targets are the inputs shifted by one token.
    assert torch.equal(tokens.train_x[:, 1:], tokens.train_y[:, :-1])
    assert load_dataset("synthetic-tokens", size=400).test_x.shape[0] == 100


def test_shard_sampler_partitions_and_reshuffles_deterministically() -> None:
    n, world, batch = 103, 4, 8
    samplers = [ShardSampler(n, rank, world, batch, seed=11) for rank in range(world)]
    slices = [set(s.indices.tolist()) for s in samplers]
    assert set().union(*slices) == set(range(n))
    assert sum(len(s) for s in slices) == n  # disjoint
    assert max(len(s) for s in slices) - min(len(s) for s in slices) <= 1

    sampler = samplers[1]
    assert sampler.steps_per_epoch == len(slices[1]) // batch == len(sampler)
    epoch0 = list(sampler)
    assert len(epoch0) == sampler.steps_per_epoch and all(len(b) == batch for b in epoch0)
    seen = torch.cat(epoch0).tolist()
    assert len(set(seen)) == len(seen) and set(seen) <= slices[1]  # no repeats, only own samples
    epoch1 = list(sampler)
    assert not torch.equal(torch.cat(epoch0), torch.cat(epoch1))  # reshuffled
    assert sampler.epoch == 2

    # The same arguments give the same stream across epoch boundaries.
    twin = ShardSampler(n, 1, world, batch, seed=11)
    replay = [twin.next_batch() for _ in range(2 * sampler.steps_per_epoch)]
    assert all(torch.equal(a, b) for a, b in zip(replay, epoch0 + epoch1, strict=True))
    assert torch.equal(twin.epoch_order(1)[: batch * twin.steps_per_epoch], torch.cat(epoch1))
    # Another seed partitions differently.
    assert set(ShardSampler(n, 1, world, batch, seed=12).indices.tolist()) != slices[1]


def test_shard_sampler_small_slice_is_one_batch() -> None:
    sampler = ShardSampler(10, 0, 2, batch_size=32, seed=0)
    assert sampler.batch_size == 5 and sampler.steps_per_epoch == 1
    assert sorted(sampler.next_batch().tolist()) == sorted(sampler.indices.tolist())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2, "world": 2}, "rank must be in"),
        ({"rank": -1, "world": 2}, "rank must be in"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"world": 0, "rank": 0}, "world must be >= 1"),
        ({"n": 1, "world": 2}, "cannot split"),
    ],
)
def test_shard_sampler_rejects_bad_arguments(kwargs: dict[str, int], message: str) -> None:
    arguments = {"n": 10, "rank": 0, "world": 1, "batch_size": 4, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        ShardSampler(**arguments)


@pytest.mark.parametrize(("model_name", "dataset_name"), _MODEL_CASES)
def test_model_forward_backward(model_name: str, dataset_name: str) -> None:
    dataset = _dataset(dataset_name)
    torch.manual_seed(0)
    model = build_model(model_name, dataset)
    x, y = dataset.train_x[:4], dataset.train_y[:4]
    logits = model(x)
    expected = (4, *dataset.input_shape, dataset.num_classes) if dataset.task == "language_model" else (4, 10)
    assert logits.shape == expected
    compute_loss(model, x, y, dataset.task).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize(("model_name", "dataset_name"), _MODEL_CASES)
def test_model_is_deterministic_for_a_seed_and_has_no_buffers(model_name: str, dataset_name: str) -> None:
    dataset = _dataset(dataset_name)
    torch.manual_seed(5)
    first = build_model(model_name, dataset)
    torch.manual_seed(5)
    second = build_model(model_name, dataset)
    assert list(first.state_dict()) == [name for name, _ in first.named_parameters()]
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert list(first.buffers()) == []


def test_transformer_is_causal() -> None:
    dataset = _dataset("synthetic-tokens")
    torch.manual_seed(0)
    model = build_model("transformer", dataset)
    tokens = dataset.test_x[:2].clone()
    before = model(tokens)
    tokens[:, 40:] = (tokens[:, 40:] + 1) % dataset.num_classes
    after = model(tokens)
    # Changing later tokens leaves the logits of earlier positions unchanged.
    assert torch.allclose(before[:, :40], after[:, :40], atol=1e-5)
    assert not torch.allclose(before[:, 40:], after[:, 40:])


def test_mlp_reaches_95_percent_on_digits_with_plain_sgd() -> None:
    digits = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", digits)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler = ShardSampler(len(digits.train_x), rank=0, world=1, batch_size=64, seed=0)
    for _ in range(500):
        batch = sampler.next_batch()
        optimizer.zero_grad()
        compute_loss(model, digits.train_x[batch], digits.train_y[batch], digits.task).backward()
        optimizer.step()
    loss, accuracy = evaluate(model, digits)
    assert accuracy >= 0.95, f"test accuracy {accuracy:.3f}, loss {loss:.3f} after 500 steps"
    assert model.training  # evaluate restores the mode


def test_evaluate_language_model_reports_token_accuracy() -> None:
    dataset = _dataset("synthetic-tokens")
    torch.manual_seed(0)
    model = build_model("transformer", dataset)
    loss, accuracy = evaluate(model, dataset, batch_size=50)
    # An untrained model is near uniform over the vocabulary.
    assert abs(loss - torch.log(torch.tensor(256.0)).item()) < 1.0
    assert 0.0 <= accuracy < 0.1


def test_unknown_names_list_the_builtins() -> None:
    with pytest.raises(ValueError, match="mlp, cnn, resnet18, transformer"):
        build_model("vgg", load_dataset("digits"))
    with pytest.raises(ValueError, match="digits, synthetic-images, synthetic-tokens, synthetic-tokens-varlen"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="no_such_module.*built-in models: mlp"):
        build_model("no_such_module:fn", load_dataset("digits"))
    with pytest.raises(ValueError, match="no attribute 'missing'.*built-in datasets: digits"):
        load_dataset("tests.test_models_datasets:missing")
    with pytest.raises(ValueError, match="unknown task"):
        loss_fn("regression")
    assert builtin_dataset_names() == ["digits", "synthetic-images", "synthetic-tokens", "synthetic-tokens-varlen"]
    assert model_names() == ["mlp", "cnn", "resnet18", "transformer"]


def test_model_rejects_a_dataset_of_the_wrong_task() -> None:
    with pytest.raises(ValueError, match="needs a language_model dataset"):
        build_model("transformer", load_dataset("digits"))
    with pytest.raises(ValueError, match="needs a classification dataset"):
        build_model("mlp", _dataset("synthetic-tokens"))


def _validate(model: str, dataset: str) -> None:
    spec = default_spec()
    spec.model, spec.dataset = model, dataset
    validate(spec)


def test_the_tasks_a_spec_is_checked_by_are_those_of_the_models_and_datasets() -> None:
    assert list(MODEL_TASKS) == model_names()
    for name, task in DATASET_TASKS.items():
        assert _dataset(name).task == task, name
    for model, dataset in [("mlp", "synthetic-images"), ("transformer", "synthetic-tokens-varlen")]:
        _validate(model, dataset)  # a pair the workers build
        build_model(model, _dataset(dataset))
    with pytest.raises(ValueError, match="model 'cnn' needs a classification dataset, but 'synthetic-tokens' is"):
        _validate("cnn", "synthetic-tokens")
    with pytest.raises(ValueError, match="unknown dataset 'mnist'; choose one of digits"):
        _validate("mlp", "mnist")
    _validate("pkg.mod:fn", "pkg.mod:data")  # resolved by the workers


def test_dataset_rejects_inconsistent_tensors() -> None:
    x = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="expected input_shape"):
        Dataset("bad", x, torch.zeros(4), x, torch.zeros(4), "classification", (2,), 2)
    with pytest.raises(ValueError, match="train_y has 3"):
        Dataset("bad", x, torch.zeros(3), x, torch.zeros(4), "classification", (3,), 2)
    with pytest.raises(ValueError, match="task must be one of"):
        Dataset("bad", x, torch.zeros(4), x, torch.zeros(4), "regression", (3,), 2)


def test_user_dataset_and_model_by_import_path() -> None:
    dataset = load_dataset("tests.test_models_datasets:tiny_dataset", size=32, seed=1)
    assert dataset.name == "tiny" and dataset.train_x.shape == (32, 4)
    model = build_model("tests.test_models_datasets:tiny_model", dataset)
    assert isinstance(model, nn.Linear)
    loss, accuracy = evaluate(model, dataset)
    assert loss > 0 and 0.0 <= accuracy <= 1.0
