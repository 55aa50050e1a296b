"""Worker-side rules, one module per scheme."""

from __future__ import annotations

from gpu_worker.schemes.asgd import AsgdWorker
from gpu_worker.schemes.base import WorkerScheme
from gpu_worker.schemes.sync import SyncWorker

WORKER_SCHEMES: dict[str, type[WorkerScheme]] = {
    "asgd": AsgdWorker,
    "sync": SyncWorker,
}

__all__ = ["WORKER_SCHEMES", "WorkerScheme"]
