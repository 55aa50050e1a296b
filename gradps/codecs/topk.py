"""CODEC_TOPK: the k = max(1, ceil(ratio * count)) values of largest magnitude (sparse layout)."""

from __future__ import annotations

import math

import torch

from gradps.codec_table import BY_NAME
from gradps.codecs.sparse import SparseCodec

# Magnitudes sampled to estimate the top-k threshold of a large part.
_SAMPLE = 1 << 16


class TopKCodec(SparseCodec):
    """Keeps the k largest |x| (ties broken arbitrarily); error feedback carries the rest."""

    entry = BY_NAME["topk"]

    def select(self, values: torch.Tensor, k: int) -> torch.Tensor:
        count = values.numel()
        if k == count:
            return torch.arange(count)
        magnitudes = values.abs()
        if count > 4 * _SAMPLE and 8 * k < count:
            # A full-length top-k on CPU is ~6x slower at 16M elements than: estimate from a random
            # sample a threshold that about 2k elements pass, then take the exact top-k of those.
            # When at least k pass, the k largest are all among them; otherwise fall through.
            sample_gen = torch.Generator().manual_seed(0)  # fixed: encoding stays reproducible
            sample = magnitudes[torch.randint(count, (_SAMPLE,), generator=sample_gen)]
            above = min(_SAMPLE, math.ceil(2 * k / count * _SAMPLE) + 8)
            threshold = torch.kthvalue(sample, _SAMPLE - above + 1).values
            candidates = torch.nonzero(magnitudes >= threshold).squeeze(1)
            if candidates.numel() >= k:
                picked = torch.topk(magnitudes[candidates], k, sorted=False).indices
                return candidates[picked].sort().values
        return torch.topk(magnitudes, k, sorted=False).indices.sort().values
