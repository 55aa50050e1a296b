"""What `gradps launch` (client/launch.py) and the scripts it starts (gpu_worker/launched.py)
agree on: the environment variables each script gets, as torchrun's RANK and WORLD_SIZE, and the
files they exchange in the launch folder (one host: the launcher and its scripts share it).

    launcher                                   script of rank k
    starts N scripts with the variables,
    then the local cluster; ready        ->   gradps.init(): joins the coordinator after
                                               rank k - 1 did (joined-k)
                                         <-   DistributedOptimizer(...): writes worker-k.json
    all N in: submits the run with their
    optimizer, writes run.json            ->   first step: takes the assignment of that run
                                         <-   after the last step: buffers-k.safetensors
    exports the run + rank 0's buffers         (rank 0 averages them, writes buffers.safetensors)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The coordinator the script joins (HOST:PORT).
COORDINATOR_ENV = "GRADPS_COORDINATOR"
# This script's rank among the launched ones, and how many there are.
RANK_ENV = "GRADPS_RANK"
WORLD_SIZE_ENV = "GRADPS_WORLD_SIZE"
# The launch folder (0700), where the files below live.
LAUNCH_DIR_ENV = "GRADPS_LAUNCH_DIR"
# Where the script's payloads travel (gradps.transport.TRANSPORTS).
TRANSPORT_ENV = "GRADPS_TRANSPORT"


def ready_file(launch_dir: Path) -> Path:
    """The cluster answers: the scripts, started while it starts, may join."""
    return launch_dir / "ready"


def joined_file(launch_dir: Path, rank: int) -> Path:
    """Rank `rank` joined the coordinator: the next rank joins after it, so that worker ids, and
    with them the run's ranks (ordered by worker id), follow the launcher's."""
    return launch_dir / f"joined-{rank}"


def worker_file(launch_dir: Path, rank: int) -> Path:
    """Rank `rank`'s worker id and the OptimizerSpec its torch optimizer translates to."""
    return launch_dir / f"worker-{rank}.json"


def run_file(launch_dir: Path) -> Path:
    """The id of the run the launcher submitted for its scripts."""
    return launch_dir / "run.json"


def rank_buffers_file(launch_dir: Path, rank: int) -> Path:
    """Rank `rank`'s model buffers (BatchNorm running statistics) after its last step."""
    return launch_dir / f"buffers-{rank}.safetensors"


def buffers_file(launch_dir: Path) -> Path:
    """The final model's buffers: the ranks' average, as rank 0 evaluated them."""
    return launch_dir / "buffers.safetensors"


def write_json(path: Path, content: dict[str, Any]) -> None:
    """Write `path` whole or not at all (temp file, rename): a reader never sees half of it."""
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    temp.write_text(json.dumps(content))
    temp.replace(path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The content of a file `write_json` wrote; None while it is not there."""
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
