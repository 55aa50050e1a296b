"""CODEC_RANDK: k indices drawn uniformly at random without replacement (sparse layout).

The values are sent as they are, not scaled by count / k: error feedback at the sender keeps what
was not sent and sends it later, so rescaling (which only makes one step unbiased) would just add
variance.
"""

from __future__ import annotations

import math

import torch

from gradps.codec_table import BY_NAME
from gradps.codecs.sparse import SparseCodec
from gradps.v1 import tensor_pb2


class RandKCodec(SparseCodec):
    """Keeps k uniformly random elements."""

    entry = BY_NAME["randk"]

    def __init__(self, ratio: float, generator: torch.Generator | None = None) -> None:
        """`generator` draws the indices (torch's default generator when None)."""
        super().__init__(ratio)
        self.generator = generator

    @classmethod
    def from_params(cls, params: tensor_pb2.CodecParams, generator: torch.Generator | None) -> RandKCodec:
        return cls(params.ratio, generator)

    def select(self, values: torch.Tensor, k: int) -> torch.Tensor:
        return sample_indices(values.numel(), k, self.generator)


def sample_indices(count: int, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A uniformly random k-subset of range(count), sorted, int64.

    A permutation costs O(count); for small k draw ~k indices with replacement instead. The
    distinct draws are a uniformly random subset (every subset of a given size is equally likely
    by symmetry), so a uniform k-subset of them is a uniform k-subset of range(count).
    """
    if 2 * k >= count:
        return torch.randperm(count, generator=generator)[:k].sort().values
    # Draws whose expected number of distinct values, count * (1 - exp(-m / count)), exceeds k
    # by a few standard deviations; doubled in the rare case it falls short.
    target = min(k + 4 * math.sqrt(k) + 16, 0.9 * count)
    draws = math.ceil(-count * math.log1p(-target / count))
    while True:
        distinct = torch.unique(torch.randint(count, (draws,), generator=generator))
        if distinct.numel() >= k:
            break
        draws *= 2
    keep = torch.randperm(distinct.numel(), generator=generator)[:k].sort().values
    return distinct[keep]
