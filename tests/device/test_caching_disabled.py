"""The caching allocator turned off, as CUDA's: ``torch.neuron.memory.caching_allocator_enable``,
``caching_allocator_disabled()`` and ``PYTORCH_NO_CUDA_MEMORY_CACHING``. Each allocation is then
a device allocation of its own, returned to the device when its tensor is freed, and outside
``memory_stats``."""

import pytest
import torch

import torchneuron  # noqa: F401
from support import run_python

MiB = 1 << 20


def device_free() -> int:
    return torch.neuron.mem_get_info()[0]


def test_allocations_inside_bypass_the_cache_and_its_statistics():
    torch.neuron.synchronize()
    allocated, reserved = torch.neuron.memory_allocated(), torch.neuron.memory_reserved()
    free = device_free()
    with torch.neuron.caching_allocator_disabled():
        x = torch.ones(3 * MiB, device="neuron")  # 12 MiB
        assert free - device_free() == 12 * MiB
        assert (torch.neuron.memory_allocated(), torch.neuron.memory_reserved()) == (allocated, reserved)
        del x
        torch.neuron.synchronize()  # (queued kernels hold what they use)
        assert device_free() == free  # returned at once, not cached
    y = torch.ones(3 * MiB, device="neuron")
    assert torch.neuron.memory_allocated() == allocated + 12 * MiB  # the cache is back
    del y


def test_the_setting_is_restored_after_the_context():
    assert torch.neuron.memory._C._caching_allocator_is_enabled()
    with torch.neuron.caching_allocator_disabled():
        assert not torch.neuron.memory._C._caching_allocator_is_enabled()
        with torch.neuron.caching_allocator_disabled():
            pass
        assert not torch.neuron.memory._C._caching_allocator_is_enabled()
    assert torch.neuron.memory._C._caching_allocator_is_enabled()


def test_uncached_tensors_compute_and_share_their_memory_by_dlpack():
    with torch.neuron.caching_allocator_disabled():
        x = torch.arange(1000.0, device="neuron")
        y = (x * 2).sin()
        z = torch.from_dlpack(y)
    torch.testing.assert_close(y.cpu(), (torch.arange(1000.0) * 2).sin())
    assert z.device == y.device and z.data_ptr() == y.data_ptr()


def test_uncached_tensors_freed_outside_the_context_return_to_the_device():
    with torch.neuron.caching_allocator_disabled():
        x = torch.empty(4 * MiB, dtype=torch.uint8, device="neuron")
    torch.neuron.synchronize()
    free = device_free()
    del x
    assert device_free() - free == 4 * MiB


def test_graph_capture_with_caching_off_is_refused_by_name():
    x = torch.ones(4, device="neuron")
    g = torch.neuron.NeuronGraph()
    with torch.neuron.caching_allocator_disabled():
        with pytest.raises(RuntimeError, match="caching allocator is off.*turn caching on around the capture"):
            with torch.neuron.graph(g):
                x * 2
    torch.testing.assert_close((x * 2).cpu(), torch.full((4,), 2.0))  # the device stays usable


ENV_PROBE = """
import torch
MiB = 1 << 20
torch.neuron.memory.caching_allocator_enable(True)  # cannot override the variable
x = torch.ones(MiB, device="neuron")
print(torch.neuron.memory_reserved(), torch.neuron.memory_allocated(), int(x.sum().item()))
"""


def test_the_environment_variable_turns_caching_off_for_the_process():
    r = run_python(ENV_PROBE, env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "0", str(1 << 20)]


OOM_PROBE = """
import torch
MiB = 1 << 20
cached = torch.empty(60 * MiB, dtype=torch.uint8, device="neuron")
del cached  # 60 MiB stay cached
torch.neuron.memory.caching_allocator_enable(False)
y = torch.empty(80 * MiB, dtype=torch.uint8, device="neuron")  # fits once the cache is released
print("reserved", torch.neuron.memory_reserved())
try:
    torch.empty(80 * MiB, dtype=torch.uint8, device="neuron")
except torch.OutOfMemoryError as e:
    print("OOM", str(e).splitlines()[0][:60])
"""


def test_an_uncached_allocation_releases_the_cache_before_running_out():
    r = run_python(OOM_PROBE, env={"TORCHNEURON_DEVICE_MEMORY": "128MiB"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["reserved 0",
                                     "OOM neuron out of memory. Tried to allocate 80.00 MiB. neuron:0 "]
