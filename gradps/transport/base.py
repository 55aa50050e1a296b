"""The transport seam: where a part's payload bytes go and come from during one call.

Every bulk call (push, pull, group average) is gRPC messages listing parts; a transport decides
where each part's payload travels beside them. On both sides one call has an `Outbound` for
the payloads it sends and an `Inbound` for those it receives. The base classes here are the
messages transport itself: payloads inside the messages. A transport overrides what it carries
out of band (a region of a shared segment: `shared_memory.py`; raw bytes on a data stream after
the message: `data_stream.py`). Nothing here knows schemes or codecs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from google.protobuf.message import Message

from gradps.errors import Invalid
from gradps.v1 import tensor_pb2
from gradps.wire import Buffer


class Outbound:
    """How one call's outgoing payloads travel; by default inside the messages."""

    # Whether a payload's bytes follow its message (`follow`): a call's messages are then made
    # one at a time, each after the one before it is on its way.
    follows = False

    def name_in(self, header: Message) -> None:
        """Name this route in the call's header (a field every message of the call repeats)."""

    def carry(self, meta: tensor_pb2.TensorPart, payload: object) -> bool:
        """Take `payload` out of band and describe where in `meta` (TensorPart.shared or
        .streamed); False: it travels in the message."""
        return False

    def follow(self) -> None:
        """The message listing the part last carried is on its way: send what it announced
        (StreamError when the route broke: the peer, short of those bytes, fails the call)."""


class Inbound:
    """How one call's incoming payloads arrive; by default inside the messages."""

    def name_in(self, header: Message) -> None:
        """Name this route in the call's request, for the peer to send by it."""

    def payload(self, meta: tensor_pb2.TensorPart, received: Buffer, into: memoryview | None = None) -> Buffer | None:
        """The payload of part `meta`, which came with `received` bytes in its message. Given
        `into` (the bytes of its plain float32 values), a route may read them straight there and
        return None."""
        name = f"{meta.name}/{meta.index}"
        if meta.streamed:
            raise Invalid(f"part {name} is streamed, but the call has no stream")
        if meta.HasField("shared"):
            raise Invalid(f"part {name} lies in shared memory, which the call did not offer")
        return received


INLINE_OUT, INLINE_IN = Outbound(), Inbound()


class Route:
    """A worker's transport to one shard (one per shard and run), set up once. `call` claims it
    for one call; a route that is busy or broken yields the messages' own Outbound and Inbound."""

    @contextmanager
    def call(self, send: bool, receive: bool) -> Iterator[tuple[Outbound, Inbound]]:
        """The (outbound, inbound) of one call that sends payloads (`send`) and receives them
        (`receive`). An exception out of the block marks the route broken where it was used."""
        yield INLINE_OUT, INLINE_IN

    @property
    def open(self) -> bool:
        """Whether payloads can go out of band now."""
        return False

    def close(self) -> None:
        """Release what the route holds (a segment, a socket)."""
