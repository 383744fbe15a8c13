"""Small models and data shared by the parallelism tests; CPU single-process training is the
oracle every distributed result is compared with."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

D_IN, D_HID, D_OUT = 16, 32, 8


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_OUT)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return MLP()


def data(step, batch=8):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, D_IN, generator=g), torch.randn(batch, D_OUT, generator=g)


def cpu_train(model, steps, batch=8, lr=0.1, opt="sgd"):
    """Full-batch training on CPU: what data-parallel training over the batch must reproduce."""
    model = copy.deepcopy(model)
    optim = make_opt(model.parameters(), opt, lr)
    for s in range(steps):
        x, y = data(s, batch)
        optim.zero_grad()
        F.mse_loss(model(x), y).backward()
        optim.step()
    return model


def make_opt(params, opt, lr):
    return torch.optim.SGD(params, lr=lr) if opt == "sgd" else torch.optim.Adam(params, lr=lr * 0.1)


def shard_batch(x, rank, size):
    n = x.shape[0] // size
    return x[rank * n:(rank + 1) * n]
