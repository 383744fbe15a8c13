import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from world import World  # noqa: E402


def _world(size, backend="neuron"):
    w = World(size, backend)
    w.start()
    return w


@pytest.fixture(scope="session")
def world2():
    w = _world(2)
    yield w
    w.stop()


@pytest.fixture(scope="session")
def world4():
    w = _world(4)
    yield w
    w.stop()


@pytest.fixture(scope="session")
def world2_mixed():
    w = _world(2, "cpu:gloo,neuron:neuron")
    yield w
    w.stop()


@pytest.fixture(scope="session")
def world2_bare():
    w = _world(2, None)  # init_process_group() with no backend: the accelerator's default
    yield w
    w.stop()
