"""The caching allocator: stats through torch.accelerator and torch.neuron, pools, cache,
OOM, pinned memory, record_stream, storage resize."""

import gc

import pytest
import torch

from support import run_python

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _clean(gc_frozen_heap):
    gc.collect()
    torch.neuron.empty_cache()
    yield


def test_allocation_is_counted_exactly_and_freed():
    before = torch.neuron.memory_allocated()
    x = torch.empty(1024, 1024, device="neuron")  # 4 MiB, a size class boundary
    assert torch.neuron.memory_allocated() - before == 4 * MiB
    del x
    assert torch.neuron.memory_allocated() == before


def test_torch_accelerator_and_torch_neuron_agree():
    x = torch.empty(3000, device="neuron")
    assert torch.accelerator.memory_allocated() == torch.neuron.memory_allocated()
    assert torch.accelerator.memory_reserved() == torch.neuron.memory_reserved()
    assert torch.accelerator.max_memory_allocated() == torch.neuron.max_memory_allocated()
    del x


def test_freed_blocks_stay_cached_until_empty_cache():
    x = torch.empty(8 * MiB, dtype=torch.uint8, device="neuron")
    reserved = torch.neuron.memory_reserved()
    del x
    assert torch.neuron.memory_reserved() == reserved  # cached, not returned
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() < reserved


def test_small_and_large_pools_are_separate():
    small = torch.empty(1000, dtype=torch.uint8, device="neuron")
    large = torch.empty(2 * MiB, dtype=torch.uint8, device="neuron")
    stats = torch.neuron.memory_stats()
    assert stats["allocated_bytes.small_pool.current"] >= 1024
    assert stats["allocated_bytes.large_pool.current"] >= 2 * MiB
    assert stats["segment.small_pool.current"] >= 1
    del small, large


def test_requests_are_rounded_to_size_classes():
    before = torch.neuron.memory_allocated()
    x = torch.empty(1000, dtype=torch.uint8, device="neuron")
    assert torch.neuron.memory_allocated() - before == 1024  # 1000 -> class 1024
    y = torch.empty(100, dtype=torch.uint8, device="neuron")
    assert torch.neuron.memory_allocated() - before == 1024 + 256  # minimum 256 B
    del x, y


def test_cached_block_is_reused():
    x = torch.empty(4096, device="neuron")
    ptr = x.data_ptr()
    del x
    y = torch.empty(4096, device="neuron")
    assert y.data_ptr() == ptr


def test_peak_and_reset():
    torch.neuron.reset_peak_memory_stats()
    base = torch.neuron.max_memory_allocated()
    x = torch.empty(10 * MiB, dtype=torch.uint8, device="neuron")
    del x
    assert torch.neuron.max_memory_allocated() >= base + 10 * MiB
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()


def test_reserved_ge_allocated_ge_zero_and_active():
    x = torch.randn(1000, device="neuron") * 2  # an adopted kernel result counts too
    s = torch.neuron.memory_stats()
    assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"] >= 4000
    assert s["active_bytes.all.current"] == s["allocated_bytes.all.current"]
    del x


def test_kernel_outputs_are_device_memory_and_counted():
    a = torch.randn(256, 256, device="neuron")
    before = torch.neuron.memory_allocated()
    b = a @ a
    assert torch.neuron.memory_allocated() - before >= 256 * 256 * 4
    del b
    assert torch.neuron.memory_allocated() == before


def test_memory_summary_and_snapshot():
    x = torch.empty(5 * MiB, dtype=torch.uint8, device="neuron")
    summary = torch.neuron.memory_summary()
    assert "Allocated memory" in summary and "neuron:0" in summary
    segs = torch.neuron.memory_snapshot()
    assert any(b["size"] >= 5 * MiB and b["state"] == "active_allocated" for s in segs for b in s["blocks"])
    assert all(s["segment_type"] in ("small", "large") for s in segs)
    del x


def test_mem_get_info_reports_emulated_capacity():
    free, total = torch.neuron.mem_get_info()
    assert total == torch.neuron.get_device_properties(0).total_memory
    assert 0 < free <= total


OOM_SCRIPT = """
import torch
x = torch.empty(600 << 20, dtype=torch.uint8, device='neuron')
try:
    y = torch.empty(600 << 20, dtype=torch.uint8, device='neuron')
except torch.OutOfMemoryError as e:
    print('OOM', e)
print('ooms', torch.neuron.memory_stats()['num_ooms'])
del x
z = torch.empty(600 << 20, dtype=torch.uint8, device='neuron')  # usable again
print('ok', z.numel())
"""


def test_oom_raises_cuda_style_error_and_process_stays_usable():
    r = run_python(OOM_SCRIPT, env={"TORCHNEURON_DEVICE_MEMORY": "1GiB"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "neuron out of memory. Tried to allocate 600.00 MiB" in out
    assert "total capacity of 1.00 GiB" in out and "allocated by PyTorch" in out
    assert "TORCHNEURON_DEVICE_MEMORY" in out  # the hint
    assert "ooms 1" in out and "ok 629145600" in out


def test_oom_frees_the_cache_and_retries_before_failing():
    r = run_python("""
import torch
x = torch.empty(700 << 20, dtype=torch.uint8, device='neuron'); del x   # cached, 700 MiB reserved
y = torch.empty(800 << 20, dtype=torch.uint8, device='neuron')          # fits only if cache freed
s = torch.neuron.memory_stats(); print(s['num_alloc_retries'], s['num_ooms'])
""", env={"TORCHNEURON_DEVICE_MEMORY": "1GiB"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "0"]


def test_per_process_memory_fraction_limits_the_allocator():
    """As torch.cuda.set_per_process_memory_fraction: beyond the fraction, the cache is freed and
    the allocation retried, then OutOfMemoryError names the limit; the device stays usable."""
    r = run_python("""
import torch
print('default', torch.neuron.get_per_process_memory_fraction())
torch.neuron.set_per_process_memory_fraction(0.5)
print('set', torch.neuron.get_per_process_memory_fraction())
x = torch.empty(300 << 20, dtype=torch.uint8, device='neuron'); del x   # cached
y = torch.empty(400 << 20, dtype=torch.uint8, device='neuron')          # fits once the cache is freed
try:
    z = torch.empty(300 << 20, dtype=torch.uint8, device='neuron')      # 700 MiB > 512 MiB
except torch.neuron.OutOfMemoryError as e:
    print('OOM', e)
del y
z = torch.empty(300 << 20, dtype=torch.uint8, device='neuron')
print('ok', torch.neuron.mem_get_info()[1] >> 20)
torch.neuron.set_per_process_memory_fraction(1.0)
w = torch.empty(600 << 20, dtype=torch.uint8, device='neuron')
print('ok', w.numel() >> 20)
""", env={"TORCHNEURON_DEVICE_MEMORY": "1GiB"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "default 1.0" and lines[1] == "set 0.5"
    assert lines[2].startswith("OOM neuron out of memory. Tried to allocate 300.00 MiB")
    assert "This process may use 512.00 MiB of it (set_per_process_memory_fraction(0.5))" in lines[2]
    assert lines[3:] == ["ok 1024", "ok 600"]


def test_per_process_memory_fraction_rejects_bad_values():
    with pytest.raises(ValueError, match="Allowed range: 0~1"):
        torch.neuron.set_per_process_memory_fraction(1.5)
    with pytest.raises(ValueError, match="Allowed range: 0~1"):
        torch.neuron.set_per_process_memory_fraction(-0.1)
    with pytest.raises(TypeError, match="must be `float`"):
        torch.neuron.set_per_process_memory_fraction("0.5")
    assert torch.neuron.get_per_process_memory_fraction() == 1.0
    assert torch.neuron.OutOfMemoryError is torch.OutOfMemoryError


def test_pinned_memory():
    x = torch.randn(100)
    assert not x.is_pinned()
    p = x.pin_memory()
    assert p.is_pinned() and torch.equal(p, x)
    assert torch.empty(10, pin_memory=True).is_pinned()
    d = p.to("neuron", non_blocking=True)
    assert torch.equal(d.cpu(), x)


def test_record_stream_accepts_neuron_streams():
    s = torch.neuron.Stream()
    x = torch.ones(1000, device="neuron")
    x.record_stream(s)
    del x  # freed safely (execution is synchronous)


def test_storage_resize_keeps_prefix_and_can_free():
    x = torch.arange(10.0, device="neuron")
    st = x.untyped_storage()
    st.resize_(0)
    assert st.nbytes() == 0
    st.resize_(40)
    assert st.nbytes() == 40
    y = torch.arange(4.0, device="neuron")
    y.untyped_storage().resize_(32)
    assert torch.equal(torch.tensor([], device="neuron").set_(y.untyped_storage(), 0, (4,)).cpu(),
                       torch.arange(4.0))


def test_resize_grows_tensor_storage():
    x = torch.zeros(2, device="neuron")
    x.resize_(100)
    x.fill_(3)
    assert x.cpu().sum().item() == 300


def test_memory_stats_per_device_are_separate():
    a = torch.empty(MiB, dtype=torch.uint8, device="neuron:1")
    assert torch.neuron.memory_allocated(1) >= MiB
    assert torch.neuron.memory_allocated("neuron:1") == torch.neuron.memory_allocated(1)
    del a
