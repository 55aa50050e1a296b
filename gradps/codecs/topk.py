"""CODEC_TOPK: the k = max(1, ceil(ratio * count)) values of largest magnitude (sparse layout)."""

from __future__ import annotations

import torch

from gradps.codecs.sparse import SparseCodec


class TopKCodec(SparseCodec):
    """Keeps the k largest |x| (ties broken arbitrarily); error feedback carries the rest."""

    name = "topk"

    def select(self, values: torch.Tensor, k: int) -> torch.Tensor:
        if k == values.numel():
            return torch.arange(k)
        return torch.topk(values.abs(), k, sorted=False).indices.sort().values
