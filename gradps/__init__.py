"""gradps: a sharded gRPC parameter server for data-parallel training.

Shared code lives here: the generated protocol stubs (`gradps.v1`), the placement of tensor parts
on shards, the part <-> tensor conversion, codecs, models, datasets and the channel factory.

A training script started by `gradps launch` needs this one import:

    import gradps
    gradps.init()
    optimizer = gradps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
    for x, y in gradps.batches(loader):
        ...

(`init`, `rank`, `world_size`, `DistributedOptimizer`, `batches`, `LaunchError`: gpu_worker/launched.py.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_worker.launched import DistributedOptimizer, LaunchError, batches, init, rank, world_size

__version__ = "0.1.0"

# The script API is the worker's (gpu_worker/launched.py): imported on first use, so that shared
# code and the services never load it (pyproject.toml's import contract allows this one import).
__all__ = ["DistributedOptimizer", "LaunchError", "__version__", "batches", "init", "rank", "world_size"]
_SCRIPT_API = frozenset(__all__) - {"__version__"}


def __getattr__(name: str) -> Any:
    if name in _SCRIPT_API:
        from gpu_worker import launched

        return getattr(launched, name)
    raise AttributeError(f"module 'gradps' has no attribute {name!r}")
