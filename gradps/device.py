"""Choosing the torch device a service computes on."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when present, else CPU; asking for CUDA without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible")
    return torch.device(name)
