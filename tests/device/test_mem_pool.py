"""torch.neuron.MemPool / use_mem_pool: a private pool of the caching allocator, as CUDA's."""

import gc
import threading

import pytest
import torch

MiB = 1 << 20


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


def test_what_is_not_implemented_raises_naming_it():
    with pytest.raises(NotImplementedError) as e:
        torch.neuron.MemPool(allocator=object())
    assert str(e.value) == ("torch.neuron.MemPool: custom allocators are not implemented (neuron has no "
                            "pluggable allocator); create the pool without one")
    with pytest.raises(NotImplementedError) as e:
        torch.neuron.MemPool(use_on_oom=True)
    assert str(e.value) == ("torch.neuron.MemPool: use_on_oom is not implemented (an allocation outside "
                            "the pool does not fall back to its free memory)")
    with pytest.raises(TypeError, match="expects a torch.neuron.MemPool"):
        with torch.neuron.use_mem_pool((0, 1)):
            pass
