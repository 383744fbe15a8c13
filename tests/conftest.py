"""Shared fixtures. The neuron device is autoloaded by ``import torch``."""

import pytest
import torch

@pytest.fixture
def neuron():
    """The first neuron device; also checks it is there."""
    assert torch.neuron.is_available()
    return torch.device("neuron:0")
