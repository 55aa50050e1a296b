"""Error feedback (Seide et al. 2014; Karimireddy et al. 2019) for lossy codecs at the sender.

Each part keeps a residual e: the sender encodes c = g + e and keeps e <- c - decode(encode(c)).
Whatever a lossy codec drops is sent in later rounds, so over many steps the sum of what was
transmitted plus the last residual equals the sum of the gradients.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from gradps.codecs.base import Codec, flat_float32


class ErrorFeedback:
    """One residual per part key (any hashable, e.g. (tensor name, part index)), kept on the CPU
    where encoding happens."""

    def __init__(self) -> None:
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def drain(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        """grad + residual[key] as float32, to be sent as it is (codec none): nothing is left to
        carry (the push before a checkpoint cut, gradps/cuts.py)."""
        return self._corrected(key, flat_float32(grad))

    def compress(self, key: Hashable, grad: torch.Tensor, codec: Codec) -> bytes:
        """Encode grad + residual[key] with `codec` and keep what it lost as the new residual.

        `grad` is the part's gradient (any shape, float dtype, any device); it is flattened and
        sent as float32. Lossless codecs just encode. When encoding fails (CodecError on NaN/Inf,
        ValueError when the part's size changed), the part's residual is dropped
        rather than left half-updated.
        """
        flat = flat_float32(grad)  # may alias grad: only read
        if not codec.entry.lossy:
            return codec.encode(flat)
        corrected = self._corrected(key, flat)
        # corrected - transmitted, left in place; sparse codecs touch only the k sent elements.
        payload = codec.encode_subtract(corrected)
        self._residuals[key] = corrected
        return payload

    def _corrected(self, key: Hashable, flat: torch.Tensor) -> torch.Tensor:
        """flat + residual[key] in a tensor of its own (the residual's buffer), the residual taken out."""
        residual = self._residuals.pop(key, None)
        if residual is None:
            return flat.clone()
        if residual.numel() != flat.numel():
            raise ValueError(
                f"error feedback for {key!r}: gradient has {flat.numel()} values, residual "
                f"{residual.numel()}; a key must name the same values at every push"
            )
        return residual.add_(flat)
