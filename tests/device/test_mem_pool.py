"""torch.neuron.MemPool / use_mem_pool: a private pool of the caching allocator, as CUDA's."""

import gc
import threading

import pytest
import torch

MiB = 1 << 20
pytestmark = pytest.mark.usefixtures("gc_frozen_heap")


def big(n_mib=4):
    return torch.empty(n_mib * MiB, dtype=torch.uint8, device="neuron")


def pool_segments(pool):
    return {s["address"]: s for s in pool.snapshot()}


def test_allocations_inside_come_from_the_pools_own_segments():
    pool = torch.neuron.MemPool()
    outside = big()
    with torch.neuron.use_mem_pool(pool):
        inside = big()
    segs = pool_segments(pool)
    assert len(segs) == 1
    (seg,) = segs.values()
    assert seg["segment_pool_id"] == pool.id == (0, pool.id[1]) and pool.id[1] > 0
    assert seg["address"] <= inside.data_ptr() < seg["address"] + seg["total_size"]
    assert not seg["address"] <= outside.data_ptr() < seg["address"] + seg["total_size"]


def test_freed_pool_memory_serves_only_the_pools_later_allocations():
    gc.collect()
    torch.neuron.empty_cache()  # no cached block of the device's own pool could serve 30 MiB
    pool = torch.neuron.MemPool()
    with torch.neuron.use_mem_pool(pool):
        first = big(30)
    addr = first.data_ptr()
    del first
    outside = big(30)
    assert outside.data_ptr() != addr  # the device's own pool does not take it
    with torch.neuron.use_mem_pool(pool):
        again = big(30)
    assert again.data_ptr() == addr


def test_routing_is_per_thread():
    pool = torch.neuron.MemPool()
    other = {}
    with torch.neuron.use_mem_pool(pool):
        mine = big()
        t = threading.Thread(target=lambda: other.setdefault("t", big()))
        t.start()
        t.join()
    segs = pool_segments(pool)
    within = [any(s["address"] <= x.data_ptr() < s["address"] + s["total_size"] for s in segs.values())
              for x in (mine, other["t"])]
    assert within == [True, False]


def test_releasing_the_pool_frees_its_idle_segments_and_keeps_live_tensors():
    gc.collect()
    torch.neuron.empty_cache()
    base = torch.neuron.memory_reserved()
    pool = torch.neuron.MemPool()
    with torch.neuron.use_mem_pool(pool):
        idle = big(30)   # a segment of its own, freed below
        kept = big(30)
    kept.fill_(7)
    del idle
    reserved = torch.neuron.memory_reserved()
    assert reserved - base == 60 * MiB
    del pool
    gc.collect()
    assert torch.neuron.memory_reserved() - base == 30 * MiB  # kept's segment stays
    assert torch.equal(kept[:4].cpu(), torch.full((4,), 7, dtype=torch.uint8))
    addr = kept.data_ptr()
    del kept  # now cached in the device's own pool
    assert big(30).data_ptr() == addr


def test_pools_nest_and_the_innermost_routes():
    outer, inner = torch.neuron.MemPool(), torch.neuron.MemPool()
    with torch.neuron.use_mem_pool(outer):
        a = big()
        with torch.neuron.use_mem_pool(inner):
            assert outer.use_count() == 2 and inner.use_count() == 2
            b = big()
        c = big()
    assert outer.use_count() == inner.use_count() == 1
    addrs = lambda pool: [s["address"] for s in pool.snapshot()]  # noqa: E731
    assert len(addrs(inner)) == 1 and len(addrs(outer)) == 1
    (seg,) = outer.snapshot()
    assert all(seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"] for t in (a, c))
    del b


def test_no_split_gives_each_allocation_its_whole_block():
    for no_split, expected in ((False, 4 * MiB), (True, 20 * MiB)):
        pool = torch.neuron.MemPool(no_split=no_split)
        before = torch.neuron.memory_allocated()
        with torch.neuron.use_mem_pool(pool):
            t = big(4)  # from a 20 MiB segment (requests of 1-10 MiB)
        assert torch.neuron.memory_allocated() - before == expected
        del t


def test_results_of_synchronous_kernels_inside_a_pool_come_from_it():
    # (a CPU kernel's result is otherwise adopted as device memory as it is: outside any pool)
    from torchneuron.neuron import engine

    was = engine.is_enabled()
    engine.set_enabled(False)
    try:
        pool = torch.neuron.MemPool()
        with torch.neuron.use_mem_pool(pool):
            y = torch.arange(MiB, dtype=torch.float32, device="neuron")
    finally:
        engine.set_enabled(was)
    (seg,) = pool.snapshot()
    assert seg["address"] <= y.data_ptr() < seg["address"] + seg["total_size"]
    torch.testing.assert_close(y.cpu(), torch.arange(MiB, dtype=torch.float32))


def test_empty_cache_keeps_a_live_pools_cached_memory():
    gc.collect()
    pool = torch.neuron.MemPool()
    with torch.neuron.use_mem_pool(pool):
        t = big(30)
    addr = t.data_ptr()
    del t
    torch.neuron.empty_cache()  # as CUDA's: a pool's memory is its own until it is released
    assert [s["address"] for s in pool.snapshot()] == [addr]
    assert torch.neuron.memory_snapshot(pool.id) == pool.snapshot()  # (CUDA's signature)
    with torch.neuron.use_mem_pool(pool):
        assert big(30).data_ptr() == addr


USE_ON_OOM = """
import torch
MiB = 1 << 20
def big(n):
    return torch.empty(n * MiB, dtype=torch.uint8, device="neuron")
pool = torch.neuron.MemPool(use_on_oom={use_on_oom})
with torch.neuron.use_mem_pool(pool):
    lent = big(60)
lent_at = lent.data_ptr()
del lent  # 60 MiB cached in the pool
b = big(60)  # the device's other 68 MiB
try:
    c = big(60)
    print("from the pool" if c.data_ptr() == lent_at else "elsewhere")
except torch.OutOfMemoryError:
    print("OOM")
"""


@pytest.mark.parametrize("use_on_oom, expected", [(True, "from the pool"), (False, "OOM")])
def test_use_on_oom_lends_the_pools_free_blocks_when_the_device_is_full(use_on_oom, expected):
    from support import run_python

    r = run_python(USE_ON_OOM.format(use_on_oom=use_on_oom), env={"TORCHNEURON_DEVICE_MEMORY": "128MiB"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == expected


ALLOCATOR_SOURCE = r"""
#include <stdlib.h>
#include <string.h>
long allocs = 0, frees = 0, last_size = 0, last_device = -1, fail = 0;
void* last_ptr = 0;
void* pool_alloc(size_t size, int device, void* stream) {
  if (fail) return NULL;
  allocs++; last_size = (long)size; last_device = device;
  last_ptr = aligned_alloc(4096, size);
  return last_ptr;
}
void pool_free(void* ptr, size_t size, int device, void* stream) {
  if (ptr == last_ptr && (long)size == last_size) frees++;
  free(ptr);
}
"""


@pytest.fixture(scope="module")
def allocator_library(tmp_path_factory):
    import subprocess

    d = tmp_path_factory.mktemp("pluggable")
    (d / "pool_alloc.c").write_text(ALLOCATOR_SOURCE)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(d / "libpool.so"), str(d / "pool_alloc.c")],
                   check=True)
    return str(d / "libpool.so")


def counters(path):
    import ctypes

    lib = ctypes.CDLL(path)  # the same loaded library as the allocator's
    return lib, {k: ctypes.c_long.in_dll(lib, k).value for k in ("allocs", "frees", "last_size", "last_device")}


def test_a_pluggable_allocator_provides_the_pools_segments(allocator_library):
    gc.collect()
    allocator = torch.neuron.memory.NeuronPluggableAllocator(allocator_library, "pool_alloc", "pool_free")
    pool = torch.neuron.MemPool(allocator=allocator)
    assert pool.allocator is allocator
    _, before = counters(allocator_library)
    free_before = torch.neuron.mem_get_info()[0]
    with torch.neuron.use_mem_pool(pool):
        x = torch.empty(MiB, device="neuron")  # 4 MiB: a 20 MiB segment, y too
        y = torch.empty(MiB, device="neuron")
    x.copy_(torch.arange(MiB, dtype=torch.float32))
    torch.mul(x, 2, out=y)
    _, now = counters(allocator_library)
    assert now["allocs"] - before["allocs"] == 1 and now["last_size"] == 20 * MiB and now["last_device"] == 0
    (seg,) = pool.snapshot()
    assert seg["address"] <= y.data_ptr() < seg["address"] + seg["total_size"]
    assert free_before - torch.neuron.mem_get_info()[0] == 20 * MiB  # within the device's capacity
    torch.testing.assert_close(y.cpu(), torch.arange(MiB, dtype=torch.float32) * 2)
    del x, y
    torch.neuron.synchronize()
    del pool
    gc.collect()  # the released pool's idle segment goes back through the library's free
    _, after = counters(allocator_library)
    assert after["frees"] - now["frees"] == 1
    assert torch.neuron.mem_get_info()[0] == free_before


def test_a_pluggable_allocator_without_memory_raises_out_of_memory(allocator_library):
    import ctypes

    allocator = torch.neuron.memory.NeuronPluggableAllocator(allocator_library, "pool_alloc", "pool_free")
    pool = torch.neuron.MemPool(allocator=allocator)
    lib, _ = counters(allocator_library)
    ctypes.c_long.in_dll(lib, "fail").value = 1
    try:
        with torch.neuron.use_mem_pool(pool):
            with pytest.raises(torch.OutOfMemoryError, match="neuron out of memory"):
                big(8)
    finally:
        ctypes.c_long.in_dll(lib, "fail").value = 0
    with torch.neuron.use_mem_pool(pool):
        assert big(8).numel() == 8 * MiB  # and it works again


def test_a_missing_function_is_named(allocator_library):
    with pytest.raises(AttributeError, match="has no function pool_malloc"):
        torch.neuron.memory.NeuronPluggableAllocator(allocator_library, "pool_malloc", "pool_free")


def test_what_is_not_implemented_raises_naming_it():
    with pytest.raises(NotImplementedError, match="change_current_allocator is not implemented.*MemPool"):
        torch.neuron.memory.change_current_allocator(None)
    with pytest.raises(TypeError, match="allocator must be a torch.neuron.memory.NeuronPluggableAllocator"):
        torch.neuron.MemPool(allocator=object())
    with pytest.raises(TypeError, match="expects a torch.neuron.MemPool"):
        with torch.neuron.use_mem_pool((0, 1)):
            pass


# ---- remappable pools: the memory under vLLM's sleep mode (torchneuron/vllm/sleep.py) ---------

def test_a_sleeping_pool_gives_its_pages_back_and_wakes_with_its_tensors_in_place():
    from torchneuron import _C

    pool = torch.neuron.MemPool(_remappable=True)
    with torch.neuron.use_mem_pool(pool):
        w = torch.arange(3 * MiB, dtype=torch.float32, device="neuron")  # 12 MiB
    torch.neuron.synchronize()
    ptr, awake = w.data_ptr(), torch.neuron.mem_get_info()[0]
    _C._mem_pool_sleep(pool._id, True)  # offloaded to host memory
    assert torch.neuron.mem_get_info()[0] - awake == 12 * MiB
    with pytest.raises(RuntimeError, match="while its memory is asleep.*wake it first"):
        with torch.neuron.use_mem_pool(pool):
            big(1)
    _C._mem_pool_wake(pool._id)
    assert torch.neuron.mem_get_info()[0] == awake and w.data_ptr() == ptr
    torch.testing.assert_close(w.cpu(), torch.arange(3 * MiB, dtype=torch.float32), rtol=0, atol=0)
    _C._mem_pool_sleep(pool._id, False)  # discarded
    _C._mem_pool_wake(pool._id)
    assert w.abs().sum().item() == 0.0


WAKE_OOM = """
import torch
from torchneuron import _C
MiB = 1 << 20
pool = torch.neuron.MemPool(_remappable=True)
with torch.neuron.use_mem_pool(pool):
    w = torch.full((60 * MiB,), 3, dtype=torch.uint8, device="neuron")
_C._mem_pool_sleep(pool._id, True)
other = torch.empty(100 * MiB, dtype=torch.uint8, device="neuron")  # the freed memory, taken
try:
    _C._mem_pool_wake(pool._id)
except torch.OutOfMemoryError as e:
    print("OOM", "waking memory pool" in str(e))
del other
torch.neuron.empty_cache()
_C._mem_pool_wake(pool._id)
print(int(w.sum().item()) == 3 * 60 * MiB)
"""


def test_waking_a_pool_without_room_raises_out_of_memory_and_can_be_retried():
    from support import run_python

    r = run_python(WAKE_OOM, env={"TORCHNEURON_DEVICE_MEMORY": "128MiB"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["OOM", "True", "True"]
