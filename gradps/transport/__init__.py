"""Where a part's payload bytes travel beside a call's messages: one module per transport.

`base` is the seam and the messages transport (payloads inline); `shared_memory` and
`data_stream` carry them out of band; `framing` is the one path from parts to messages and back.
The package itself names the transports a client may choose, without loading any (no torch).
"""

# Where payloads travel, fastest first: "shm" (shared memory with shards on this host, a data
# stream to the others), "stream" (a data stream to every shard) or "grpc" (in the messages).
# Each falls back to the next where it cannot be set up, and to the messages for a call that
# finds it busy or broken.
TRANSPORTS = ("shm", "stream", "grpc")
