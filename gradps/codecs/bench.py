"""Throughput of every codec on a gradient-like (normal) tensor: `python -m gradps.codecs.bench`.

GB/s are float32 bytes per second (10**9), so codecs compare on the same input size.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import lz4.frame
import torch

from gradps.codecs.framing import maybe_lz4
from gradps.codecs.registry import get_codec, parse_codec

CODECS = ("none", "fp16", "bf16", "int8", "int8:stochastic", "topk:0.01", "randk:0.01", "sign")


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-call allocations and lazy init
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_codecs(
    size_mib: int = 64, repeats: int = 3, codecs: tuple[str, ...] = CODECS, zero_fraction: float = 0.0
) -> list[dict]:
    """Encode/decode GB/s, payload ratio and lz4 gain for each codec on N(0, 1) float32 values,
    of which `zero_fraction` are set to 0 (as in an embedding's gradient, where lz4 pays).

    Returns one dict per codec: codec, ratio (payload / fp32 bytes), encode_gbs, decode_gbs,
    roundtrip_gbs (encode then decode), lz4_gain (payload / lz4 frame size), lz4_used (whether
    maybe_lz4 at its default threshold frames it). Times are the best of `repeats`; decoding is
    to the CPU.
    """
    count = size_mib * (1 << 20) // 4
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(count, generator=generator)
    if zero_fraction:
        values[torch.rand(count, generator=generator) < zero_fraction] = 0.0
    fp32_bytes = 4 * count
    rows = []
    for text in codecs:
        codec = get_codec(parse_codec(text), generator=torch.Generator().manual_seed(1))
        payload = codec.encode(values)
        encode_s = _best_seconds(lambda: codec.encode(values), repeats)  # noqa: B023 (called at once)
        decode_s = _best_seconds(lambda: codec.decode(payload, count, "cpu"), repeats)  # noqa: B023
        _, used = maybe_lz4(payload)
        framed_size = len(lz4.frame.compress(payload, content_checksum=True))  # as maybe_lz4 frames
        rows.append(
            {
                "codec": text,
                "ratio": len(payload) / fp32_bytes,
                "encode_gbs": fp32_bytes / encode_s / 1e9,
                "decode_gbs": fp32_bytes / decode_s / 1e9,
                "roundtrip_gbs": fp32_bytes / (encode_s + decode_s) / 1e9,
                "lz4_gain": len(payload) / framed_size,
                "lz4_used": used,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table."""
    lines = [f"{'codec':<16}{'ratio':>8}{'enc GB/s':>10}{'dec GB/s':>10}{'enc+dec GB/s':>14}{'lz4 gain':>10}{'lz4':>5}"]
    for r in rows:
        lines.append(
            f"{r['codec']:<16}{r['ratio']:>8.4f}{r['encode_gbs']:>10.2f}{r['decode_gbs']:>10.2f}"
            f"{r['roundtrip_gbs']:>14.2f}{r['lz4_gain']:>10.2f}{'yes' if r['lz4_used'] else 'no':>5}"
        )
    return "\n".join(lines)


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=64, help="float32 MiB per part (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per codec; the best is kept")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec strings")
    parser.add_argument("--zero-fraction", type=float, default=0.0, help="fraction of values set to 0")
    args = parser.parse_args()
    rows = bench_codecs(args.size_mib, args.repeats, tuple(args.codecs.split(",")), args.zero_fraction)
    print(
        f"{args.size_mib} MiB float32, N(0, 1) with {args.zero_fraction:.0%} zeros, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
