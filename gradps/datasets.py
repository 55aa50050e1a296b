"""Datasets for training runs and each rank's partition of the training set.

Every dataset is in memory and generated or bundled locally: nothing downloads at run time, and
every process that loads a dataset with the same arguments gets bit-identical tensors, so workers
in different processes agree on sample indices without exchanging data.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F

from gradps.import_paths import check_import_allowed, resolve_import_path
from gradps.tasks import DATASET_TASKS, TASKS

_IMAGE_CLASSES = 10
_IMAGE_SHAPE = (3, 32, 32)
_IMAGE_DEFAULT_SIZES = (2048, 512)
# Standard deviation of the class pattern relative to unit pixel noise.
_IMAGE_SIGNAL = 0.1
_TOKEN_VOCAB = 256
_TOKEN_SEQ_LEN = 64
_TOKEN_DEFAULT_SIZES = (1024, 128)
# Probability that a token follows the rule rather than being drawn uniformly: the noise keeps the
# task from being a lookup table while the best achievable token accuracy stays about 0.9.
_TOKEN_RULE_PROB = 0.9
# Variable-length sequences: Pareto lengths with P(length >= L) = (_VARLEN_MIN / L) ** _VARLEN_TAIL,
# capped at _VARLEN_MAX. Half are at most 11 tokens, 1 in 64 reaches 64 and 1 in 256 the cap, so
# the longest of a 32-sequence batch, which sets its step time, is 30 to 128 in 8 batches of 10.
_VARLEN_MIN = 8
_VARLEN_MAX = 128
_VARLEN_TAIL = 2.0
_VARLEN_DEFAULT_SIZES = (2048, 256)

# Target at a padded position (past its sequence's end): loss and accuracy leave it out. The value
# is torch's default ignore_index for cross-entropy.
PAD_TARGET = -100
# Input at a padded position. Any real token serves: padding follows the sequence, and the model is
# causal, so no real position attends to it.
PAD_TOKEN = 0


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors field by field is ambiguous
class Dataset:
    """An in-memory dataset with a fixed train/test split.

    Loaded built-ins are cached and shared by every caller in the process: treat the tensors as
    read-only.
    """

    name: str  # the name or import path it was loaded by
    train_x: torch.Tensor  # training inputs, (N, *input_shape)
    # training targets: int64 labels (N,), or next tokens (N, T) for an LM, PAD_TARGET past the end
    # of a sequence shorter than T (padding only at the end)
    train_y: torch.Tensor
    test_x: torch.Tensor  # test inputs, (M, *input_shape)
    test_y: torch.Tensor  # test targets, same layout as train_y
    task: str  # "classification" or "language_model"
    input_shape: tuple[int, ...]  # shape of one input sample, e.g. (64,) or (3, 32, 32)
    num_classes: int  # number of labels; the vocabulary size for a language model

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"dataset {self.name!r}: task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.num_classes < 1:
            raise ValueError(f"dataset {self.name!r}: num_classes must be >= 1, got {self.num_classes}")
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"dataset {self.name!r}: {split}_x has {x.shape[0]} samples, {split}_y has {y.shape[0]}"
                )
            if tuple(x.shape[1:]) != tuple(self.input_shape):
                raise ValueError(
                    f"dataset {self.name!r}: {split}_x samples have shape {tuple(x.shape[1:])}, "
                    f"expected input_shape {tuple(self.input_shape)}"
                )


def builtin_dataset_names() -> list[str]:
    """Names `load_dataset` accepts besides a `"package.module:function"` import path."""
    return list(DATASET_TASKS)


def load_dataset(name: str, size: int = 0, seed: int = 0, allow_import: Collection[str] | None = None) -> Dataset:
    """Load a built-in dataset by name, or a user dataset by `"package.module:function"`.

    Built-ins: `digits` (scikit-learn's 8x8 digits, shipped in gradps/data: a fixed stratified
    80/20 split; `size` and `seed` are ignored), `synthetic-images` (3x32x32, 10 classes),
    `synthetic-tokens` (causal LM sequences of 64 tokens) and `synthetic-tokens-varlen` (the same
    rule, lengths 8..128 from a power law, padded to 128: inputs with PAD_TOKEN, targets with
    PAD_TARGET). For the synthetic
    ones `size` > 0 sets the number of training samples (test samples: max(64, size // 4)) and
    `seed` determines every tensor. A user function is called as `function(size, seed)` and must
    return a `Dataset`.

    `allow_import`: the import paths that may be imported (`check_import_allowed`); None: any,
    for a caller whose own code names the dataset. ImportRefused for one that is not allowed.
    """
    if size < 0:
        raise ValueError(f"size must be >= 0 (0 means the dataset's default), got {size}")
    if name in DATASET_TASKS:
        return _load_builtin(name, size, seed)
    if ":" in name:
        check_import_allowed(name, allow_import)
        try:
            factory = resolve_import_path(name)
        except ValueError as err:
            raise ValueError(
                f"cannot load dataset {name!r}: {err}; built-in datasets: {', '.join(DATASET_TASKS)}"
            ) from err
        dataset = factory(size, seed)
        if not isinstance(dataset, Dataset):
            raise TypeError(f"dataset function {name!r} returned {type(dataset).__name__}, expected a Dataset")
        return dataset
    raise ValueError(
        f"unknown dataset {name!r}: expected one of {', '.join(DATASET_TASKS)} or 'package.module:function'"
    )


# Several workers in one process load the same dataset: build it once.
@functools.lru_cache(maxsize=16)
def _load_builtin(name: str, size: int, seed: int) -> Dataset:
    if name == "digits":
        return _digits()
    if name == "synthetic-images":
        return _synthetic_images(*_synthetic_sizes(size, _IMAGE_DEFAULT_SIZES), seed)
    if name == "synthetic-tokens-varlen":
        return _synthetic_tokens_varlen(*_synthetic_sizes(size, _VARLEN_DEFAULT_SIZES), seed)
    return _synthetic_tokens(*_synthetic_sizes(size, _TOKEN_DEFAULT_SIZES), seed)


def _synthetic_sizes(size: int, default: tuple[int, int]) -> tuple[int, int]:
    return default if size == 0 else (size, max(64, size // 4))


def _digits() -> Dataset:
    # scikit-learn's digits, split as scripts/make_digits.py says; read without importing
    # scikit-learn, which would add seconds to every worker's start.
    with resources.files("gradps").joinpath("data/digits.npz").open("rb") as file, np.load(file) as split:
        # Pixel intensities are integers 0..16.
        train_x, test_x = ((split[k] / 16.0).astype(np.float32) for k in ("train_x", "test_x"))
        train_y, test_y = split["train_y"], split["test_y"]
    return Dataset(
        name="digits",
        train_x=torch.from_numpy(train_x),
        train_y=torch.from_numpy(train_y),
        test_x=torch.from_numpy(test_x),
        test_y=torch.from_numpy(test_y),
        task=DATASET_TASKS["digits"],
        input_shape=(64,),
        num_classes=10,
    )


def _synthetic_images(n_train: int, n_test: int, seed: int) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    # Smooth class patterns (4x4 upsampled to 32x32, std _IMAGE_SIGNAL) buried in much stronger
    # pixel noise (SNR 0.1 per pixel): learnable (the MLP and the CNN reach ~96-98% test accuracy in
    # 300 SGD steps) yet not solved in a handful of steps, so schemes can be told apart.
    low_res = torch.randn(_IMAGE_CLASSES, _IMAGE_SHAPE[0], 4, 4, generator=generator)
    patterns = F.interpolate(low_res, size=_IMAGE_SHAPE[1:], mode="bilinear", align_corners=False)
    patterns = _IMAGE_SIGNAL * patterns / patterns.std()

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Balanced classes in random order.
        labels = (torch.arange(n) % _IMAGE_CLASSES)[torch.randperm(n, generator=generator)]
        noise = torch.randn((n, *_IMAGE_SHAPE), generator=generator)
        return patterns[labels] + noise, labels

    train_x, train_y = draw(n_train)
    test_x, test_y = draw(n_test)
    return Dataset(
        name="synthetic-images",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        task=DATASET_TASKS["synthetic-images"],
        input_shape=_IMAGE_SHAPE,
        num_classes=_IMAGE_CLASSES,
    )


def _token_rule(generator: torch.Generator) -> tuple[int, int]:
    # The rule next = (a * token + c) mod vocab with odd a is a permutation of the vocabulary, so
    # every token has exactly one likely successor.
    multiplier = 2 * int(torch.randint(0, _TOKEN_VOCAB // 2, (1,), generator=generator)) + 1
    offset = int(torch.randint(0, _TOKEN_VOCAB, (1,), generator=generator))
    return multiplier, offset


def _rule_sequences(n: int, length: int, rule: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """(n, length) tokens, each following `rule` from the one before with probability _TOKEN_RULE_PROB."""
    multiplier, offset = rule
    tokens = torch.empty(n, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, _TOKEN_VOCAB, (n,), generator=generator)
    for i in range(1, length):
        follows = torch.rand(n, generator=generator) < _TOKEN_RULE_PROB
        random_tokens = torch.randint(0, _TOKEN_VOCAB, (n,), generator=generator)
        tokens[:, i] = torch.where(follows, (multiplier * tokens[:, i - 1] + offset) % _TOKEN_VOCAB, random_tokens)
    return tokens


def _synthetic_tokens(n_train: int, n_test: int, seed: int) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    rule = _token_rule(generator)
    train = _rule_sequences(n_train, _TOKEN_SEQ_LEN + 1, rule, generator)
    test = _rule_sequences(n_test, _TOKEN_SEQ_LEN + 1, rule, generator)
    return Dataset(
        name="synthetic-tokens",
        train_x=train[:, :-1].contiguous(),
        train_y=train[:, 1:].contiguous(),
        test_x=test[:, :-1].contiguous(),
        test_y=test[:, 1:].contiguous(),
        task=DATASET_TASKS["synthetic-tokens"],
        input_shape=(_TOKEN_SEQ_LEN,),
        num_classes=_TOKEN_VOCAB,
    )


def sequence_lengths(targets: torch.Tensor) -> torch.Tensor:
    """Real (unpadded) tokens per sequence of a language model's (N, T) targets."""
    return (targets != PAD_TARGET).sum(dim=1)


def _synthetic_tokens_varlen(n_train: int, n_test: int, seed: int) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    rule = _token_rule(generator)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = _rule_sequences(n, _VARLEN_MAX + 1, rule, generator)
        # Inverse-CDF draw of the Pareto length; 1 - U lies in (0, 1], so the power is finite.
        uniform = 1.0 - torch.rand(n, generator=generator, dtype=torch.float64)
        lengths = (_VARLEN_MIN * uniform ** (-1.0 / _VARLEN_TAIL)).floor().clamp(_VARLEN_MIN, _VARLEN_MAX).long()
        padded = torch.arange(_VARLEN_MAX).unsqueeze(0) >= lengths.unsqueeze(1)
        x = tokens[:, :-1].masked_fill(padded, PAD_TOKEN)
        y = tokens[:, 1:].masked_fill(padded, PAD_TARGET)
        return x, y

    train_x, train_y = draw(n_train)
    test_x, test_y = draw(n_test)
    return Dataset(
        name="synthetic-tokens-varlen",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        task=DATASET_TASKS["synthetic-tokens-varlen"],
        input_shape=(_VARLEN_MAX,),
        num_classes=_TOKEN_VOCAB,
    )


class ShardSampler:
    """One rank's partition of the training set for data-parallel training.

    A permutation of all `n` indices drawn with `seed` is cut into `world` nearly equal contiguous
    slices; rank `rank` owns one. Each epoch the rank reshuffles its own slice with
    (seed, epoch, rank), so every rank sees only its own samples and a restarted worker can
    recompute any epoch's order. Batches hold `batch_size` indices; the incomplete last batch of an
    epoch is dropped, except that a slice smaller than `batch_size` is one whole batch.

    `next_batch()` is an endless stream that rolls over into the next epoch; iterating the sampler
    yields the batches left in the current epoch (one full epoch from a fresh sampler).
    """

    def __init__(self, n: int, rank: int, world: int, batch_size: int, seed: int) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}) for world {world}, got {rank}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if n < world:
            raise ValueError(f"cannot split {n} samples across {world} ranks: every rank needs at least one")
        self._rank = rank
        self._seed = seed
        permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        self._indices = torch.tensor_split(permutation, world)[rank].clone()
        self._batch_size = min(batch_size, len(self._indices))
        self._epoch = 0
        self._step = 0  # batches already taken from the current epoch
        self._order = self.epoch_order(0)

    @property
    def indices(self) -> torch.Tensor:
        """This rank's sample indices, in slice order (not shuffled)."""
        return self._indices

    @property
    def batch_size(self) -> int:
        """Indices per batch: the requested size, or the whole slice when that is smaller."""
        return self._batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Complete batches per epoch."""
        return len(self._indices) // self._batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (advances lazily, when a batch is taken)."""
        return self._epoch if self._step < self.steps_per_epoch else self._epoch + 1

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's indices in the order used during `epoch`."""
        # SeedSequence mixes the three numbers so that nearby (seed, epoch, rank) give unrelated orders.
        mixed = int(np.random.SeedSequence([self._seed, epoch, self._rank]).generate_state(1, np.uint64)[0])
        generator = torch.Generator().manual_seed(mixed)
        return self._indices[torch.randperm(len(self._indices), generator=generator)]

    def next_batch(self) -> torch.Tensor:
        """The next batch of sample indices (int64), starting the next epoch when this one is done."""
        if self._step == self.steps_per_epoch:
            self._epoch += 1
            self._step = 0
            self._order = self.epoch_order(self._epoch)
        start = self._step * self._batch_size
        self._step += 1
        return self._order[start : start + self._batch_size]

    def seek(self, batches: int) -> None:
        """Go to where a fresh sampler is after `batches` calls of next_batch() (a run that went
        back to a checkpoint takes the same batches again)."""
        self._epoch, self._step = divmod(batches, self.steps_per_epoch)
        if self._epoch and not self._step:  # as next_batch leaves it at an epoch's end
            self._epoch, self._step = self._epoch - 1, self.steps_per_epoch
        self._order = self.epoch_order(self._epoch)

    def __iter__(self) -> Iterator[torch.Tensor]:
        remaining = self.steps_per_epoch - self._step
        if remaining == 0:
            remaining = self.steps_per_epoch
        for _ in range(remaining):
            yield self.next_batch()

    def __len__(self) -> int:
        return self.steps_per_epoch
