"""sync with backup workers (Chen et al. 2016): a step completes on the first P - b pushes, real shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gradps.run_spec import validate, with_defaults
from gradps.schemes import default_params
from gradps.v1 import run_pb2
from tests.joined_run import join_run, leave

_LR = 0.1


def _spec(backup: int, workers: int = 3) -> run_pb2.RunSpec:
    return run_pb2.RunSpec(
        scheme="sync",
        workers=workers,
        steps=100,
        optimizer=run_pb2.OptimizerSpec(name="sgd", lr=_LR),
        scheme_params=default_params(backup_workers=backup),
        # Small parts, so that this small model is spread over every shard.
        part_size=1024,
    )


def _tensors() -> dict[str, torch.Tensor]:
    # Several tensors in small parts, so that the parts of a step lie on all three shards.
    torch.manual_seed(0)
    return {"w": torch.randn(64, 32), "v": torch.randn(100), "b": torch.randn(17)}


def _grads(tensors: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    return [{name: torch.randn_like(t) for name, t in tensors.items()} for _ in range(n)]


def _stepped(weights: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Plain SGD on the mean of `grads`."""
    return {name: w - _LR * torch.stack([g[name] for g in grads]).mean(0) for name, w in weights.items()}


def _assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, t in expected.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=1e-6, msg=name)


def test_a_step_completes_on_the_first_two_of_three_and_the_late_push_is_left_out(shards_only):
    tensors = _tensors()
    run_id, sessions, clients, placement = join_run(shards_only.address, _spec(backup=1), tensors, n_workers=3)
    try:
        assert len({p.shard for p in placement.parts}) == 3
        clients[0].register(tensors)
        pulled = [{n: torch.zeros_like(t) for n, t in tensors.items()} for _ in clients]
        for client, into in zip(clients, pulled, strict=True):
            client.pull(into, min_version=0)
        g = _grads(tensors, 3)
        clients[0].push(g[0], 0)
        clients[1].push(g[1], 0)
        # Step 0 is complete with two of three pushes: the mean of those two.
        step1 = _stepped(tensors, [g[0], g[1]])
        clients[0].pull(pulled[0], min_version=1)
        _assert_close(pulled[0], step1)
        # The third worker's late push changes nothing; its next pull is answered at once.
        clients[2].push(g[2], 0)
        start = time.monotonic()
        clients[2].pull(pulled[2], min_version=1)
        assert time.monotonic() - start < 2.0
        _assert_close(pulled[2], step1)
        # The late worker goes on: its push of step 1 counts, with whichever other comes first.
        h = _grads(tensors, 3)
        clients[2].push(h[2], 1)
        clients[1].push(h[1], 1)
        clients[1].pull(pulled[1], min_version=2)
        _assert_close(pulled[1], _stepped(step1, [h[2], h[1]]))
        clients[0].push(h[0], 1)  # late for step 1
        clients[0].pull(pulled[0], min_version=2)
        _assert_close(pulled[0], pulled[1])
    finally:
        leave(sessions, clients)


def test_without_backup_workers_a_step_waits_for_every_worker(shards_only):
    tensors = _tensors()
    run_id, sessions, clients, _ = join_run(shards_only.address, _spec(backup=0), tensors, n_workers=3)
    try:
        clients[0].register(tensors)
        into = {n: torch.zeros_like(t) for n, t in tensors.items()}
        clients[0].pull(into, min_version=0)
        g = _grads(tensors, 3)
        clients[0].push(g[0], 0)
        clients[1].push(g[1], 0)
        waiting = threading.Thread(target=clients[0].pull, args=(into,), kwargs={"min_version": 1})
        waiting.start()
        waiting.join(timeout=1.5)
        assert waiting.is_alive(), "step 0 completed without the third worker"
        clients[2].push(g[2], 0)
        waiting.join(timeout=10)
        assert not waiting.is_alive()
        _assert_close(into, _stepped(tensors, g))
    finally:
        leave(sessions, clients)


def test_backup_workers_must_be_below_workers() -> None:
    validate(with_defaults(_spec(backup=2)))
    for scheme in ("sync", "asgd"):  # every field is checked, whichever scheme reads it
        spec = with_defaults(_spec(backup=3))
        spec.scheme = scheme
        with pytest.raises(ValueError, match=r"--backup-workers\) must be below workers=3, got 3$"):
            validate(spec)


@pytest.mark.slow
def test_a_run_with_a_straggler_and_a_backup_worker_finishes(tmp_path: Path) -> None:
    args = ["train", "--local", "--scheme", "sync", "--workers", "3", "--backup-workers", "1"]
    args += ["--straggler", "2:3", "--steps", "40", "--eval-every", "0", "--no-progress", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "GRADPS_COORDINATOR"}
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["state"] == "completed"
