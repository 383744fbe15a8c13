"""Stream sanitizer (torch.neuron._sanitizer): races between streams are reported with both
stacks; every ordering primitive (wait_stream, event record/wait, stream / event / device
synchronize, a blocking copy to the host, the same stream) prevents a report."""

import pytest
import torch

from support import run_python

from torchneuron.neuron import _gpu_trace
from torchneuron.neuron import _sanitizer as nsan

N = 256


@pytest.fixture
def sanitizer():
    """A fresh sanitizer for one test (its own vector clocks and access table)."""
    san = nsan.NeuronSanitizer()
    san.enable()
    try:
        yield san
    finally:
        san.disable()
        san.dispatch.close()


@pytest.fixture
def streams():
    return torch.neuron.Stream(), torch.neuron.Stream()


def write_on(stream, x):
    with torch.neuron.stream(stream):
        x.add_(1)


def read_on(stream, x):
    with torch.neuron.stream(stream):
        return x.sum()


def fresh(stream):
    with torch.neuron.stream(stream):
        return torch.zeros(N, device="neuron")


# --- true positives ----------------------------------------------------------------------

def test_read_after_write_on_another_stream_is_reported(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    with pytest.raises(nsan.NeuronSanitizerErrors) as info:
        read_on(s2, x)
    (err,) = info.value.errors
    assert isinstance(err, nsan.NeuronUnsynchronizedAccessError)
    assert err.current_access.type is nsan._csan.AccessType.READ
    assert err.previous_access.type is nsan._csan.AccessType.WRITE
    assert _gpu_trace.decode_stream(err.current_access.stream) == (0, s2.stream_id)
    assert _gpu_trace.decode_stream(err.previous_access.stream) == (0, s1.stream_id)
    assert err.data_ptr == x.data_ptr()


def test_write_after_write_on_another_stream_is_reported(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    with pytest.raises(nsan.NeuronSanitizerErrors) as info:
        write_on(s2, x)
    (err,) = info.value.errors
    assert err.current_access.type is nsan._csan.AccessType.WRITE
    assert err.previous_access.type is nsan._csan.AccessType.WRITE


def test_write_after_read_on_another_stream_is_reported(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    s2.wait_stream(s1)
    read_on(s1, x)
    with pytest.raises(nsan.NeuronSanitizerErrors) as info:
        write_on(s2, x)
    (err,) = info.value.errors
    assert err.current_access.type is nsan._csan.AccessType.WRITE
    assert err.previous_access.type is nsan._csan.AccessType.READ


def test_report_names_tensor_streams_and_both_stacks(sanitizer, streams, capsys):
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    with pytest.raises(nsan.NeuronSanitizerErrors) as info:
        read_on(s2, x)
    text = str(info.value)
    assert f"[{N}] float32 on neuron:0" in text
    assert f"Access by neuron:0 stream {s2.stream_id}" in text
    assert f"Previous access by neuron:0 stream {s1.stream_id}" in text
    # Both Python stacks: the reading and the writing helper, called from this test.
    assert text.count("test_report_names_tensor_streams_and_both_stacks") >= 2
    assert "in read_on" in text and "in write_on" in text
    assert "aten::add_" in text and "aten::sum" in text
    assert "Tensor was allocated with stack trace" in text and "in fresh" in text
    assert "possible data race" in capsys.readouterr().err  # printed, as CUDA's


def test_event_recorded_before_the_write_does_not_order_it(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    e = s1.record_event()
    write_on(s1, x)  # after the record
    s2.wait_event(e)
    with pytest.raises(nsan.NeuronSanitizerErrors):
        read_on(s2, x)


def test_synchronizing_another_device_does_not_order_this_one(sanitizer):
    s1, s2 = torch.neuron.Stream(device=0), torch.neuron.Stream(device=0)
    x = fresh(s1)
    write_on(s1, x)
    torch.neuron.synchronize(1)
    with pytest.raises(nsan.NeuronSanitizerErrors):
        read_on(s2, x)


def test_streams_of_the_tensors_device_are_used_not_the_current_device(sanitizer):
    s1 = torch.neuron.Stream(device=1)
    with torch.neuron.stream(s1):
        x = torch.zeros(N, device="neuron:1")
        x.add_(1)
    # Current device 0; the op runs on neuron:1's current (default) stream.
    with pytest.raises(nsan.NeuronSanitizerErrors) as info:
        x.sum()
    assert _gpu_trace.decode_stream(info.value.errors[0].current_access.stream) == (1, 0)


# --- false positives avoided ----------------------------------------------------------------

def test_same_stream_is_ordered(sanitizer, streams):
    s1, _ = streams
    x = fresh(s1)
    write_on(s1, x)
    read_on(s1, x)
    write_on(s1, x)


def test_reads_on_two_streams_do_not_race(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    s2.wait_stream(s1)
    read_on(s1, x)
    read_on(s2, x)


def test_wait_stream_orders(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    s2.wait_stream(s1)
    read_on(s2, x)
    s1.wait_stream(s2)
    write_on(s1, x)


def test_event_record_and_wait_orders(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    e = torch.neuron.Event()
    e.record(s1)
    e.wait(s2)
    read_on(s2, x)


def test_stream_synchronize_orders(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    s1.synchronize()
    write_on(s2, x)


def test_event_synchronize_orders(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    s1.record_event().synchronize()
    write_on(s2, x)


def test_device_synchronize_orders(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    torch.neuron.synchronize()
    write_on(s2, x)


def test_blocking_copy_to_host_orders_its_stream(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    with torch.neuron.stream(s1):
        assert x.cpu().sum().item() == N  # the host waited for s1, after the copy read x
    write_on(s2, x)
    with torch.neuron.stream(s2):
        assert x[0].item() == 2
    write_on(s1, x)


def test_non_blocking_copy_to_host_does_not_order(sanitizer, streams):
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    with torch.neuron.stream(s1):
        x.to("cpu", non_blocking=True)
    with pytest.raises(nsan.NeuronSanitizerErrors):
        write_on(s2, x)


def test_training_step_on_one_stream_is_clean(sanitizer):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.to("neuron")
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        loss = model(torch.randn(8, 16, device="neuron")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()


def test_disabled_sanitizer_reports_nothing(streams):
    san = nsan.NeuronSanitizer()
    san.enable()
    san.disable()
    san.dispatch.close()
    s1, s2 = streams
    x = fresh(s1)
    write_on(s1, x)
    read_on(s2, x)  # no mode: no check


# --- enabling ---------------------------------------------------------------------------

RACE = ("import torch\n"
        "s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()\n"
        "with torch.neuron.stream(s1):\n"
        "    x = torch.ones(4, device='neuron'); x.mul_(2)\n"
        "with torch.neuron.stream(s2):\n"
        "    y = x + 1\n"
        "print('no report')\n")


def test_environment_variable_enables_it_at_load():
    r = run_python(RACE, env={"TORCHNEURON_STREAM_SANITIZER": "1"})
    assert r.returncode != 0
    assert "NeuronSanitizerErrors" in r.stderr and "possible data race" in r.stderr
    assert "no report" not in r.stdout


def test_without_the_variable_nothing_is_checked():
    r = run_python(RACE, env={"TORCHNEURON_STREAM_SANITIZER": "0"})
    assert r.returncode == 0 and "no report" in r.stdout, r.stderr[-2000:]


def test_api_enables_it_like_cuda():
    r = run_python("import torch\ntorch.neuron._sanitizer.enable_neuron_sanitizer()\n" + RACE)
    assert r.returncode != 0 and "possible data race" in r.stderr


def test_bad_environment_value_is_rejected():
    r = run_python("import torch", env={"TORCHNEURON_STREAM_SANITIZER": "yes"})
    assert r.returncode != 0 and "TORCHNEURON_STREAM_SANITIZER='yes'" in r.stderr


def test_gpu_trace_reports_streams_events_syncs_and_memory():
    seen = []
    regs = {name: getattr(_gpu_trace, name) for name in dir(_gpu_trace) if name.endswith("Callbacks")}
    cbs = {name: (lambda *a, _n=name: seen.append((_n, a))) for name in regs}
    for name, cb in cbs.items():
        regs[name].add_callback(cb)
    _gpu_trace.activate()
    try:
        s = torch.neuron.Stream(device=2)  # a device no other test used: a new stream
        with torch.neuron.stream(s):
            x = torch.ones(1000, device="neuron:2")
            e = s.record_event()
        torch.neuron.default_stream(2).wait_event(e)
        e.synchronize()
        s.synchronize()
        torch.neuron.synchronize(2)
        details = []
        _gpu_trace.DeviceSynchronizationCallbacks.add_callback(
            lambda: details.append(_gpu_trace.trace_details()))
        torch.neuron.synchronize(3)
        ptr = x.data_ptr()
        del x, e
    finally:
        _gpu_trace.deactivate()
        for name, cb in cbs.items():
            regs[name].callback_list.remove(cb)
        _gpu_trace.DeviceSynchronizationCallbacks.callback_list.pop()
    kinds = [k for k, _ in seen]
    h = _gpu_trace.encode_stream(2, s.stream_id)
    assert ("StreamCreationCallbacks", (h,)) in seen
    assert ("MemoryAllocationCallbacks", (ptr,)) in seen
    assert ("MemoryDeallocationCallbacks", (ptr,)) in seen
    (event,) = [a[0] for k, a in seen if k == "EventCreationCallbacks"]
    assert ("EventRecordCallbacks", (event, h)) in seen
    assert ("EventWaitCallbacks", (event, _gpu_trace.encode_stream(2, 0))) in seen
    assert ("EventSynchronizationCallbacks", (event,)) in seen
    assert ("StreamSynchronizationCallbacks", (h,)) in seen
    assert ("EventDeletionCallbacks", (event,)) in seen
    assert kinds.count("DeviceSynchronizationCallbacks") == 2
    assert details == [(3, 0)]


def test_gpu_trace_is_silent_until_activated():
    seen = []
    cb = seen.append
    _gpu_trace.MemoryAllocationCallbacks.add_callback(cb)
    try:
        torch._C._activate_gpu_trace()  # PyTorch's switch alone (a CUDA tool) is not enough
        torch.ones(10, device="neuron")
    finally:
        _gpu_trace.MemoryAllocationCallbacks.callback_list.remove(cb)
    assert seen == []
