"""The variable-length token workload: padded sequences, loss and accuracy over real tokens only,
and batches cut to their longest sequence so that a step's compute follows its lengths."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from gradps import datasets as datasets_module
from gradps.datasets import PAD_TARGET, PAD_TOKEN, Dataset, ShardSampler, load_dataset, sequence_lengths
from gradps.evaluation import compute_loss, evaluate, trim_padding
from gradps.models import build_model

_NAME = "synthetic-tokens-varlen"


class _WidthRecorder(nn.Module):
    """Wraps a model and records the width (tokens per sequence) of every batch it is given."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.widths: list[int] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.widths.append(tokens.shape[1])
        return self.inner(tokens)


class _Oracle(nn.Module):
    """Predicts the test split's targets exactly (any token at a padded position)."""

    def __init__(self, dataset: Dataset) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))  # gives evaluate a device to read
        self.targets = dataset.test_y
        self.vocab = dataset.num_classes
        self.seen = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, width = tokens.shape
        targets = self.targets[self.seen : self.seen + batch, :width].clamp(min=0)
        self.seen += batch
        return nn.functional.one_hot(targets, self.vocab).float() * 20.0


@pytest.fixture(scope="module")
def varlen() -> Dataset:
    return load_dataset(_NAME, size=512)


def test_sequences_are_right_padded_with_skewed_lengths(varlen: Dataset) -> None:
    assert varlen.task == "language_model" and varlen.num_classes == 256 and varlen.input_shape == (128,)
    assert varlen.train_x.shape == (512, 128) and varlen.test_y.shape == (128, 128)
    lengths = sequence_lengths(varlen.train_y)
    assert int(lengths.min()) >= 8 and int(lengths.max()) <= 128
    # Skewed: most sequences short, a few long (P(length >= L) = (8 / L) ** 2).
    assert float(lengths.float().median()) <= 16
    assert 0 < int((lengths >= 48).sum()) < 0.1 * len(lengths)
    positions = torch.arange(128).unsqueeze(0)
    padded = positions >= lengths.unsqueeze(1)
    # Padding only after each sequence's end, in inputs and targets alike.
    assert torch.equal(varlen.train_y == PAD_TARGET, padded)
    assert bool((varlen.train_x[padded] == PAD_TOKEN).all())
    # Within a sequence the targets are the inputs shifted by one token.
    inner = ~padded[:, 1:]
    assert torch.equal(varlen.train_x[:, 1:][inner], varlen.train_y[:, :-1][inner])


def test_dataset_is_deterministic_and_registered(varlen: Dataset) -> None:
    assert _NAME in datasets_module.builtin_dataset_names()
    # Rebuilt past the in-process cache, as another process would build it.
    again = datasets_module._load_builtin.__wrapped__(_NAME, 512, 0)
    assert torch.equal(again.train_x, varlen.train_x) and torch.equal(again.test_y, varlen.test_y)
    other = load_dataset(_NAME, size=512, seed=1)
    assert not torch.equal(sequence_lengths(other.train_y), sequence_lengths(varlen.train_y))
    default = load_dataset(_NAME)
    assert default.train_x.shape == (2048, 128) and default.test_x.shape == (256, 128)


def test_fixed_length_tokens_are_unchanged() -> None:
    # Digests of the tensors synthetic-tokens produced before the variable-length workload shared
    # its generator: runs and checkpoints made then must see the same data.
    tokens = load_dataset("synthetic-tokens", size=256, seed=0)
    digests = [hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16] for t in (tokens.train_x, tokens.test_y)]
    assert digests == ["1fbf1ca504a20988", "86965323b487e72a"]


def test_trim_padding_cuts_a_batch_to_its_longest_sequence(varlen: Dataset) -> None:
    lengths = sequence_lengths(varlen.train_y)
    batch = torch.argsort(lengths)[:16]  # the 16 shortest: all well under 128
    x, y = trim_padding(varlen.train_x[batch], varlen.train_y[batch], varlen.task)
    assert x.shape[1] == y.shape[1] == int(lengths[batch].max()) < 128
    assert torch.equal(sequence_lengths(y), lengths[batch])  # no real token lost
    # A batch without a padded column, and any classification batch, come back as the same tensors.
    full_x, full_y = torch.zeros(2, 6, dtype=torch.int64), torch.ones(2, 6, dtype=torch.int64)
    assert trim_padding(full_x, full_y, "language_model")[0] is full_x
    labels = torch.full((4,), PAD_TARGET)
    images = torch.zeros(4, 3)
    assert trim_padding(images, labels, "classification") == (images, labels)


def test_compute_loss_runs_the_model_on_the_trimmed_batch_and_ignores_padding(varlen: Dataset) -> None:
    torch.manual_seed(0)
    model = _WidthRecorder(build_model("transformer", varlen))
    lengths = sequence_lengths(varlen.train_y)
    short = torch.argsort(lengths)[:8]
    long = torch.argsort(lengths)[-8:]
    for batch in (short, long):
        x, y = varlen.train_x[batch], varlen.train_y[batch]
        loss = compute_loss(model, x, y, varlen.task)
        # The padded width is never computed: the model sees only the longest sequence's width.
        assert model.widths[-1] == int(lengths[batch].max())
        # The mean is over real tokens, and the same as the untrimmed batch's (the model is causal).
        logits = model.inner(x)
        real = y != PAD_TARGET
        expected = nn.functional.cross_entropy(logits[real], y[real])
        assert torch.allclose(loss, expected, atol=1e-5)
        # What the padded positions hold does not matter.
        noisy = x.masked_fill(~real, 7)
        assert torch.allclose(compute_loss(model, noisy, y, varlen.task), loss, atol=1e-5)
    assert model.widths[0] < model.widths[2]


def test_evaluate_counts_only_real_tokens(varlen: Dataset) -> None:
    oracle = _Oracle(varlen)
    recorder = _WidthRecorder(oracle)
    loss, accuracy = evaluate(recorder, varlen, batch_size=32)
    # Every real token right; padding, most of each row, counts neither way.
    assert accuracy == 1.0 and loss < 1e-3
    test_lengths = sequence_lengths(varlen.test_y)
    assert recorder.widths == [int(test_lengths[i : i + 32].max()) for i in range(0, 128, 32)]
    # An untrained transformer is near chance per real token.
    torch.manual_seed(0)
    _, untrained = evaluate(build_model("transformer", varlen), varlen)
    assert untrained < 0.05


def test_transformer_learns_the_varlen_rule() -> None:
    dataset = load_dataset(_NAME, size=1024, seed=2)
    torch.manual_seed(0)
    model = build_model("transformer", dataset)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler = ShardSampler(len(dataset.train_x), rank=0, world=1, batch_size=32, seed=0)
    for _ in range(50):
        batch = sampler.next_batch()
        optimizer.zero_grad()
        compute_loss(model, dataset.train_x[batch], dataset.train_y[batch], dataset.task).backward()
        optimizer.step()
    _, accuracy = evaluate(model, dataset)
    # Chance is 1/256; the rule's noise caps accuracy at about 0.9.
    assert accuracy > 0.6, f"token accuracy {accuracy:.3f} after 50 steps"
