"""gradps: a sharded gRPC parameter server for data-parallel training.

Shared code lives here: the generated protocol stubs (`gradps.v1`), the placement of tensor parts
on shards, the part <-> tensor conversion, codecs, models, datasets and the channel factory.
"""

__version__ = "0.1.0"
