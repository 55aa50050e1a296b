"""Where a part's payload bytes travel beside a call's messages: one module per transport.

`base` is the seam and the messages transport (payloads inline); `shared_memory` and
`data_stream` carry them out of band; `framing` is the one path from parts to messages and back.
"""

from gradps.transport.base import INLINE_IN, INLINE_OUT, Buffer, Inbound, Outbound, Route
from gradps.transport.data_stream import DataStreamRoute, StreamIn, StreamOut
from gradps.transport.framing import Item, frame, unframe
from gradps.transport.shared_memory import RegionIn, RegionOut, SharedMemoryRoute

# Where payloads travel, fastest first: "shm" (shared memory with shards on this host, a data
# stream to the others), "stream" (a data stream to every shard) or "grpc" (in the messages).
# Each falls back to the next where it cannot be set up, and to the messages for a call that
# finds it busy or broken.
TRANSPORTS = ("shm", "stream", "grpc")

__all__ = [
    "INLINE_IN",
    "INLINE_OUT",
    "TRANSPORTS",
    "Buffer",
    "DataStreamRoute",
    "Inbound",
    "Item",
    "Outbound",
    "RegionIn",
    "RegionOut",
    "Route",
    "SharedMemoryRoute",
    "StreamIn",
    "StreamOut",
    "frame",
    "unframe",
]
