"""Training loss and test-set evaluation, the same for every scheme and every worker."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gradps.datasets import PAD_TARGET, Dataset
from gradps.tasks import TASKS


def _classification_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits, targets, reduction=reduction)


def _language_model_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    # Every token position is one classification: (B, T, V) against (B, T); padding is left out.
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction, ignore_index=PAD_TARGET
    )


_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "classification": _classification_loss,
    "language_model": _language_model_loss,
}


def loss_fn(task: str) -> Callable[..., torch.Tensor]:
    """Cross-entropy for `task`, called as `loss(logits, targets, reduction="mean")`.

    For a language model the mean is over the batch's real tokens: targets equal to PAD_TARGET are
    left out.
    """
    loss = _LOSSES.get(task)
    if loss is None:
        raise ValueError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")
    return loss


def trim_padding(x: torch.Tensor, y: torch.Tensor, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A language model's batch cut to its longest sequence: the columns after the last real target
    (not PAD_TARGET) go, so the model's compute follows the batch's lengths rather than the padded
    width. Any other batch, or one with no padded column, is returned as it is (the same tensors)."""
    if task != "language_model" or y.ndim != 2:
        return x, y
    real = (y != PAD_TARGET).any(dim=0)
    # The running count of real columns peaks first at the last one.
    length = int(real.cumsum(0).argmax()) + 1
    if length == y.shape[1]:
        return x, y
    return x[:, :length], y[:, :length]


def compute_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    """Mean cross-entropy of `model` on one batch; differentiable, in whatever mode the model is in.

    A language model's batch is first cut to its longest sequence (`trim_padding`)."""
    x, y = trim_padding(x, y, task)
    return loss_fn(task)(model(x), y)


def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 512) -> tuple[float, float]:
    """(mean test loss, test accuracy) of `model` on `dataset`'s test split.

    Accuracy is per sample for classification and per real (not padded) token for a language
    model, whose batches are cut to their longest sequence (`trim_padding`). Runs in eval mode
    without gradients on the model's device, and restores the model's previous mode afterwards.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    loss = loss_fn(dataset.task)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    total_loss = 0.0
    correct = 0
    count = 0
    try:
        with torch.no_grad():
            for start in range(0, dataset.test_x.shape[0], batch_size):
                x = dataset.test_x[start : start + batch_size].to(device)
                y = dataset.test_y[start : start + batch_size].to(device)
                x, y = trim_padding(x, y, dataset.task)
                logits = model(x)
                real = y != PAD_TARGET
                # Sums, not means, so that a short last batch is weighted by its size.
                total_loss += float(loss(logits, y, reduction="sum"))
                correct += int(((logits.argmax(dim=-1) == y) & real).sum())
                count += int(real.sum())
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError(f"dataset {dataset.name!r} has an empty test split")
    return total_loss / count, correct / count
