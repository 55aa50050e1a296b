"""Your own model, data and loop as the workers of a gradps run (as torchrun runs a DDP script):

    gradps launch --workers 2 --epochs 10 examples/own_training_loop.py

A small CNN with BatchNorm on the digits that ship with gradps, a torch DataLoader and
torch.optim.SGD with momentum: gradps adds init(), DistributedOptimizer(...) and batches(...).
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gradps
from gradps.datasets import load_dataset


def model() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 4 * 4, 10),
    )  # fmt: skip


def data() -> tuple[TensorDataset, TensorDataset]:
    digits = load_dataset("digits")  # tensors: (N, 64) pixels in [0, 1], labels 0-9
    return TensorDataset(digits.train_x, digits.train_y), TensorDataset(digits.test_x, digits.test_y)


if __name__ == "__main__":
    gradps.init()
    train, test = data()
    sampler = DistributedSampler(train, num_replicas=gradps.world_size(), rank=gradps.rank())  # this rank's share
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    net = model()
    sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    optimizer = gradps.DistributedOptimizer(sgd, net, test_data=test)  # the shards apply this SGD
    for x, y in gradps.batches(loader):  # --steps, or --epochs passes over the loader
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step(loss=loss)  # the run's step: net now holds the run's weights
