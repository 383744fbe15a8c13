"""Streams and events: API and ordering semantics, across devices and threads, real timing,
stream-ordered memory reuse (record_stream)."""

import gc
import threading
import time

import pytest
import torch

from support import run_python



def poll(query, tries: int = 1000) -> bool:
    """Query until true, as CUDA code must: a query is false while queued work is pending (the
    execution engine, on by default) and true at once without it."""
    return any(query() for _ in range(tries))

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
    assert poll(e.query) and poll(s1.query) and poll(s2.query)
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


# --- stream-ordered memory reuse (record_stream) --------------------------------------------

MiB = 1 << 20
# 12 MiB is its own size class and its own segment (no remainder to split off), so after
# empty_cache() the next 12 MiB request on the stream reuses that block and no other.
BIG = 12 * MiB


def _block_state(ptr):
    for seg in torch.neuron.memory_snapshot():
        for b in seg["blocks"]:
            if b["address"] == ptr:
                return b["state"]
    return None


def _used_on(stream):
    """A tensor allocated on the current stream, used on ``stream`` and recorded there, in a
    cache holding no other free block."""
    gc.collect()
    torch.neuron.empty_cache()
    x = torch.ones(BIG // 4, device="neuron")
    stream.wait_stream(torch.neuron.current_stream())
    with torch.neuron.stream(stream):
        x.mul_(2)
    x.record_stream(stream)
    return x


def _big():
    return torch.empty(BIG // 4, device="neuron")


def test_block_freed_without_record_stream_is_reused_at_once():
    gc.collect()
    torch.neuron.empty_cache()
    s = torch.neuron.Stream()
    x = torch.ones(BIG // 4, device="neuron")
    with torch.neuron.stream(s):
        x.mul_(2)
    ptr = x.data_ptr()
    del x
    assert _big().data_ptr() == ptr


def test_block_recorded_on_another_stream_is_not_reused_before_that_stream_is_observed():
    s = torch.neuron.Stream()
    x = _used_on(s)
    ptr = x.data_ptr()
    before = torch.neuron.memory_stats()
    del x
    after = torch.neuron.memory_stats()
    # Freed for the owner (allocated drops), still active (another stream may use it).
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] - BIG
    assert after["allocation.all.current"] == before["allocation.all.current"] - 1
    assert after["active_bytes.all.current"] == before["active_bytes.all.current"]
    assert after["active.all.current"] == before["active.all.current"]
    assert _block_state(ptr) == "active_pending_free"
    y = _big()
    assert y.data_ptr() != ptr
    s.synchronize()
    z = _big()  # the next allocation returns the block to the pool first
    assert z.data_ptr() == ptr and _block_state(ptr) == "active_allocated"
    final = torch.neuron.memory_stats()
    assert final["active_bytes.all.current"] == after["active_bytes.all.current"] + BIG
    assert final["allocated_bytes.all.current"] == after["allocated_bytes.all.current"] + 2 * BIG


@pytest.mark.parametrize("observe", [
    "stream_synchronize", "device_synchronize", "event_synchronize", "event_query",
    "stream_query", "item_on_stream", "cpu_on_stream", "empty_cache"])
def test_each_host_observation_of_the_stream_releases_the_block(observe):
    s = torch.neuron.Stream()
    probe = torch.ones(4, device="neuron")
    x = _used_on(s)
    ptr = x.data_ptr()
    del x
    if observe == "stream_synchronize":
        s.synchronize()
    elif observe == "device_synchronize":
        torch.neuron.synchronize()
    elif observe == "event_synchronize":
        s.record_event().synchronize()
    elif observe == "event_query":
        assert poll(s.record_event().query)
    elif observe == "stream_query":
        assert poll(s.query)
    elif observe == "item_on_stream":
        with torch.neuron.stream(s):
            probe[0].item()
    elif observe == "cpu_on_stream":
        with torch.neuron.stream(s):
            probe.cpu()
    else:
        torch.neuron.empty_cache()  # synchronizes pending frees, then releases free segments
        assert _block_state(ptr) is None
        return
    assert _big().data_ptr() == ptr


@pytest.mark.parametrize("not_an_observation", [
    "wait_stream", "other_stream_synchronize", "other_device_synchronize", "non_blocking_cpu",
    "event_recorded_before_the_free"])
def test_ordering_without_host_observation_keeps_the_block_pending(not_an_observation):
    s = torch.neuron.Stream()
    other = torch.neuron.Stream()
    assert s != other
    probe = torch.ones(4, device="neuron")
    x = _used_on(s)
    ptr = x.data_ptr()
    early = s.record_event()
    del x
    if not_an_observation == "wait_stream":
        torch.neuron.current_stream().wait_stream(s)
    elif not_an_observation == "other_stream_synchronize":
        other.synchronize()
    elif not_an_observation == "other_device_synchronize":
        torch.neuron.synchronize(1)
    elif not_an_observation == "non_blocking_cpu":
        with torch.neuron.stream(s):
            probe.to("cpu", non_blocking=True)
    else:
        early.synchronize()
    y = _big()
    assert y.data_ptr() != ptr and _block_state(ptr) == "active_pending_free"
    s.synchronize()
    assert _big().data_ptr() == ptr


def test_adopted_memory_waits_for_recorded_streams_too():
    s = torch.neuron.Stream()
    warm = torch.empty(1, device="neuron")
    del warm  # a cached small block: the allocation below needs no new segment
    y = torch.ones(1000, device="neuron").nonzero()  # a CPU kernel's result, adopted
    ptr, nbytes = y.data_ptr(), y.untyped_storage().nbytes()
    (seg,) = [g for g in torch.neuron.memory_snapshot() if g["address"] == ptr]
    assert seg["total_size"] == nbytes  # its own segment, not the caching allocator's
    y.record_stream(s)
    reserved = torch.neuron.memory_reserved()
    del y
    assert _block_state(ptr) == "active_pending_free"
    assert torch.neuron.memory_reserved() == reserved
    torch.empty(1, device="neuron")
    assert _block_state(ptr) == "active_pending_free"  # s not observed yet
    s.synchronize()
    torch.empty(1, device="neuron")
    assert _block_state(ptr) is None
    assert torch.neuron.memory_reserved() == reserved - nbytes


def test_record_stream_on_the_owning_stream_changes_nothing():
    gc.collect()
    torch.neuron.empty_cache()
    x = _big()
    x.record_stream(torch.neuron.current_stream())
    ptr = x.data_ptr()
    del x
    assert _big().data_ptr() == ptr


def test_pending_blocks_are_synchronized_before_out_of_memory():
    code = (
        "import torch\n"
        "s = torch.neuron.Stream()\n"
        "for i in range(40):\n"  # 40 x 8 MiB through a 64 MiB device, each pending on s
        "    x = torch.ones(2 << 20, device='neuron')\n"
        "    with torch.neuron.stream(s):\n"
        "        x.add_(1)\n"
        "    x.record_stream(s)\n"
        "    del x\n"
        "st = torch.neuron.memory_stats()\n"
        "assert st['num_ooms'] == 0 and st['num_alloc_retries'] > 0, st\n"
        "print('ok', st['num_alloc_retries'])\n")
    r = run_python(code, env={"TORCHNEURON_DEVICE_MEMORY": "64MiB"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


# --- events, queries, priorities ----------------------------------------------------------

def test_elapsed_time_between_streams_of_one_device():
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record(s1)
    time.sleep(0.02)
    end.record(s2)
    assert 15 <= start.elapsed_time(end) < 1000
    assert end.elapsed_time(start) < 0  # as cudaEventElapsedTime: order of the two records


def test_elapsed_time_across_devices_is_an_error():
    a = torch.Event(torch.device("neuron:0"), enable_timing=True)
    b = torch.Event(torch.device("neuron:1"), enable_timing=True)
    a.record(torch.neuron.current_stream(0))
    b.record(torch.neuron.current_stream(1))
    with pytest.raises(RuntimeError, match="same device"):
        a.elapsed_time(b)


def test_query_is_true_for_idle_streams_and_unrecorded_events():
    s = torch.neuron.Stream()
    assert s.query() and torch.neuron.Event().query()
    with torch.neuron.stream(s):
        torch.randn(64, 64, device="neuron").sum()  # (queued when the engine is on)
        e = s.record_event()
    s.synchronize()
    assert e.query() and s.query()


def test_priorities_are_reported_and_clamped_to_the_range():
    assert torch.neuron.Stream.priority_range() == (0, -1)
    assert torch.neuron.Stream(priority=-5).priority == -1
    assert torch.neuron.Stream(priority=0).priority == 0
    assert torch.neuron.current_stream().priority == 0
    hi = torch.Stream(device="neuron", priority=-1)
    assert torch.neuron._C._stream_priority(hi.stream_id) == -1
