"""Throughput of every codec on a gradient-like (normal) tensor: `python -m gradps.codecs.bench`;
with `--model` and `--dataset`, sizes and lz4's gain on real gradients of a short training run.

GB/s are float32 bytes per second (10**9), so codecs compare on the same input size.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import lz4.frame
import torch

from gradps.codec_table import codec_forms, parse_codec
from gradps.codecs.error_feedback import ErrorFeedback
from gradps.codecs.framing import maybe_lz4
from gradps.codecs.registry import get_codec

# Every registered codec form; sparse codecs keep 1%.
CODECS = tuple(form.replace("RATIO", "0.01") for form in codec_forms())


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


def capture_gradients(
    model: str, dataset: str, steps: int = 200, every: int = 20, batch_size: int = 32, lr: float = 0.1, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Per-tensor gradients of `model` on `dataset` (gradps.models / gradps.datasets names), taken
    every `every` steps of `steps` of plain SGD on one worker's batches: real gradients, whose
    zeros (dead inputs, unused embedding rows, ReLU) decide what lz4 gains."""
    from gradps.datasets import load_dataset  # the training stack, only for this benchmark
    from gradps.evaluation import compute_loss
    from gradps.models import build_model

    torch.manual_seed(seed)
    data = load_dataset(dataset, seed=seed)
    net = build_model(model, data)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    order = torch.randperm(data.train_x.shape[0], generator=torch.Generator().manual_seed(seed))
    captured = []
    for step in range(steps):
        start = step * batch_size % max(1, order.numel() - batch_size)
        batch = order[start : start + batch_size]
        optimizer.zero_grad()
        compute_loss(net, data.train_x[batch], data.train_y[batch], data.task).backward()
        if step % every == 0:
            captured.append({name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None})
        optimizer.step()
    return captured


def bench_real_gradients(
    gradients: list[dict[str, torch.Tensor]], codecs: tuple[str, ...] = CODECS, lz4_threshold: float = 0.9
) -> list[dict]:
    """Bytes each codec sends for captured gradients, one part per tensor (a model's tensors are
    below the default 4 MiB part size), pushed in order with error feedback as a worker does.

    Returns one dict per codec: codec, ratio (payload / fp32 bytes, before lz4), sent_ratio (bytes
    sent / fp32 bytes, after maybe_lz4), lz4_gain (payload / bytes sent) and framed (the fraction
    of parts that maybe_lz4 framed).
    """
    rows = []
    for text in codecs:
        codec = get_codec(parse_codec(text), generator=torch.Generator().manual_seed(1))
        feedback = ErrorFeedback()
        fp32 = payload_bytes = sent = framed = parts = 0
        for step in gradients:
            for name, grad in step.items():
                payload = feedback.compress(name, grad, codec)
                wire, used = maybe_lz4(payload, lz4_threshold)
                fp32, payload_bytes, sent = fp32 + 4 * grad.numel(), payload_bytes + len(payload), sent + len(wire)
                framed, parts = framed + used, parts + 1
        rows.append(
            {
                "codec": text,
                "ratio": payload_bytes / fp32,
                "sent_ratio": sent / fp32,
                "lz4_gain": payload_bytes / sent,
                "framed": framed / parts,
            }
        )
    return rows


def format_real_table(rows: list[dict]) -> str:
    """`bench_real_gradients` rows as a fixed-width text table."""
    lines = [f"{'codec':<16}{'ratio':>8}{'sent ratio':>12}{'fp32/sent':>11}{'lz4 gain':>10}{'framed':>8}"]
    for r in rows:
        lines.append(
            f"{r['codec']:<16}{r['ratio']:>8.4f}{r['sent_ratio']:>12.4f}{1 / r['sent_ratio']:>11.2f}"
            f"{r['lz4_gain']:>10.2f}{r['framed']:>8.0%}"
        )
    return "\n".join(lines)


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
    parser.add_argument("--model", help="real gradients of this model (gradps.models), with --dataset")
    parser.add_argument("--dataset", default="digits", help="dataset for --model (default digits)")
    parser.add_argument("--steps", type=int, default=200, help="--model: training steps (default 200)")
    parser.add_argument("--every", type=int, default=20, help="--model: capture every N steps (default 20)")
    parser.add_argument("--lz4-threshold", type=float, default=0.9, help="maybe_lz4 threshold (default 0.9)")
    args = parser.parse_args()
    if args.model:
        gradients = capture_gradients(args.model, args.dataset, args.steps, args.every)
        count = sum(g.numel() for g in gradients[0].values())
        print(
            f"{args.model} on {args.dataset}: {len(gradients)} gradients of {count:,} values "
            f"({len(gradients[0])} parts), every {args.every} of {args.steps} SGD steps, with error feedback"
        )
        print(format_real_table(bench_real_gradients(gradients, tuple(args.codecs.split(",")), args.lz4_threshold)))
        return
    rows = bench_codecs(args.size_mib, args.repeats, tuple(args.codecs.split(",")), args.zero_fraction)
    print(
        f"{args.size_mib} MiB float32, N(0, 1) with {args.zero_fraction:.0%} zeros, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
