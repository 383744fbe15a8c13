"""Shared fixtures. The neuron device is autoloaded by ``import torch``."""

import pytest
import torch

@pytest.fixture
def neuron():
    """The first neuron device; also checks it is there."""
    assert torch.neuron.is_available()
    return torch.device("neuron:0")


# `make test` runs the suite on two pytest-xdist workers with --dist loadgroup. Each test file
# is one group, so a file's tests keep their order and module fixtures run once. The tests that
# start processes of their own (distributed ranks, accelerate/torchrun launches, vLLM engines)
# form one group: they run one after the other on one worker, never two multi-process jobs at
# once on the 2-core machine, and session fixtures such as the vLLM engines start once.
_MULTIPROCESS_DIRS = ("distributed", "ecosystem", "serving")


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = item.nodeid.split("::", 1)[0]
        parts = rel.split("/")
        group = "multiprocess" if len(parts) > 2 and parts[1] in _MULTIPROCESS_DIRS else rel
        item.add_marker(pytest.mark.xdist_group(group))
