"""Codec registry, wire layouts, error feedback and lz4 framing (gradps.codecs)."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import lz4.frame
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradps.codec_table import format_codec, parse_codec, ratio_text
from gradps.codecs import (
    Codec,
    CodecError,
    ErrorFeedback,
    SparseCodec,
    SparsePart,
    decode_part,
    decode_summand,
    encode_part,
    get_codec,
    maybe_lz4,
    unwrap,
)
from gradps.codecs.randk import sample_indices
from gradps.codecs.sparse import keep_count
from gradps.v1 import tensor_pb2

CPU = torch.device("cpu")
LOSSY = ("fp16", "bf16", "int8", "int8:stochastic", "topk:0.1", "randk:0.1", "sign")
ALL = ("none", *LOSSY)
NO_DEADLINE = settings(deadline=None)  # the machine is shared: wall-clock deadlines would flake


def codec_for(text: str, seed: int = 0) -> Codec:
    return get_codec(parse_codec(text), generator=torch.Generator().manual_seed(seed))


def sparse_codec_for(text: str, seed: int = 0) -> SparseCodec:
    codec = codec_for(text, seed)
    assert isinstance(codec, SparseCodec)
    return codec


def flush(feedback: ErrorFeedback, key: object, count: int) -> torch.Tensor:
    """The residual kept under `key` (zeros when none), read the way a sender would send it: a zero
    gradient through topk at ratio 1 transmits exactly the residual."""
    exact = codec_for("topk:1")
    return exact.decode(feedback.compress(key, torch.zeros(count), exact), count, CPU)


def float32_arrays(max_size: int = 300, max_abs: float | None = None, min_size: int = 0) -> st.SearchStrategy:
    """1-D float32 arrays of finite values (subnormals and -0.0 included)."""
    elements = st.floats(
        width=32,
        allow_nan=False,
        allow_infinity=False,
        min_value=None if max_abs is None else -max_abs,
        max_value=max_abs,
    )
    return hnp.arrays(np.float32, st.integers(min_size, max_size), elements=elements)


# --- lossless and half precision ----------------------------------------------------------------


@NO_DEADLINE
@given(float32_arrays())
def test_none_round_trips_bit_exactly(array: np.ndarray) -> None:
    values = torch.from_numpy(array)
    codec = codec_for("none")
    payload = codec.encode(values)
    assert payload == array.astype("<f4").tobytes()  # the proto's layout: raw little-endian float32
    decoded = codec.decode(payload, values.numel(), CPU)
    assert torch.equal(decoded.view(torch.int32), values.view(torch.int32))


@pytest.mark.parametrize(
    ("text", "rel", "tiny"),
    [
        ("fp16", 2.0**-11, 2.0**-25),  # half an ulp; absolute below fp16's subnormal step
        ("bf16", 2.0**-8, 2.0**-134),
    ],
)
@NO_DEADLINE
@given(array=float32_arrays(max_abs=60000.0))
def test_half_precision_within_relative_precision(text: str, rel: float, tiny: float, array: np.ndarray) -> None:
    values = torch.from_numpy(array)
    codec = codec_for(text)
    payload = codec.encode(values)
    assert len(payload) == 2 * values.numel()
    decoded = codec.decode(payload, values.numel(), CPU).double()
    error = (decoded - values.double()).abs()
    assert bool((error <= rel * values.double().abs() + tiny).all())


def test_bf16_payload_is_upper_half_of_float32() -> None:
    values = torch.tensor([1.0, -2.5, 0.15625, 2.0**127])  # exact in bf16
    payload = codec_for("bf16").encode(values)
    upper = np.frombuffer(values.numpy().tobytes(), "<u4") >> 16
    assert payload == upper.astype("<u2").tobytes()


def test_fp16_overflow_is_rejected_at_the_sender() -> None:
    with pytest.raises(CodecError, match="exceeds 65504"):
        codec_for("fp16").encode(torch.tensor([1.0, 70000.0]))


# --- int8 -----------------------------------------------------------------------------------------


@NO_DEADLINE
@given(float32_arrays(max_abs=2.0**99))
def test_int8_error_at_most_half_scale(array: np.ndarray) -> None:
    values = torch.from_numpy(array)
    payload = codec_for("int8").encode(values)
    assert len(payload) == 4 + values.numel()
    (scale,) = struct.unpack_from("<f", payload)
    q = np.frombuffer(payload, np.int8, offset=4)
    assert np.all(np.abs(q.astype(np.int32)) <= 127)
    decoded = codec_for("int8").decode(payload, values.numel(), CPU).double()
    error = (decoded - values.double()).abs()
    if scale > 0:
        assert scale == pytest.approx(float(values.abs().max()) / 127, rel=1e-6)
        # s / 2 from rounding, plus float32 rounding of x / s and q * s.
        assert bool((error <= scale * (0.5 + 1e-5)).all())
    else:  # all zero, or too small for a normal float32 scale: sent as zeros
        assert bool((values.abs() < 127 * torch.finfo(torch.float32).tiny).all())
        assert bool((decoded == 0).all())


def test_int8_all_zeros_has_scale_zero() -> None:
    payload = codec_for("int8").encode(torch.zeros(5))
    assert payload == struct.pack("<f", 0.0) + bytes(5)


def test_int8_stochastic_rounding_is_unbiased() -> None:
    values = torch.linspace(-1.0, 1.0, 401)  # scale 1/127: most values fall between two levels
    codec = codec_for("int8:stochastic", seed=1)
    scale = 1.0 / 127
    rounds = 400
    total = torch.zeros_like(values, dtype=torch.float64)
    for _ in range(rounds):
        total += codec.decode(codec.encode(values), values.numel(), CPU)
    bias = total / rounds - values.double()
    # Each rounding has standard deviation <= s / 2, so a mean of 400 has <= s / 40.
    assert float(bias.abs().max()) < 6 * scale / 40
    assert abs(float(bias.mean())) < 6 * scale / 40 / math.sqrt(values.numel())
    # Nearest rounding would be biased on the same values, by up to s / 2.
    nearest = codec_for("int8").decode(codec_for("int8").encode(values), values.numel(), CPU)
    assert float((nearest - values).abs().max()) > 0.4 * scale


# --- sparse -------------------------------------------------------------------------------------


@settings(NO_DEADLINE, max_examples=60)
@given(float32_arrays(min_size=1), st.floats(2.0**-10, 1.0, width=32))
def test_topk_keeps_exactly_the_k_largest_magnitudes(array: np.ndarray, ratio: float) -> None:
    values = torch.from_numpy(array)
    codec = get_codec(tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_TOPK, ratio=ratio))
    payload = codec.encode(values)
    k = len(payload) // 8
    assert len(payload) == 8 * k and k == keep_count(ratio, values.numel())
    assert ratio * values.numel() - 1e-3 <= k < max(1, ratio * values.numel() + 1 + 1e-3)  # max(1, ceil(.))
    indices = np.frombuffer(payload, "<u4", count=k).astype(np.int64)
    sent = np.frombuffer(payload, "<f4", offset=4 * k)
    assert np.all(np.diff(indices) > 0)
    assert np.array_equal(sent.view(np.uint32), array[indices].view(np.uint32))
    dropped = np.delete(np.abs(array), indices)
    if dropped.size:
        assert np.abs(sent).min() >= dropped.max()
    decoded = codec.decode(payload, values.numel(), CPU)
    assert torch.equal(decoded[torch.from_numpy(indices)], torch.from_numpy(sent.copy()))
    assert int((decoded != 0).sum()) <= k


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(300_000, generator=g),  # large part: sampled threshold
        lambda g: torch.randn(300_000, generator=g) * (torch.rand(300_000, generator=g) < 0.002),  # fallback
        lambda g: torch.randint(-3, 4, (300_000,), generator=g).float(),  # heavy ties
    ],
)
def test_topk_of_a_large_part_matches_a_full_sort(make: Callable[[torch.Generator], torch.Tensor]) -> None:
    values = make(torch.Generator().manual_seed(2))
    codec = sparse_codec_for("topk:0.01")
    indices, sent = codec.decode_sparse(codec.encode(values), values.numel(), CPU)
    assert indices.numel() == 3000 and bool((indices[1:] > indices[:-1]).all())
    assert torch.equal(sent, values[indices])
    largest = values.abs().sort(descending=True).values[:3000]
    assert torch.equal(sent.abs().sort(descending=True).values, largest)


@given(st.floats(2.0**-149, 1.0, width=32))
def test_a_ratio_is_written_as_the_shortest_decimal_of_its_float32(ratio: float) -> None:
    text = ratio_text(ratio)
    assert np.float32(text) == np.float32(ratio)
    # As few significant digits as numpy's shortest form of the float32 (Dragon4).
    shortest = np.format_float_scientific(np.float32(ratio), unique=True)
    assert _significant_digits(text) == _significant_digits(shortest), (text, shortest)


def _significant_digits(text: str) -> int:
    return len(text.lower().split("e")[0].replace(".", "").strip("0"))


@pytest.mark.parametrize(("ratio", "count", "k"), [(0.1, 100, 10), (0.01, 1000, 10), (0.3, 10, 3), (1e-6, 50, 1)])
def test_keep_count_reads_the_ratio_as_written(ratio: float, count: int, k: int) -> None:
    # 0.1 is 0.100000001 as float32; ceil(0.100000001 * 100) would be 11.
    assert keep_count(float(np.float32(ratio)), count) == k


def test_randk_sends_raw_values_at_distinct_sorted_random_indices() -> None:
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    codec = sparse_codec_for("randk:0.05", seed=4)
    payload = codec.encode(values)
    indices, sent = codec.decode_sparse(payload, values.numel(), CPU)
    assert indices.numel() == 500
    assert bool((indices[1:] > indices[:-1]).all())
    assert torch.equal(sent, values[indices])  # not rescaled by count / k
    assert codec_for("randk:0.05", seed=4).encode(values) == payload  # seeded: reproducible


@pytest.mark.parametrize(("count", "k"), [(20, 3), (20, 15), (1000, 10)])
def test_sample_indices_is_uniform(count: int, k: int) -> None:
    generator = torch.Generator().manual_seed(5)
    hits = torch.zeros(count)
    trials = 3000
    for _ in range(trials):
        chosen = sample_indices(count, k, generator)
        assert chosen.numel() == k and bool((chosen[1:] > chosen[:-1]).all())
        hits[chosen] += 1
    expected = trials * k / count
    sd = math.sqrt(expected * (1 - k / count))
    assert float((hits - expected).abs().max()) < 5 * sd


# --- every codec ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ALL)
@settings(NO_DEADLINE, max_examples=25)
@given(array=float32_arrays(max_abs=1e4))
def test_decoded_has_count_float32_values_and_payload_bytes(text: str, array: np.ndarray) -> None:
    codec = codec_for(text)
    payload = codec.encode(torch.from_numpy(array))
    assert len(payload) == codec.payload_bytes(array.size) <= codec.max_payload_bytes(array.size)
    decoded = codec.decode(payload, array.size, CPU)
    assert decoded.dtype == torch.float32 and decoded.shape == (array.size,)
    out = torch.ones(array.size)
    codec.add_decoded(payload, out, alpha=2.0)
    assert torch.allclose(out, 1 + 2 * decoded)


@pytest.mark.parametrize("text", ALL)
def test_decoded_tensor_does_not_alias_the_payload(text: str) -> None:
    payload = bytearray(codec_for(text).encode(torch.arange(1.0, 9.0)))
    decoded = codec_for(text).decode(payload, 8, CPU)
    before = bytes(payload)
    decoded.add_(1.0)
    assert bytes(payload) == before


@pytest.mark.parametrize("text", ALL)
def test_encode_rejects_nan_and_inf(text: str) -> None:
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(CodecError, match="NaN or Inf"):
            codec_for(text).encode(torch.tensor([1.0, bad, 2.0]))


def test_encode_rejects_wrong_tensors() -> None:
    codec = codec_for("int8")
    with pytest.raises(TypeError):
        codec.encode(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError):
        codec.encode(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="contiguous"):
        codec.encode(torch.zeros(8)[::2])


@pytest.mark.parametrize("text", LOSSY)
def test_error_feedback_conserves_the_gradient_sum(text: str) -> None:
    generator = torch.Generator().manual_seed(7)
    codec = codec_for(text, seed=8)
    feedback = ErrorFeedback()
    grads = torch.zeros(257, dtype=torch.float64)
    sent = torch.zeros(257, dtype=torch.float64)
    for _ in range(60):
        grad = torch.randn(257, generator=generator) * 3
        grads += grad
        payload = feedback.compress(("w", 0), grad, codec)
        sent += codec.decode(payload, 257, CPU)
    residual = flush(feedback, ("w", 0), 257)
    assert residual.abs().sum() > 0
    assert torch.allclose(sent + residual, grads, atol=1e-3)
    # The residual stays bounded: what is dropped is sent later, not accumulated forever.
    assert float(residual.abs().max()) < float(grads.abs().max()) + 60 * 3


def _fused_matches_plain(values: torch.Tensor, text: str) -> None:
    fused, plain = values.clone(), values.clone()
    codec = codec_for(text, seed=3)
    try:
        plain_payload = codec.encode(plain)
    except CodecError:
        with pytest.raises(CodecError):
            codec_for(text, seed=3).encode_subtract(fused)
        return
    codec.add_decoded(plain_payload, plain, alpha=-1.0)
    assert codec_for(text, seed=3).encode_subtract(fused) == plain_payload
    assert torch.equal(fused, plain)


@NO_DEADLINE
@given(array=float32_arrays(max_size=3000), stochastic=st.booleans())
def test_int8_encode_subtract_is_encode_then_subtract_the_decoded(array: np.ndarray, stochastic: bool) -> None:
    """The fused pass gives the payload and the residual bit for bit that encode and
    add_decoded(alpha=-1) give."""
    _fused_matches_plain(torch.from_numpy(array), "int8:stochastic" if stochastic else "int8")


@pytest.mark.parametrize("text", ["int8", "int8:stochastic"])
def test_int8_encode_subtract_across_chunks(text: str) -> None:
    """Parts longer than the 1 << 18 values the fused pass handles at a time."""
    generator = torch.Generator().manual_seed(5)
    _fused_matches_plain(torch.randn((1 << 19) + 3, generator=generator) * 1e-3, text)


def test_error_feedback_keys_are_independent() -> None:
    codec = codec_for("topk:0.5")
    feedback = ErrorFeedback()
    feedback.compress("a", torch.tensor([4.0, 1.0]), codec)
    # "b" carries nothing of "a"; the second push of "a" carries its residual: 1 + 1 = 2 beats 0.5.
    assert codec.decode(feedback.compress("b", torch.tensor([0.5, 1.0]), codec), 2, CPU).tolist() == [0.0, 1.0]
    assert codec.decode(feedback.compress("a", torch.tensor([0.5, 1.0]), codec), 2, CPU).tolist() == [0.0, 2.0]
    assert flush(feedback, "a", 2).tolist() == [0.5, 0.0]
    with pytest.raises(ValueError, match="same values"):
        feedback.compress("a", torch.ones(3), codec)


def test_error_feedback_leaves_the_gradient_alone_and_skips_lossless() -> None:
    grad = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    feedback = ErrorFeedback()
    feedback.compress("w", grad, codec_for("sign"))
    feedback.compress("w", grad, codec_for("sign"))
    assert torch.equal(grad, torch.tensor([[1.0, -2.0], [3.0, 0.5]]))
    payload = feedback.compress("b", grad, codec_for("none"))
    assert payload == grad.numpy().tobytes()
    assert not flush(feedback, "b", 4).any()


# --- malformed payloads ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ALL)
def test_wrong_length_is_rejected(text: str) -> None:
    codec = codec_for(text)
    payload = codec.encode(torch.randn(64, generator=torch.Generator().manual_seed(12)))
    bad_payloads = [payload[:-1], payload + b"\0" * 4, payload[:3], payload + bytes(8 * 64)]
    if not isinstance(codec, SparseCodec):  # k = 0 is a well-formed (empty) sparse payload
        bad_payloads.append(b"")
    for bad in bad_payloads:
        with pytest.raises(CodecError, match="payload is"):
            codec.decode(bad, 64, CPU)


@pytest.mark.parametrize("text", ["int8", "sign"])
@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, 1e38])
def test_bad_scale_is_rejected(text: str, scale: float) -> None:
    payload = bytearray(codec_for(text).encode(torch.randn(16)))
    payload[:4] = struct.pack("<f", scale)
    if text == "sign" and math.isfinite(scale):  # +-1e38 is a valid sign scale
        assert codec_for(text).decode(payload, 16, CPU).abs().max() == pytest.approx(1e38)
        return
    with pytest.raises(CodecError, match="scale"):
        codec_for(text).decode(payload, 16, CPU)


@pytest.mark.parametrize("text", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_inf_values_are_rejected(text: str, bad: float) -> None:
    dtype = {"none": "<f4", "fp16": "<f2", "bf16": "<f4"}[text]
    raw = np.array([1.0, bad, 2.0], dtype=dtype).tobytes()
    if text == "bf16":  # keep the upper halves
        raw = (np.frombuffer(raw, "<u4") >> 16).astype("<u2").tobytes()
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec_for(text).decode(raw, 3, CPU)


def sparse_payload(indices: list[int], values: list[float]) -> bytes:
    return np.array(indices, "<u4").tobytes() + np.array(values, "<f4").tobytes()


@pytest.mark.parametrize("text", ["topk:0.5", "randk:0.5"])
@pytest.mark.parametrize(
    ("indices", "values", "match"),
    [
        ([1, 10], [1.0, 2.0], "out of range"),
        ([2, 2], [1.0, 2.0], "strictly increasing"),
        ([5, 2], [1.0, 2.0], "strictly increasing"),
        ([0, 2**32 - 1], [1.0, 2.0], "out of range"),
        ([1, 2], [1.0, math.nan], "NaN or Inf"),
        ([1, 2], [math.inf, 1.0], "NaN or Inf"),
        (list(range(11)), [1.0] * 11, "k <= 10"),
    ],
)
def test_bad_sparse_payload_is_rejected(text: str, indices: list[int], values: list[float], match: str) -> None:
    codec = codec_for(text)
    assert isinstance(codec, SparseCodec)
    payload = sparse_payload(indices, values)
    with pytest.raises(CodecError, match=match):
        codec.decode_sparse(payload, 10, CPU)
    with pytest.raises(CodecError, match=match):
        codec.decode(payload, 10, CPU)
    out = torch.zeros(10)
    with pytest.raises(CodecError, match=match):
        codec.add_decoded(payload, out)
    assert bool((out == 0).all())  # nothing applied


def test_sparse_decode_from_a_memoryview_slice() -> None:
    codec = sparse_codec_for("topk:0.5")
    framed = b"xx" + sparse_payload([0, 3], [1.5, -2.0]) + b"yy"
    indices, values = codec.decode_sparse(memoryview(framed)[2:-2], 4, CPU)
    assert indices.dtype == torch.int64 and indices.tolist() == [0, 3]
    assert values.tolist() == [1.5, -2.0]
    assert codec.decode(memoryview(framed)[2:-2], 4, CPU).tolist() == [1.5, 0.0, 0.0, -2.0]


def test_sign_layout_is_lsb_first_with_mean_abs_scale() -> None:
    values = torch.tensor([1.0, -2.0, 3.0, 0.0, -1.0, 5.0, 1.0, 1.0, -3.0])
    payload = codec_for("sign").encode(values)
    assert payload[:4] == struct.pack("<f", 17.0 / 9)
    assert payload[4:] == bytes([0b11100101, 0b0])  # bit 1 for x > 0; 0 (and zeros) -> -s
    decoded = codec_for("sign").decode(payload, 9, CPU)
    assert torch.allclose(decoded, torch.where(values > 0, 17.0 / 9, -17.0 / 9))


def test_empty_parts() -> None:
    for text in ALL:
        codec = codec_for(text)
        payload = codec.encode(torch.zeros(0))
        assert codec.decode(payload, 0, CPU).shape == (0,)
        assert len(payload) == codec.payload_bytes(0)


# --- lz4 framing ----------------------------------------------------------------------------------


def test_lz4_wraps_quantized_sparse_gradients_but_not_float_noise() -> None:
    generator = torch.Generator().manual_seed(9)
    for count in (1 << 12, 1 << 17):  # small payloads are compressed whole, large ones probed first
        noise = torch.randn(count, generator=generator)
        assert not encode_part(noise, parse_codec("none"))[1]
        # A gradient where most rows saw no data (an embedding): the payloads are mostly zeros.
        sparse_grad = noise * (torch.rand(count, generator=generator) < 0.05)
        for text in ("int8", "none"):
            params = parse_codec(text)
            payload, framed = encode_part(sparse_grad, params)
            assert framed and len(payload) < 0.5 * get_codec(params).payload_bytes(count)
            decoded = decode_part(payload, framed, params, count, CPU)
            assert torch.allclose(decoded, sparse_grad, atol=float(sparse_grad.abs().max()) / 254 + 1e-7)


def test_lz4_threshold_and_passthrough() -> None:
    assert maybe_lz4(b"") == (b"", False)
    assert maybe_lz4(b"\0" * 1000)[1]
    assert not maybe_lz4(b"\0" * 1000, threshold=0.001)[1]
    assert unwrap(b"abc", False, 3) == b"abc"
    with pytest.raises(CodecError, match="more than"):
        unwrap(b"abcd", False, 3)
    with pytest.raises(ValueError):
        maybe_lz4(b"abc", threshold=0.0)


def test_unwrap_rejects_corrupt_truncated_and_oversized_frames() -> None:
    content = np.tile(np.arange(200, dtype=np.uint8), 100).tobytes()
    frame, framed = maybe_lz4(content)
    assert framed and unwrap(frame, True, len(content)) == content
    corrupt = bytearray(frame)
    corrupt[len(frame) // 2] ^= 0xFF
    bad_frames = [bytes(corrupt), frame[:-6], frame[: len(frame) // 2], b"not an lz4 frame", frame + b"\0"]
    for bad in bad_frames:
        with pytest.raises(CodecError):
            unwrap(bad, True, len(content))
    bomb = lz4.frame.compress(bytes(64 << 20))  # 64 MiB of zeros in ~250 KiB
    with pytest.raises(CodecError, match="beyond"):
        unwrap(bomb, True, 1 << 20)


# --- registry -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["none", "fp16", "bf16", "int8", "int8:stochastic", "topk:0.01", "randk:0.05", "sign", "topk:1.0"]
)
def test_parse_format_round_trip(text: str) -> None:
    params = parse_codec(text)
    assert format_codec(params) == text
    assert parse_codec(format_codec(params)) == params


@NO_DEADLINE
@given(
    st.one_of(
        st.builds(
            tensor_pb2.CodecParams,
            codec=st.sampled_from([tensor_pb2.CODEC_TOPK, tensor_pb2.CODEC_RANDK]),
            ratio=st.floats(2.0**-23, 1.0, width=32),
        ),
        st.builds(tensor_pb2.CodecParams, codec=st.just(tensor_pb2.CODEC_INT8), stochastic_rounding=st.booleans()),
        st.builds(
            tensor_pb2.CodecParams,
            codec=st.sampled_from(
                [tensor_pb2.CODEC_NONE, tensor_pb2.CODEC_FP16, tensor_pb2.CODEC_BF16, tensor_pb2.CODEC_SIGN]
            ),
        ),
    )
)
def test_format_parse_round_trip(params: tensor_pb2.CodecParams) -> None:
    assert parse_codec(format_codec(params)) == params


def test_parse_is_lenient_on_case_and_space_only() -> None:
    assert parse_codec(" TopK:0.010 ") == parse_codec("topk:0.01")
    assert format_codec(tensor_pb2.CodecParams()) == "none"  # CODEC_UNSPECIFIED means none
    assert get_codec(tensor_pb2.CodecParams()).entry.name == "none"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "unknown codec"),
        ("gzip", "unknown codec"),
        ("topk", "needs a ratio"),
        ("topk:", "not a number"),
        ("topk:abc", "not a number"),
        ("topk:0", r"\(0, 1\]"),
        ("randk:-0.1", r"\(0, 1\]"),
        ("topk:1.5", r"\(0, 1\]"),
        ("topk:nan", r"\(0, 1\]"),
        ("topk:1e-60", r"\(0, 1\]"),
        ("int8:fast", "no 'fast' argument"),
        ("fp16:0.1", "no '0.1' argument"),
        ("sign:", "no '' argument"),
    ],
)
def test_parse_rejects_bad_strings(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_codec(text)


@pytest.mark.parametrize(
    "params",
    [
        tensor_pb2.CodecParams(codec=99),  # type: ignore[arg-type]  # an unknown enum value
        tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_TOPK),
        tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_RANDK, ratio=1.5),
        tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_INT8, ratio=0.5),
        tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_FP16, stochastic_rounding=True),
    ],
)
def test_get_codec_rejects_bad_params(params: tensor_pb2.CodecParams) -> None:
    with pytest.raises(CodecError):
        get_codec(params)
    with pytest.raises(CodecError):
        decode_part(b"", False, params, 0, CPU)


# --- encode_part / decode_part / decode_summand ---------------------------------------------------


@pytest.mark.parametrize("text", ALL)
def test_part_round_trip_with_feedback_and_lz4(text: str) -> None:
    params = parse_codec(text)
    grad = torch.randn(3, 50, generator=torch.Generator().manual_seed(10))
    feedback = ErrorFeedback()
    payload, framed = encode_part(grad, params, feedback=feedback, key=("w", 1), lz4_threshold=1.0)
    decoded = decode_part(payload, framed, params, grad.numel(), CPU)
    residual = flush(feedback, ("w", 1), grad.numel())
    assert torch.allclose(decoded, grad.reshape(-1) - residual, atol=1e-6)
    summand = decode_summand(payload, framed, params, grad.numel(), CPU)
    assert isinstance(summand, SparsePart) == isinstance(get_codec(params), SparseCodec)
    accumulator = torch.ones(grad.numel())
    if isinstance(summand, SparsePart):
        summand.add_to(accumulator, alpha=0.5)
    else:
        accumulator.add_(summand, alpha=0.5)
    assert torch.allclose(accumulator, 1 + 0.5 * decoded)
    with pytest.raises(ValueError, match="key"):
        encode_part(grad, params, feedback=feedback)
    assert not encode_part(torch.zeros(1000), params, lz4_threshold=None)[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("text", ALL)
def test_decode_on_cuda_matches_cpu(text: str) -> None:
    cuda = torch.device("cuda")
    codec = codec_for(text)
    values = torch.randn(1000, generator=torch.Generator().manual_seed(11))
    payload = codec.encode(values)
    on_cuda = codec.decode(payload, values.numel(), cuda)
    assert on_cuda.device.type == "cuda"
    assert torch.equal(on_cuda.cpu(), codec.decode(payload, values.numel(), CPU))
    accumulator = torch.zeros(values.numel(), device=cuda)
    codec.add_decoded(payload, accumulator)
    assert torch.equal(accumulator.cpu(), on_cuda.cpu())
