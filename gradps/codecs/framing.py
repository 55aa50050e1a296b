"""Optional lz4 frame around a part's payload, used only where it measurably shrinks it."""

from __future__ import annotations

import lz4.frame

from gradps.codecs.base import Buffer, CodecError

# Payloads of at least 4x the probe (256 KiB) are probed before being compressed whole.
_PROBE_BLOCKS = 4
_PROBE_BLOCK = 16 << 10


def maybe_lz4(payload: bytes, threshold: float = 0.9) -> tuple[bytes, bool]:
    """(lz4 frame, True) when the frame is at most `threshold` times the payload's size, else
    (payload, False). Decided per part from the measured size: dense float noise does not
    compress, quantized and sparse payloads often do. A payload of 256 KiB or more is probed on
    four 16 KiB blocks first and sent as it is when they do not compress."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"lz4 threshold must be in (0, 1], got {threshold}")
    if not payload:
        return payload, False
    if len(payload) >= 4 * _PROBE_BLOCKS * _PROBE_BLOCK and not _probe_shrinks(payload, threshold):
        return payload, False
    # The content checksum lets unwrap reject a corrupted frame instead of decoding garbage.
    framed = lz4.frame.compress(payload, content_checksum=True)
    if len(framed) <= threshold * len(payload):
        return framed, True
    return payload, False


def _probe_shrinks(payload: bytes, threshold: float) -> bool:
    """Whether evenly spaced sample blocks of a large payload compress to `threshold` or better.

    lz4 runs at ~1 GB/s on incompressible data, slower than most codecs encode; probing 64 KiB
    first rejects dense float noise for a small part of that cost (1/64 for a 4 MiB payload). A
    payload that passes is still compressed whole and measured.
    """
    view = memoryview(payload)
    step = len(view) // _PROBE_BLOCKS
    blocks = [view[i * step : i * step + _PROBE_BLOCK] for i in range(_PROBE_BLOCKS)]
    compressed = sum(len(lz4.frame.compress(block)) for block in blocks)
    return compressed <= threshold * _PROBE_BLOCKS * _PROBE_BLOCK


def unwrap(payload: Buffer, is_lz4: bool, max_size: int) -> Buffer:
    """The codec bytes of a part: `payload` itself, or its lz4 frame decompressed.

    Raises CodecError on a corrupt or truncated frame, trailing bytes after it, or more than
    `max_size` bytes of content (a decompression bomb is cut off at max_size + 1 bytes).
    """
    if not is_lz4:
        if len(payload) > max_size:
            raise CodecError(f"payload is {len(payload)} bytes, more than the {max_size} expected")
        return payload
    decompressor = lz4.frame.LZ4FrameDecompressor()
    try:
        content = decompressor.decompress(payload, max_length=max_size + 1)
    except RuntimeError as exc:  # lz4 reports every malformed frame as RuntimeError
        raise CodecError(f"corrupt lz4 frame: {exc}") from None
    if len(content) > max_size:
        raise CodecError(f"lz4 frame decompresses beyond the {max_size} bytes expected")
    if not decompressor.eof:
        raise CodecError("truncated lz4 frame")
    if decompressor.unused_data:
        raise CodecError(f"{len(decompressor.unused_data)} bytes after the lz4 frame")
    return content
