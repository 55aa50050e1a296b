"""gradps.wire: hand-made bulk messages are exactly protobuf's encoding, and parse back."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradps import wire
from gradps.errors import Invalid
from gradps.transport.framing import unframe
from gradps.v1 import shard_pb2, tensor_pb2


def _meta(**fields) -> tensor_pb2.TensorPart:
    part = tensor_pb2.TensorPart(name="layer.weight", index=3, offset=1 << 40, count=5, dtype=1, version=7, lz4=True)
    part.codec.codec = tensor_pb2.CODEC_INT8
    for key, value in fields.items():
        setattr(part, key, value)
    return part


@given(payload=st.binary(max_size=3000), step=st.integers(0, 2**64 - 1), run_id=st.text(max_size=40))
def test_push_request_built_by_hand_parses_with_protobuf(payload, step, run_id):
    header = shard_pb2.PushRequest(run_id=run_id, worker_id=9, step=step).SerializeToString()
    message = b"".join(wire.part_message(header, 4, _meta(), memoryview(payload)))
    parsed = shard_pb2.PushRequest.FromString(message)
    expected = shard_pb2.PushRequest(run_id=run_id, worker_id=9, step=step)
    expected.part.CopyFrom(_meta(payload=payload))
    assert parsed == expected


@given(payload=st.binary(max_size=3000))
def test_split_message_returns_the_fields_and_a_view_of_the_payload(payload):
    response = shard_pb2.PullResponse()
    response.part.CopyFrom(_meta(payload=payload))
    rest, meta, view = wire.split_message(response.SerializeToString(), 1)
    assert rest == b"" and bytes(view) == payload and meta == _meta()
    header = shard_pb2.PushRequest(run_id="r", worker_id=2, step=5)
    request = shard_pb2.PushRequest()
    request.CopyFrom(header)
    request.part.CopyFrom(_meta(payload=payload))
    rest, meta, view = wire.split_message(request.SerializeToString(), 4)
    assert shard_pb2.PushRequest.FromString(rest) == header and bytes(view) == payload and meta == _meta()


def test_payload_view_aliases_the_message():
    values = np.arange(1000, dtype=np.float32)
    message = b"".join(wire.part_message(b"", 1, _meta(count=1000), memoryview(values).cast("B")))
    _, _, view = wire.split_message(message, 1)
    assert view.obj is message
    np.testing.assert_array_equal(np.frombuffer(view, np.float32), values)


def test_unknown_fields_are_kept_in_the_metadata_and_skipped_over():
    response = shard_pb2.PullResponse()
    response.part.CopyFrom(_meta(payload=b"abc"))
    # An unknown varint field (99) and an unknown fixed64 field (100) after the part.
    extra = wire.varint(99 << 3) + wire.varint(300) + wire.varint(100 << 3 | 1) + bytes(8)
    _, meta, view = wire.split_message(response.SerializeToString() + extra, 1)
    assert bytes(view) == b"abc" and meta.name == "layer.weight"


@pytest.mark.parametrize(
    "message",
    [b"\x0a\x05abc", b"\x0a", b"\x0f"],
    ids=["truncated-part", "no-length", "bad-wire-type"],
)
def test_malformed_messages_raise_wire_error(message):
    with pytest.raises(wire.WireError):
        wire.split_message(message, 1)


def test_unframe_refuses_malformed_messages_as_invalid():
    with pytest.raises(Invalid, match="malformed PullResponse"):
        unframe(b"\x0a\x05abc", shard_pb2.PullResponse)
    message, parts = unframe(b"".join(wire.part_message(b"", 1, _meta(count=1), b"abcd")), shard_pb2.PullResponse)
    assert [(meta.count, bytes(payload)) for meta, payload in parts] == [(1, b"abcd")]


def test_varint_matches_protobuf():
    for n in (0, 1, 127, 128, 300, 2**32, 2**64 - 1):
        encoded = tensor_pb2.TensorPart(offset=n).SerializeToString()
        assert encoded == (b"\x18" + wire.varint(n) if n else b"")


def test_a_batch_of_small_parts_fits_a_stock_clients_receive_limit():
    """Parts gathered into one message never take it past wire.BATCH_BYTES, and with the
    message's other fields stay within gRPC's standard 4 MiB receive limit, whatever their sizes."""
    messages = []
    batch = wire.PartBatch(lambda: shard_pb2.PullResponse())
    sizes = [wire.SMALL_PAYLOAD, 1, 200_000, wire.SMALL_PAYLOAD - 3, 0] * 12
    for i, size in enumerate(sizes):
        meta = tensor_pb2.TensorPart(name="n" * 200 + str(i), index=i, offset=i, count=size // 4, version=7)
        if (full := batch.add(meta, b"x" * size)) is not None:
            messages.append(full)
    if (rest := batch.take()) is not None:
        messages.append(rest)
    assert sum(len(m.parts) for m in messages) == len(sizes) and len(messages) > 1
    assert all(m.ByteSize() <= wire.BATCH_BYTES < 4 * 1024 * 1024 - 1024 for m in messages)
    assert [p.index for m in messages for p in m.parts] == list(range(len(sizes)))  # in order
