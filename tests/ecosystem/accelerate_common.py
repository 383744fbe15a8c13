"""Model and data shared by the accelerate tests and the script they launch."""

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 3
BATCH = 4  # per process


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))


def make_data(n: int = 64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)


def make_loader(batch: int = BATCH) -> DataLoader:
    return DataLoader(TensorDataset(*make_data()), batch_size=batch, shuffle=False)
