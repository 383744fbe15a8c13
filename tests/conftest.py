"""Shared fixtures. The neuron device is autoloaded by ``import torch``."""

import gc
import os

import pytest
import torch

from support import use_fast_opinfo_input_tracking

def pytest_configure(config):
    # Every OpInfo-driven file (test_opinfo*, test_cuda_dtypes, test_sparse, and any new one)
    # needs this, or each OpInfo test pays ≈ 0.4 s of inspect.stack() in a full-suite worker.
    use_fast_opinfo_input_tracking()


# Fixtures that set the execution engine's state for their test whatever the environment says.
_PINS_THE_ENGINE = frozenset({"engine_on", "cast_fusion_on", "engine_mode", "small_path_mode"})


def pytest_collection_modifyitems(config, items):
    """Under NEURON_LAUNCH_BLOCKING=1 (`make test`'s second pass over tests/device), a test
    whose fixtures pin the engine's state would run exactly as in the first pass: deselected.
    (The ``sync`` variants of ``engine_mode`` ran synchronously there already.)"""
    if os.environ.get("NEURON_LAUNCH_BLOCKING") != "1":
        return
    kept, repeats = [], []
    for item in items:
        pinned = _PINS_THE_ENGINE.intersection(getattr(item, "fixturenames", ()))
        (repeats if pinned else kept).append(item)
    if repeats:
        config.hook.pytest_deselected(items=repeats)
        items[:] = kept


@pytest.fixture
def neuron():
    """The first neuron device; also checks it is there."""
    assert torch.neuron.is_available()
    return torch.device("neuron:0")


@pytest.fixture
def engine_on():
    """The execution engine on for the test; its queued kernels waited for at the end."""
    engine = torch.neuron.engine
    was = engine.is_enabled()
    engine.set_enabled(True)
    yield
    try:
        engine.synchronize()
    finally:
        engine.set_enabled(was)


@pytest.fixture
def cast_fusion_on():
    """The engine and Adaptive Eager's precompiled and GEMM families on for the test."""
    engine = torch.neuron.engine
    was, was_casts = engine.is_enabled(), engine.is_cast_fusion_enabled()
    engine.set_enabled(True)
    engine.set_cast_fusion_enabled(True)
    yield
    torch.neuron.synchronize()
    engine.set_enabled(was)
    engine.set_cast_fusion_enabled(was_casts)


@pytest.fixture(params=["sync", "engine", "fused"])
def engine_mode(request):
    """The test run with the engine off (synchronous), on, and on with Adaptive Eager fusion."""
    engine = torch.neuron.engine
    was, was_fusing = engine.is_enabled(), engine.is_fusion_enabled()
    engine.set_enabled(request.param != "sync")
    engine.set_fusion_enabled(request.param == "fused")
    yield request.param
    try:
        torch.neuron.synchronize()
    finally:
        engine.set_enabled(was)
        engine.set_fusion_enabled(was_fusing)


@pytest.fixture(scope="module")
def gc_frozen_heap():
    """For modules whose tests call gc.collect() around each test (the memory tests: tensors in
    reference cycles hold device memory). Late in a full-suite worker the heap holds millions of
    objects (imports, earlier modules' caches) and one collection took ~2 s; frozen when the
    module starts (after a full collection), each then scans only what the module's tests made.
    Unfrozen at the module's end."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def engine_state():
    """engine.set_enabled for the test; the engine's state restored after it."""
    engine = torch.neuron.engine
    was = engine.is_enabled()
    yield engine.set_enabled
    engine.set_enabled(was)



# `make test` runs the suite on two pytest-xdist workers with --dist loadgroup, scheduled by
# the groups below. Each test file is one group, so a file's tests keep their order and module
# fixtures run once. The tests that start processes of their own (distributed ranks,
# accelerate/torchrun launches, vLLM engines) form one group: they run one after the other on
# one worker, never two multi-process jobs at once on the 2-core machine, and session fixtures
# such as the vLLM engines start once. (A scheduler, not xdist_group markers: xdist 3.8 renames
# node ids to carry the markers, which pytest 9 no longer allows.)
_MULTIPROCESS_DIRS = ("distributed", "ecosystem", "serving")


def _group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    return "multiprocess" if len(parts) > 2 and parts[1] in _MULTIPROCESS_DIRS else path


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # xdist is a test extra; without it the suite runs in one process
    pass
else:

    class _GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadgroup":
            return _GroupScheduling(config, log)
        return None
