"""Models a run can train, built by name for a dataset.

The parameter server carries parameters only (named by `Module.named_parameters()`), so every
built-in model has no buffers: nothing a worker learns lives outside the tensors the shards hold.
A user model with buffers (e.g. BatchNorm running statistics) still trains, but its buffers stay
local to each worker and are never averaged or checkpointed by the server.

Weights are drawn from torch's global generator: a caller that sets `torch.manual_seed` before
`build_model` gets the same initial weights in every process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

import torch
from torch import nn

from gradps.datasets import Dataset
from gradps.import_paths import check_import_allowed, resolve_import_path
from gradps.tasks import check_task


class MLP(nn.Module):
    """Flatten -> 128 -> 64 -> classes, with ReLU."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, 128),
            nn.ReLU(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ConvNet(nn.Module):
    """Two 3x3 convolutions, a max-pool, and a two-layer classifier on a 4x4 pooled map."""

    def __init__(self, image_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        self.image_shape = image_shape
        self.features = nn.Sequential(
            nn.Conv2d(image_shape[0], 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            # A fixed 4x4 map makes the classifier's size independent of the image size.
            nn.AdaptiveAvgPool2d(4),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.reshape(x.shape[0], *self.image_shape)))


def _batch_norm(channels: int) -> nn.BatchNorm2d:
    # No running statistics: they would be buffers, which the parameter server does not carry.
    # Normalization always uses the current batch's statistics, in eval mode too, so evaluate in
    # batches of more than one sample.
    return nn.BatchNorm2d(channels, track_running_stats=False)


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convolutions with a residual connection."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _batch_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = _batch_norm(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), _batch_norm(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18: 3x3 stem without max-pool, BasicBlocks [2, 2, 2, 2], widths 64..512."""

    def __init__(self, image_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        self.image_shape = image_shape
        self.stem = nn.Sequential(nn.Conv2d(image_shape[0], 64, 3, padding=1, bias=False), _batch_norm(64), nn.ReLU())
        stages: list[nn.Module] = []
        in_channels = 64
        for stage, width in enumerate((64, 128, 256, 512)):
            stride = 1 if stage == 0 else 2
            stages.append(nn.Sequential(BasicBlock(in_channels, width, stride), BasicBlock(width, width, 1)))
            in_channels = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x.reshape(x.shape[0], *self.image_shape))))


class CausalTransformer(nn.Module):
    """Small causal language model: (B, T) int64 tokens -> (B, T, vocab) next-token logits."""

    def __init__(
        self, vocab_size: int, max_len: int, d_model: int = 64, num_heads: int = 4, num_layers: int = 2
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        # Built one by one rather than with nn.TransformerEncoder, which deep-copies one layer so
        # that every layer starts with the same weights. No dropout: replicas given the same
        # weights and batch must compute the same gradient without consuming random numbers.
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model,
                num_heads,
                dim_feedforward=4 * d_model,
                dropout=0.0,
                batch_first=True,
                norm_first=True,
            )
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        # Untied from the token embedding so that every parameter is one tensor with one name on
        # the shards (a tied weight would appear twice in state_dict).
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        hidden = self.token_embedding(tokens) + self.position_embedding(positions)
        # Made per call rather than stored, because a stored mask would be a buffer.
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, src_mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def _image_shape(dataset: Dataset) -> tuple[int, int, int]:
    """(channels, height, width) for a conv net: flat square inputs such as digits become 1xSxS."""
    shape = tuple(dataset.input_shape)
    match shape:
        case (channels, height, width):
            return (channels, height, width)
        case (height, width):
            return (1, height, width)
        case (features,) if math.isqrt(features) ** 2 == features > 0:
            return (1, math.isqrt(features), math.isqrt(features))
    raise ValueError(f"dataset {dataset.name!r}: input_shape {shape} is not (C, H, W), (H, W) or a flat square image")


def _build_mlp(dataset: Dataset) -> nn.Module:
    return MLP(math.prod(dataset.input_shape), dataset.num_classes)


def _build_cnn(dataset: Dataset) -> nn.Module:
    return ConvNet(_image_shape(dataset), dataset.num_classes)


def _build_resnet18(dataset: Dataset) -> nn.Module:
    return ResNet18(_image_shape(dataset), dataset.num_classes)


def _build_transformer(dataset: Dataset) -> nn.Module:
    if len(dataset.input_shape) != 1:
        raise ValueError(f"model 'transformer' needs (T,) token sequences, got input_shape {dataset.input_shape}")
    return CausalTransformer(dataset.num_classes, dataset.input_shape[0])


_BUILDERS: dict[str, Callable[[Dataset], nn.Module]] = {
    "mlp": _build_mlp,
    "cnn": _build_cnn,
    "resnet18": _build_resnet18,
    "transformer": _build_transformer,
}


def model_names() -> list[str]:
    """Names `build_model` accepts besides a `"package.module:function"` import path."""
    return list(_BUILDERS)


def build_model(name: str, dataset: Dataset, allow_import: Collection[str] | None = None) -> nn.Module:
    """Build a built-in model by name, or a user model by `"package.module:function"`, for `dataset`.

    A user function is called with the Dataset and must return a `torch.nn.Module`. Set
    `torch.manual_seed` before calling to get the same initial weights in every process.
    `allow_import`: as `gradps.datasets.load_dataset`'s.
    """
    builder = _BUILDERS.get(name)
    if builder is not None:
        check_task(name, dataset.name, dataset.task)
        return builder(dataset)
    if ":" in name:
        check_import_allowed(name, allow_import)
        try:
            factory = resolve_import_path(name)
        except ValueError as err:
            raise ValueError(f"cannot build model {name!r}: {err}; built-in models: {', '.join(_BUILDERS)}") from err
        model = factory(dataset)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model function {name!r} returned {type(model).__name__}, expected a torch.nn.Module")
        return model
    raise ValueError(f"unknown model {name!r}: expected one of {', '.join(_BUILDERS)} or 'package.module:function'")
