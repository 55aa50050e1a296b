"""Your own training script as a gradps worker: wrap the model, call `trainer.step()` per batch.

It starts its own cluster (a local coordinator and 2 shards, no worker processes), submits a run
for one worker, and is that worker:

    python examples/own_training_loop.py

The loop below is plain PyTorch; gradps only adds `Trainer(...)`, `start()`, `step()`, `finish()`.
"""

from __future__ import annotations

import torch
from torch import nn

from client.local_cluster import LocalCluster
from client.sdk import Client
from gpu_worker.trainer import Trainer
from gradps.datasets import load_dataset
from gradps.evaluation import evaluate
from gradps.v1 import run_pb2
from gradps.worker_session import WorkerSession


def main() -> None:
    data = load_dataset("digits")  # any tensors work; this one ships with scikit-learn
    with LocalCluster(shards=2, workers=0) as cluster, Client(cluster.address) as client:
        run_id = client.submit(
            run_pb2.RunSpec(
                scheme="asgd",
                workers=1,
                model="mlp",
                steps=600,
                optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.1, momentum=0.9),
            )
        )
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
        session = WorkerSession(cluster.address, name="my-script")
        assignment = session.wait_for_assignment(wait_s=30)
        assert assignment is not None and assignment.run_id == run_id
        trainer = Trainer(model, session, assignment, total_steps=600, evaluate=lambda m: evaluate(m, data))
        trainer.start()
        for _ in range(600):
            idx = torch.randint(0, len(data.train_x), (32,))
            loss = nn.functional.cross_entropy(model(data.train_x[idx]), data.train_y[idx])
            loss.backward()
            trainer.step(loss.item(), samples=32)
        final = trainer.finish()
        session.close()
        print(f"run {run_id}: test accuracy {final.test_accuracy:.4f} after {final.step} steps")


if __name__ == "__main__":
    main()
