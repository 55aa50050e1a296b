"""What each built-in dataset is and each built-in model is for, known without loading either:
a run's spec is checked against them when it is submitted (`gradps.run_spec`), in processes that
load no torch (the coordinator, the CLI)."""

from __future__ import annotations

TASKS = ("classification", "language_model")

# The built-in datasets and the task of each.
DATASET_TASKS = {
    "digits": "classification",
    "synthetic-images": "classification",
    "synthetic-tokens": "language_model",
    "synthetic-tokens-varlen": "language_model",
}
# Built-in datasets of a size of their own: a run's dataset_size does not apply to them.
FIXED_SIZE = ("digits",)
# The built-in models and the task of the datasets each is for.
MODEL_TASKS = {
    "mlp": "classification",
    "cnn": "classification",
    "resnet18": "classification",
    "transformer": "language_model",
}


def check_task(model: str, dataset: str, task: str) -> None:
    """ValueError unless the built-in `model` is for datasets of `task` (that of `dataset`)."""
    if MODEL_TASKS[model] != task:
        raise ValueError(f"model {model!r} needs a {MODEL_TASKS[model]} dataset, but {dataset!r} is {task}")
