"""Worker-side rules, one module per scheme."""

from __future__ import annotations

from gpu_worker.schemes.asgd import AsgdWorker
from gpu_worker.schemes.base import WorkerScheme
from gpu_worker.schemes.pseudosync import PseudosyncWorker
from gpu_worker.schemes.ssp import SspWorker
from gpu_worker.schemes.sync import SyncWorker
from gpu_worker.schemes.wagma import WagmaWorker
from gradps.schemes import check_implemented

WORKER_SCHEMES: dict[str, type[WorkerScheme]] = {
    "asgd": AsgdWorker,
    "sync": SyncWorker,
    "ssp": SspWorker,
    "wagma": WagmaWorker,
    "pseudosync": PseudosyncWorker,
}
check_implemented(WORKER_SCHEMES, "worker rules")

__all__ = ["WORKER_SCHEMES", "WorkerScheme"]
