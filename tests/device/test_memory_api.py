"""torch.neuron.memory's Python layer: each accessor reads the counter it names (current vs peak,
allocated vs reserved) from the allocator's own statistics, on the device it is given; the
summary's table is the same numbers, formatted; the controls reach the device they name."""

import gc
import pickle

import pytest
import torch

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _clean(gc_frozen_heap):
    gc.collect()
    torch.neuron.empty_cache()
    yield
    gc.collect()
    torch.neuron.empty_cache()


def _stats(device=0):
    return torch.accelerator.memory_stats(device)


def test_max_memory_reserved_is_the_peak_not_the_current_value():
    torch.neuron.reset_peak_memory_stats()
    x = torch.empty(24 * MiB, dtype=torch.uint8, device="neuron")
    del x
    torch.neuron.empty_cache()  # reserved falls back, its peak stays
    s = _stats()
    assert torch.neuron.max_memory_reserved() == s["reserved_bytes.all.peak"]
    assert torch.neuron.memory_reserved() == s["reserved_bytes.all.current"]
    assert torch.neuron.max_memory_reserved() >= torch.neuron.memory_reserved() + 24 * MiB


def test_max_memory_allocated_is_the_peak_not_the_current_value():
    torch.neuron.reset_peak_memory_stats()
    before = torch.neuron.memory_allocated()
    x = torch.empty(3 * MiB + 1, dtype=torch.uint8, device="neuron")
    del x
    assert torch.neuron.memory_allocated() == before
    # 4 size classes per power of two: 3 MiB + 1 B -> 3.5 MiB
    assert torch.neuron.max_memory_allocated() == before + 3 * MiB + MiB // 2
    assert torch.neuron.max_memory_allocated() == _stats()["allocated_bytes.all.peak"]


def test_accessors_read_the_device_they_are_given():
    x = torch.empty(2 * MiB, dtype=torch.uint8, device="neuron:1")
    s1 = _stats(1)
    assert torch.neuron.memory_allocated(1) == s1["allocated_bytes.all.current"] >= 2 * MiB
    assert torch.neuron.memory_allocated("neuron:1") == s1["allocated_bytes.all.current"]
    assert torch.neuron.memory_reserved(torch.device("neuron", 1)) == s1["reserved_bytes.all.current"]
    assert torch.neuron.max_memory_allocated(1) == s1["allocated_bytes.all.peak"]
    assert torch.neuron.max_memory_reserved(1) == s1["reserved_bytes.all.peak"]
    assert torch.neuron.memory_stats(1) == s1
    del x


def test_accessors_default_to_the_current_device():
    x = torch.empty(2 * MiB, dtype=torch.uint8, device="neuron:2")
    with torch.neuron.device(2):
        assert torch.neuron.memory_allocated() == _stats(2)["allocated_bytes.all.current"] >= 2 * MiB
    del x


def test_unused_device_reads_zero():
    assert torch.neuron.memory_allocated(3) == 0
    assert torch.neuron.memory_reserved(3) == 0


def test_bad_device_index_is_named():
    with pytest.raises((RuntimeError, ValueError, AssertionError), match="7"):
        torch.neuron.memory_allocated(7)


def test_reset_peak_resets_the_device_it_names():
    x = torch.empty(8 * MiB, dtype=torch.uint8, device="neuron:1")
    del x
    peak0 = torch.neuron.max_memory_allocated(0)
    torch.neuron.reset_peak_memory_stats(1)
    assert torch.neuron.max_memory_allocated(1) == torch.neuron.memory_allocated(1)
    assert torch.neuron.max_memory_allocated(0) == peak0


def test_reset_max_memory_allocated_is_the_peak_reset():
    x = torch.empty(8 * MiB, dtype=torch.uint8, device="neuron")
    del x
    torch.neuron.reset_max_memory_allocated()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()


def test_reset_accumulated_clears_allocation_and_free_totals():
    x = torch.empty(MiB, dtype=torch.uint8, device="neuron:1")
    del x
    assert _stats(1)["allocation.all.allocated"] > 0
    torch.neuron.reset_accumulated_memory_stats(1)
    s = _stats(1)
    assert s["allocation.all.allocated"] == 0 and s["allocation.all.freed"] == 0
    assert s["allocated_bytes.all.allocated"] == 0 and s["num_alloc_retries"] == 0 and s["num_ooms"] == 0


def test_empty_cache_returns_cached_segments_of_every_device():
    # Relative to what earlier tests of the session still hold on neuron:1 (live segments stay).
    gc.collect()
    torch.neuron.empty_cache()
    held = torch.neuron.memory_reserved(1)
    x = torch.empty(4 * MiB, dtype=torch.uint8, device="neuron:1")
    del x
    assert torch.neuron.memory_reserved(1) >= held + 4 * MiB
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved(1) == held


def test_mem_get_info_is_capacity_minus_used():
    gc.collect()
    torch.neuron.empty_cache()
    free0, total = torch.neuron.mem_get_info(1)
    reserved0 = torch.neuron.memory_reserved(1)
    x = torch.empty(6 * MiB, dtype=torch.uint8, device="neuron:1")
    free1, total1 = torch.neuron.mem_get_info(1)
    assert total1 == total == torch.neuron.get_device_properties(1).total_memory
    assert free0 - free1 == torch.neuron.memory_reserved(1) - reserved0 >= 6 * MiB
    del x


def test_host_memory_stats_count_pinned_allocations_in_cudas_form():
    torch.neuron.reset_peak_host_memory_stats()
    before = torch.neuron.host_memory_stats()
    p = torch.empty(MiB, dtype=torch.uint8).pin_memory("neuron")
    after = torch.neuron.host_memory_stats()
    assert list(after) == sorted(after) and set(after) == set(before)
    for key in ("allocations", "active_requests"):
        assert after[f"{key}.current"] == before[f"{key}.current"] + 1
        assert after[f"{key}.allocated"] == before[f"{key}.allocated"] + 1
    assert after["allocated_bytes.current"] == before["allocated_bytes.current"] + MiB
    assert after["allocated_bytes.peak"] >= MiB
    assert after["num_host_alloc"] == before["num_host_alloc"] + 1
    assert after["host_alloc_time.count"] == before["host_alloc_time.count"] + 1
    nested = torch.neuron.host_memory_stats_as_nested_dict()
    assert nested["allocated_bytes"]["current"] == after["allocated_bytes.current"]
    del p
    freed = torch.neuron.host_memory_stats()
    assert freed["allocations.freed"] == before["allocations.freed"] + 1 and freed["num_host_free"] == before["num_host_free"] + 1
    assert freed["allocated_bytes.current"] == before["allocated_bytes.current"]


def test_host_memory_stats_reset_peak_and_accumulated():
    p = torch.empty(MiB, dtype=torch.uint8).pin_memory("neuron")
    del p
    torch.neuron.reset_peak_host_memory_stats()
    stats = torch.neuron.host_memory_stats()
    assert stats["allocated_bytes.peak"] == stats["allocated_bytes.current"]
    torch.neuron.reset_accumulated_host_memory_stats()
    stats = torch.neuron.host_memory_stats()
    assert stats["allocations.allocated"] == stats["allocations.freed"] == 0
    assert stats["num_host_alloc"] == stats["num_host_free"] == stats["host_alloc_time.count"] == 0


def test_list_gpu_processes_names_the_device():
    assert torch.neuron.list_gpu_processes(1) == "neuron:1: emulated device, used only by this process"


# --- the summary table -------------------------------------------------------------------------
def _row(summary: str, label: str) -> list[str]:
    line = next(l for l in summary.splitlines() if l.startswith(f" {label}"))
    return [c.strip() for c in line.split("|")[1:]]


def test_summary_rows_are_the_statistics_formatted():
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="neuron:1")
    s = _stats(1)
    text = torch.neuron.memory_summary(1)
    assert text.startswith("=" * 75 + "\n neuron:1 memory summary (capacity 24.00 GiB, platform trn2)\n")
    cur = s["allocated_bytes.all.current"] / MiB
    assert _row(text, "Allocated memory")[0] == f"{cur:.2f} MiB"
    assert _row(text, "Allocations")[0] == str(s["allocation.all.current"])
    assert _row(text, "Segments")[:2] == [str(s["segment.all.current"]), str(s["segment.all.peak"])]
    assert _row(text, "  from large pool")  # full table: a row per pool
    assert f"OOMs: {s['num_ooms']}   alloc retries: {s['num_alloc_retries']}" in text
    assert f"device allocs: {s['num_device_alloc']}   device frees: {s['num_device_free']}" in text
    assert text.endswith("=" * 75 + "\n")
    del x


def test_abbreviated_summary_has_no_pool_rows():
    text = torch.neuron.memory_summary(abbreviated=True)
    assert "from large pool" not in text and "from small pool" not in text
    assert "Allocated memory" in text and "Reserved memory" in text


@pytest.mark.parametrize("n,text", [(0, "      0 B  "), (1023, "   1023 B  "), (1024, "   1.00 KiB"),
                                    (1536 * 1024, "   1.50 MiB"), (5 << 30, "   5.00 GiB"),
                                    (3 << 40, "   3.00 TiB"), (1 << 50, "1024.00 TiB")])
def test_byte_cells_use_binary_units(n, text):
    assert torch.neuron.memory._fmt(n) == text


# --- history and snapshots -------------------------------------------------------------------
def test_record_history_true_and_false_mean_all_and_off():
    mem = torch.neuron.memory
    mem._record_memory_history(True, stacks="python")
    try:
        x = torch.empty(MiB, dtype=torch.uint8, device="neuron")
        addr = x.data_ptr()
        del x
        actions = [e["action"] for e in mem._snapshot()["device_traces"][0] if e["addr"] == addr]
        assert actions[-2:] == ["alloc", "free_requested"] or "alloc" in actions
    finally:
        mem._record_memory_history(False)
    assert mem._snapshot()["device_traces"][0] == []


def test_clear_history_forgets_earlier_actions():
    mem = torch.neuron.memory
    mem._record_memory_history(stacks="python")
    try:
        x = torch.empty(MiB, dtype=torch.uint8, device="neuron")
        del x
        mem._record_memory_history(stacks="python", clear_history=True)
        assert mem._snapshot()["device_traces"][0] == []
    finally:
        mem._record_memory_history(None)


def test_max_entries_keeps_the_most_recent_actions():
    mem = torch.neuron.memory
    mem._record_memory_history(stacks="python", max_entries=3)
    try:
        xs = [torch.empty(MiB, dtype=torch.uint8, device="neuron") for _ in range(4)]
        del xs
        assert len(mem._snapshot()["device_traces"][0]) == 3
    finally:
        mem._record_memory_history(None)


def test_dump_snapshot_pickles_the_snapshot(tmp_path):
    x = torch.empty(MiB, dtype=torch.uint8, device="neuron")
    path = tmp_path / "snap.pickle"
    torch.neuron.memory._dump_snapshot(str(path))
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) >= {"segments", "device_traces"}
    assert any(b["address"] == x.data_ptr() for s in snap["segments"] for b in s["blocks"])
    del x


def _cell(v: int, is_bytes: bool) -> str:
    """A cell of CUDA's memory_summary, written out independently: bytes below 1 KiB as an
    integer, else two decimals of the largest binary unit below the value."""
    if not is_bytes:
        return str(v)
    if abs(v) < 1024:
        return f"{v} B"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {unit}"


ROWS = [("Allocated memory", "allocated_bytes", True), ("Active memory", "active_bytes", True),
        ("Requested memory", "requested_bytes", True), ("Reserved memory", "reserved_bytes", True),
        ("Allocations", "allocation", False), ("Active allocs", "active", False),
        ("Segments", "segment", False)]


def test_every_summary_cell_is_its_statistic():
    freed = [torch.empty(n, dtype=torch.uint8, device="neuron:1") for n in (2 * MiB, 500)]
    del freed  # non-zero "freed" totals in both pools
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(64 << 30, dtype=torch.uint8, device="neuron:1")  # an OOM and its retry
    x = torch.empty(3 * MiB + 5, dtype=torch.uint8, device="neuron:1")
    y = torch.empty(1000, dtype=torch.uint8, device="neuron:1")
    s = _stats(1)
    assert s["num_ooms"] >= 1 and s["num_alloc_retries"] >= 1
    text = torch.neuron.memory_summary(1)
    lines = text.splitlines()
    assert lines[2] == "-" * 75
    # rules between the header and each metric's group of rows
    assert [l for l in lines if "|" not in l and l.startswith("-")] == ["-" * 75] * (2 + len(ROWS))
    assert (f" OOMs: {s['num_ooms']}   alloc retries: {s['num_alloc_retries']}   device allocs: "
            f"{s['num_device_alloc']}   device frees: {s['num_device_free']}") in lines
    assert [c.strip() for c in lines[3].split("|")] == ["Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"]
    body = [l for l in lines if "|" in l][1:]
    expected = []
    for title, key, is_bytes in ROWS:
        for pool, label in (("all", title), ("large_pool", "  from large pool"), ("small_pool", "  from small pool")):
            cells = [_cell(s.get(f"{key}.{pool}.{m}", 0), is_bytes) for m in ("current", "peak", "allocated", "freed")]
            expected.append([label] + cells)
    got = [[l.split("|")[0][1:].rstrip()] + [c.strip() for c in l.split("|")[1:]] for l in body]
    assert got == expected
    del x, y


def test_reset_max_memory_allocated_resets_the_device_it_names():
    x = torch.empty(8 * MiB, dtype=torch.uint8, device="neuron:1")
    del x
    torch.neuron.reset_max_memory_allocated(1)
    assert torch.neuron.max_memory_allocated(1) == torch.neuron.memory_allocated(1)


def test_dump_snapshot_without_a_name_writes_dump_snapshot_pickle(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.neuron.memory._dump_snapshot()
    assert [p.name for p in tmp_path.iterdir()] == ["dump_snapshot.pickle"]
    with open(tmp_path / "dump_snapshot.pickle", "rb") as f:
        assert set(pickle.load(f)) >= {"segments", "device_traces"}


def test_memory_snapshot_is_the_list_of_segments_with_the_live_block():
    x = torch.empty(MiB, dtype=torch.uint8, device="neuron")
    segs = torch.neuron.memory_snapshot()
    assert isinstance(segs, list) and segs == torch.neuron.memory._snapshot()["segments"]
    assert any(b["address"] == x.data_ptr() and b["state"] == "active_allocated"
               for s in segs for b in s["blocks"])
    del x


def test_enabling_history_again_without_clearing_keeps_earlier_actions():
    mem = torch.neuron.memory
    mem._record_memory_history(stacks="python")
    try:
        x = torch.empty(MiB, dtype=torch.uint8, device="neuron")
        addr = x.data_ptr()
        mem._record_memory_history(stacks="python")
        assert any(e["action"] == "alloc" and e["addr"] == addr for e in mem._snapshot()["device_traces"][0])
        del x
    finally:
        mem._record_memory_history(None)


def test_history_keeps_every_action_by_default():
    mem = torch.neuron.memory
    mem._record_memory_history(stacks="python")
    try:
        xs = [torch.empty(512, dtype=torch.uint8, device="neuron") for _ in range(150)]
        addrs = {x.data_ptr() for x in xs}
        allocs = [e for e in mem._snapshot()["device_traces"][0] if e["action"] == "alloc" and e["addr"] in addrs]
        assert len(allocs) == 150
        del xs
    finally:
        mem._record_memory_history(None)


def test_snapshot_before_the_runtime_starts_is_empty_for_every_device(monkeypatch):
    monkeypatch.setattr(torch.neuron, "is_initialized", lambda: False)
    n = torch.neuron.device_count()
    assert torch.neuron.memory._snapshot() == {"segments": [], "device_traces": [[] for _ in range(n)],
                                               "allocator_settings": {"device": "neuron"}}


def test_empty_cache_before_the_runtime_starts_does_not_start_it(monkeypatch):
    called = []
    monkeypatch.setattr(torch.neuron, "is_initialized", lambda: False)
    monkeypatch.setattr(torch._C, "_accelerator_emptyCache", lambda: called.append(1))
    torch.neuron.empty_cache()
    assert called == []


def test_history_with_default_arguments_records_every_alloc_with_its_stack():
    mem = torch.neuron.memory
    mem._record_memory_history()
    try:
        x = torch.empty(MiB, dtype=torch.uint8, device="neuron")
        [alloc] = [e for e in mem._snapshot()["device_traces"][0] if e["action"] == "alloc" and e["addr"] == x.data_ptr()]
        assert any(f["filename"] == __file__ for f in alloc["frames"])
        del x
    finally:
        mem._record_memory_history(None)


# --- an allocator that reports no statistic (CUDA's accessors read such a counter as 0) --------
@pytest.fixture
def no_statistics(monkeypatch):
    from collections import OrderedDict
    monkeypatch.setattr(torch.accelerator, "memory_stats", lambda device=None: OrderedDict())


def test_accessors_read_zero_for_missing_statistics(no_statistics):
    assert (torch.neuron.memory_allocated(0), torch.neuron.max_memory_allocated(0),
            torch.neuron.memory_reserved(0), torch.neuron.max_memory_reserved(0)) == (0, 0, 0, 0)


def test_summary_shows_zero_for_missing_statistics(no_statistics):
    lines = torch.neuron.memory_summary(0).splitlines()
    rows = [[c.strip() for c in l.split("|")[1:]] for l in lines if "|" in l][1:]
    assert len(rows) == 3 * len(ROWS)
    assert rows == [["0 B"] * 4] * (3 * 4) + [["0"] * 4] * (3 * 3)
    assert " OOMs: 0   alloc retries: 0   device allocs: 0   device frees: 0" in lines


def _block_at(address):
    for seg in torch.neuron.memory_snapshot():
        for b in seg["blocks"]:
            if b["address"] == address:
                return seg, b
    return None, None


def test_caching_allocator_alloc_takes_a_block_of_the_streams_pool_until_deleted():
    """As torch.cuda.caching_allocator_alloc/_delete: raw device memory from the caching allocator,
    counted by the statistics, on the given stream's pool."""
    side = torch.neuron.Stream()
    base = torch.neuron.memory_allocated()
    address = torch.neuron.caching_allocator_alloc(3 * MiB, 0, side)
    assert torch.neuron.memory_allocated() - base == 3 * MiB
    seg, block = _block_at(address)
    assert block["state"] == "active_allocated" and seg["stream"] == side.stream_id
    torch.neuron.caching_allocator_delete(address)
    assert torch.neuron.memory_allocated() == base
    assert _block_at(address)[1]["state"] == "inactive"  # cached, back in the pool
    default = torch.neuron.caching_allocator_alloc(MiB)
    assert _block_at(default)[0]["stream"] == 0
    torch.neuron.caching_allocator_delete(default)


def test_caching_allocator_delete_rejects_unknown_addresses_and_bad_streams():
    address = torch.neuron.caching_allocator_alloc(MiB)
    torch.neuron.caching_allocator_delete(address)
    with pytest.raises(RuntimeError, match="invalid device pointer"):
        torch.neuron.caching_allocator_delete(address)
    with pytest.raises(TypeError, match="Invalid type for stream argument"):
        torch.neuron.caching_allocator_alloc(MiB, 0, 5)


def test_nested_stats_hold_the_flat_stats():
    x = torch.empty(2 * MiB, dtype=torch.uint8, device="neuron")
    flat = torch.neuron.memory_stats()
    nested = torch.neuron.memory_stats_as_nested_dict()
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"]
    assert nested["num_alloc_retries"] == flat["num_alloc_retries"]
    leaves = []

    def walk(node, path):
        for k, v in node.items():
            walk(v, path + [k]) if isinstance(v, dict) else leaves.append((".".join(path + [k]), v))
    walk(nested, [])
    assert dict(leaves) == dict(flat)
    del x


def test_deprecated_cached_names_warn_and_read_the_reserved_counters():
    x = torch.empty(2 * MiB, dtype=torch.uint8, device="neuron")
    with pytest.warns(FutureWarning, match="memory_reserved"):
        assert torch.neuron.memory_cached() == torch.neuron.memory_reserved()
    with pytest.warns(FutureWarning, match="max_memory_reserved"):
        assert torch.neuron.max_memory_cached() == torch.neuron.max_memory_reserved()
    del x
    torch.neuron.empty_cache()
    with pytest.warns(FutureWarning, match="reset_peak_memory_stats"):
        torch.neuron.reset_max_memory_cached()
    assert torch.neuron.max_memory_reserved() == torch.neuron.memory_reserved()


def test_allocator_backend_and_device_memory_used():
    assert torch.neuron.get_allocator_backend() == "native"
    x = torch.empty(4 * MiB, dtype=torch.uint8, device="neuron")
    assert torch.neuron.device_memory_used() >= torch.neuron.memory_reserved() >= 4 * MiB
    assert torch.neuron.device_memory_used() == torch.neuron.mem_get_info()[1] - torch.neuron.mem_get_info()[0]
    del x
