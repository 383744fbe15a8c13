"""torch.accelerator against neuron, in the manner of PyTorch's test_accelerator.py (device
selection, stream and event semantics, memory statistics), written for this suite."""

import pytest
import torch

acc = torch.accelerator


def test_current_accelerator_is_neuron():
    assert acc.is_available()
    assert acc.current_accelerator() == torch.device("neuron")
    assert acc.current_accelerator(check_available=True).type == "neuron"
    assert acc.device_count() == torch.neuron.device_count() >= 1


def test_set_device_index_and_current_device_index():
    if acc.device_count() < 2:
        pytest.skip("needs two neuron devices")
    prev = acc.current_device_index()
    try:
        acc.set_device_index(1)
        assert acc.current_device_index() == 1 == torch.neuron.current_device()
        assert torch.empty(1, device="neuron").device.index == 1
    finally:
        acc.set_device_index(prev)


def test_device_index_context_manager_restores():
    if acc.device_count() < 2:
        pytest.skip("needs two neuron devices")
    prev = acc.current_device_index()
    with acc.device_index(1):
        assert acc.current_device_index() == 1
    assert acc.current_device_index() == prev
    with acc.device_index(None):  # None: no change
        assert acc.current_device_index() == prev


def test_set_device_index_out_of_range_is_refused():
    with pytest.raises((RuntimeError, IndexError), match="Invalid device index"):
        acc.set_device_index(acc.device_count())


def test_set_stream_and_current_stream():
    s1, s2 = torch.Stream(), torch.Stream()
    prev = acc.current_stream()
    try:
        acc.set_stream(s1)
        assert acc.current_stream() == s1
        acc.set_stream(s2)
        assert acc.current_stream() == s2
    finally:
        acc.set_stream(prev)
    assert acc.current_stream() == prev


def test_stream_context_manager_nested_restores():
    s1, s2 = torch.Stream(), torch.Stream()
    prev = acc.current_stream()
    with s1:
        assert acc.current_stream() == s1
        with s2:
            assert acc.current_stream() == s2
        assert acc.current_stream() == s1
    assert acc.current_stream() == prev


def test_stream_on_another_device_switches_device_in_context():
    if acc.device_count() < 2:
        pytest.skip("needs two neuron devices")
    prev = acc.current_device_index()
    s = torch.Stream(device=torch.device("neuron", 1))
    with s:
        assert acc.current_device_index() == 1
        assert acc.current_stream(1) == s
    assert acc.current_device_index() == prev


def test_event_record_wait_synchronize_query():
    s1, s2 = torch.Stream(), torch.Stream()
    ev = torch.Event(enable_timing=True)
    a = torch.randn(64, 64, device="neuron")
    with s2:
        b = a @ a
        ev.record(s2)
    s1.wait_event(ev)
    ev.synchronize()
    assert ev.query() and s1.query() and s2.query()
    torch.testing.assert_close(b.cpu(), a.cpu() @ a.cpu())


def test_event_elapsed_time_is_non_negative():
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    torch.randn(256, 256, device="neuron").sum()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0


def test_synchronize_accepts_index_and_device():
    acc.synchronize()
    acc.synchronize(0)
    acc.synchronize(torch.device("neuron", 0))


def test_memory_statistics_follow_allocations():
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    x = torch.empty(1 << 20, dtype=torch.uint8, device="neuron")
    assert acc.memory_allocated() >= before + (1 << 20)
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.memory_reserved() >= acc.memory_allocated()
    stats = acc.memory_stats()
    assert stats["allocated_bytes.all.current"] == acc.memory_allocated()
    del x
    assert acc.memory_allocated() == before
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == acc.memory_allocated()


def test_get_memory_info_reports_free_and_total():
    free, total = acc.get_memory_info()
    assert 0 <= free <= total and total == torch.neuron.get_device_properties(0).total_memory


def _all_dtypes():
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _converts(dtype) -> bool:
    try:
        x = torch.ones(4, dtype=torch.float32, device="neuron").to(dtype)
        x.to(torch.float32).cpu()
        torch.ones(4, dtype=torch.int64).to(dtype).to("neuron").to(torch.bool)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def test_device_capability_lists_exactly_the_dtypes_that_allocate_and_convert():
    # torch's contract for supported_dtypes: allocation and conversion between them work.
    listed = acc.get_device_capability()["supported_dtypes"]
    working = {d for d in _all_dtypes() if _converts(d)}
    assert set(listed) == working
    assert {torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.complex32} <= set(listed)
    assert torch.qint8 not in listed and torch.bits8 not in listed
