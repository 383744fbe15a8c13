"""Streams and events: API and ordering semantics, across devices and threads, real timing."""

import threading
import time

import pytest
import torch


def test_default_and_current_stream():
    s = torch.neuron.current_stream()
    assert s == torch.neuron.default_stream()
    assert s.stream_id == 0 and s.device_index == torch.neuron.current_device()
    assert torch.accelerator.current_stream().device.type == "neuron"


def test_stream_context_sets_and_restores_current_stream():
    s = torch.neuron.Stream()
    assert s != torch.neuron.default_stream()
    with torch.neuron.stream(s):
        assert torch.neuron.current_stream() == s
        x = torch.ones(4, device="neuron") * 2
    assert torch.neuron.current_stream() == torch.neuron.default_stream()
    assert x.sum().item() == 8


def test_torch_stream_context_manager_and_accelerator_api():
    s = torch.Stream(device="neuron")
    with s:
        assert torch.accelerator.current_stream() == s
    prev = torch.accelerator.current_stream()
    torch.accelerator.set_stream(s)
    assert torch.accelerator.current_stream() == s
    torch.accelerator.set_stream(prev)
    torch.accelerator.synchronize()


def test_stream_on_another_device_switches_device_in_context():
    s = torch.neuron.Stream(device="neuron:1")
    assert s.device_index == 1
    with torch.neuron.stream(s):
        assert torch.neuron.current_device() == 1
        assert torch.neuron.current_stream() == s
    assert torch.neuron.current_device() == 0


def test_high_priority_streams_come_from_their_own_pool():
    lo, hi = torch.neuron.Stream(priority=0), torch.neuron.Stream(priority=-1)
    assert lo.priority == 0 and hi.priority == -1


def test_wait_event_wait_stream_query_synchronize():
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    with torch.neuron.stream(s1):
        x = torch.randn(64, 64, device="neuron") @ torch.randn(64, 64, device="neuron")
        e = s1.record_event()
    s2.wait_event(e)
    s2.wait_stream(s1)
    with torch.neuron.stream(s2):
        y = x + 1  # ordered after s1's work
    assert e.query() and s1.query() and s2.query()
    s2.synchronize()
    e.synchronize()
    torch.neuron.synchronize()
    torch.testing.assert_close(y.cpu(), x.cpu() + 1)


def test_elapsed_time_measures_real_time():
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    time.sleep(0.05)
    end.record()
    end.synchronize()
    assert 45 <= start.elapsed_time(end) < 1000


def test_elapsed_time_requires_timing_and_recording():
    a, b = torch.neuron.Event(), torch.neuron.Event()
    a.record()
    b.record()
    with pytest.raises((RuntimeError, ValueError), match="enable_timing"):
        a.elapsed_time(b)
    c, d = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    with pytest.raises((RuntimeError, ValueError), match="recorded"):
        c.elapsed_time(d)


def test_event_isinstance_and_torch_event_interop():
    e = torch.neuron.Event()
    assert isinstance(e, torch.neuron.Event) and isinstance(e, torch.Event)
    torch.neuron.current_stream().record_event(e)
    assert e.query()


def test_current_stream_is_per_thread():
    s = torch.neuron.Stream()
    seen = {}

    def worker():
        seen["other"] = torch.neuron.current_stream()
        with torch.neuron.stream(s):
            seen["inner"] = torch.neuron.current_stream()

    with torch.neuron.stream(torch.neuron.Stream()):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen["other"] == torch.neuron.default_stream()
    assert seen["inner"] == s


def test_current_device_is_per_thread():
    result = {}

    def worker():
        torch.neuron.set_device(2)
        result["dev"] = torch.ones(1, device="neuron").device

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert result["dev"] == torch.device("neuron:2")
    assert torch.neuron.current_device() == 0


def test_device_context_manager():
    with torch.neuron.device(3):
        assert torch.zeros(1, device="neuron").device.index == 3
    assert torch.neuron.current_device() == 0


def test_streams_from_many_threads_concurrently():
    errors = []

    def worker(i):
        try:
            s = torch.neuron.Stream(device=i % torch.neuron.device_count())
            with torch.neuron.stream(s):
                for _ in range(20):
                    x = torch.randn(32, 32, device=s.device)
                    y = (x @ x).sum()
                    e = s.record_event()
                    e.synchronize()
                    assert y.device == s.device
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
