"""The execution engine (torch.neuron.engine): queued kernels, host run-ahead, synchronization
points, asynchronous errors. Results are compared with CPU PyTorch."""

import gc
import os
import subprocess
import sys
import time

import pytest
import torch

engine = torch.neuron.engine
BIG = 1 << 22  # elements: a few milliseconds per pass, so queued work is observable


pytestmark = pytest.mark.usefixtures("engine_on")  # (tests/conftest.py)


def slow_work(x: torch.Tensor, passes: int = 20) -> None:
    for _ in range(passes):
        x.mul_(1.0001)


def pending() -> bool:
    return torch.neuron.engine.stats()["enqueued"] != torch.neuron.engine.stats()["executed"]


# ---- run-ahead -----------------------------------------------------------------------------

def test_an_in_place_op_returns_before_its_kernel_ran():
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    slow_work(x)
    assert not torch.neuron.current_stream().query()
    torch.neuron.synchronize()
    assert torch.neuron.current_stream().query()
    torch.testing.assert_close(x.cpu(), torch.full((BIG,), 1.0001) ** 20, rtol=0, atol=0)


def test_enqueued_kernels_are_counted():
    x = torch.ones(16, device="neuron")
    before = engine.stats()["enqueued"]
    x.add_(1)
    x.mul_(x)
    _ = x + x
    assert engine.stats()["enqueued"] - before == 3


def test_ops_outside_the_engine_run_synchronously_after_the_queue():
    # sum has no preallocated output: it waits for the queued add_, then sees its result
    x = torch.ones(BIG, device="neuron")
    slow_work(x, 5)
    x.add_(1)
    assert x.sum().item() == pytest.approx(BIG * (1.0001 ** 5 + 1), rel=1e-5)


def test_a_kernel_that_checks_values_before_it_launches_sees_queued_writes():
    p = torch.full((1024,), 3.0, device="neuron")   # not a probability ...
    slow_work(torch.ones(BIG, device="neuron"), 3)
    p.mul_(0.1)                                     # ... until this queued kernel has run
    assert 0 < torch.bernoulli(p).mean().item() < 1


# ---- results: the same as synchronous execution ---------------------------------------------

def test_a_mixed_sequence_matches_cpu_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 33, generator=gen), torch.randn(64, 33, generator=gen)
    out_cpu = torch.empty(64, 33)
    na, nb = a.to("neuron"), b.to("neuron")
    out_n = torch.empty(64, 33, device="neuron")

    def steps(x, y, out):
        x = x * y + y             # hot functional ops, pooled outputs
        x.add_(y, alpha=0.5)      # hot in-place
        x.clamp_(-2, 2)           # boxed in-place
        torch.exp(x, out=out)     # boxed out=
        torch._foreach_mul_([x, y], 1.5)
        z = torch.sin(out).T.contiguous()  # structured functional, a view, a copy
        return x, y, out, z

    want = steps(a, b, out_cpu)
    got = steps(na, nb, out_n)
    for w, g in zip(want, got):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


def test_an_out_the_kernel_must_resize_is_not_queued():
    # logical_and's functional form passes an empty out for its kernel to resize
    x = torch.tensor([True, False])
    n = x.to("neuron")
    got = torch.logical_and(n[0], n[1])
    assert got.shape == torch.Size([]) and got.item() is False
    torch.testing.assert_close(torch.logical_and(n, n).cpu(), torch.logical_and(x, x))


def test_a_foreach_op_is_one_queued_kernel_and_matches_cpu():
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, generator=gen) for n in (3, 17, 64)]
    ys = [torch.randn(n, generator=gen) for n in (3, 17, 64)]
    nxs, nys = [x.to("neuron") for x in xs], [y.to("neuron") for y in ys]
    torch.neuron.synchronize()
    before = engine.stats()["enqueued"]
    for a, b in ((xs, ys), (nxs, nys)):
        torch._foreach_add_(a, b, alpha=0.5)   # one kernel for the list (foreach.cpp)
        torch._foreach_addcmul_(a, b, b, 0.1)
    assert engine.stats()["enqueued"] - before == 2
    for x, nx in zip(xs, nxs):
        torch.testing.assert_close(nx.cpu(), x, rtol=0, atol=0)


def test_a_list_op_is_one_queued_kernel_and_matches_cpu():
    # GradScaler's unscale: Tensor(a!)[] and a written 0-dim found_inf, one kernel for the list
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0, float("inf")]]), torch.tensor(8.0)]
    found, inv = torch.tensor(0.0), torch.tensor(0.5)  # 0-dim: [1]-shaped ones run synchronously
    ngrads = [g.to("neuron") for g in grads]
    nfound, ninv = found.to("neuron"), inv.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()["enqueued"]
    torch._amp_foreach_non_finite_check_and_unscale_(ngrads, nfound, ninv)
    assert engine.stats()["enqueued"] - before == 1
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    assert nfound.item() == found.item() == 1.0
    for g, ng in zip(grads, ngrads):
        torch.testing.assert_close(ng.cpu(), g, rtol=0, atol=0)


def test_a_write_overlapping_its_input_raises_at_the_call_as_on_cpu():
    a = torch.arange(6.0)
    with pytest.raises(RuntimeError) as cpu_err:
        a.add_(a[0])
    n = a.to("neuron")
    torch.neuron.synchronize()
    with pytest.raises(RuntimeError) as err:
        n.add_(n[0])
    assert str(err.value).split("\n")[0] == str(cpu_err.value).split("\n")[0]
    assert not pending()


def test_bf16_queued_ops_match_cpu():
    a = torch.randn(256, dtype=torch.bfloat16)
    n = a.to("neuron")
    for t in (a, n):
        t.mul_(t).add_(1).div_(3)
    torch.testing.assert_close(n.cpu(), a, rtol=0, atol=0)


def test_metadata_changes_after_the_call_do_not_reach_a_queued_kernel():
    x = torch.arange(12.0).reshape(3, 4)
    n = x.to("neuron")
    slow = torch.ones(BIG, device="neuron")
    slow_work(slow)               # keeps the queue busy so the next kernels wait
    y = n + n                     # queued over n's current shape and strides
    n.t_()                        # in-place metadata change on the host
    n.set_(torch.zeros(5, device="neuron"))
    torch.testing.assert_close(y.cpu(), x + x, rtol=0, atol=0)


def test_resizing_storage_waits_for_queued_writes():
    n = torch.zeros(4, device="neuron")
    slow = torch.ones(BIG, device="neuron")
    slow_work(slow)
    n.add_(7)
    n.resize_(1 << 16)            # grows the storage: the queued add_ must land first
    assert n[:4].cpu().tolist() == [7.0, 7.0, 7.0, 7.0]


# ---- synchronization points ---------------------------------------------------------------

SYNC_POINTS = {
    "item": lambda t: t[0].item(),
    "cpu": lambda t: t.cpu(),
    "tolist": lambda t: t[:3].tolist(),
    "print": lambda t: repr(t),
    "nonzero": lambda t: t.nonzero(),
    "boolean_mask": lambda t: t[t > 0],
    "device_synchronize": lambda t: torch.neuron.synchronize(),
    "stream_synchronize": lambda t: torch.neuron.current_stream().synchronize(),
    "event_synchronize": lambda t: torch.neuron.current_stream().record_event().synchronize(),
    "accelerator_synchronize": lambda t: torch.accelerator.synchronize(),
}


@pytest.mark.parametrize("name", sorted(SYNC_POINTS))
def test_synchronization_point_waits_for_queued_work(name):
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    slow_work(x)
    assert pending()
    SYNC_POINTS[name](x)
    assert not pending()


def test_event_query_is_false_until_the_work_before_it_ran():
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    slow_work(x)
    ev = torch.neuron.current_stream().record_event()
    assert not ev.query()
    ev.synchronize()
    assert ev.query()


def test_elapsed_time_measures_the_device_not_the_enqueue():
    x = torch.ones(BIG, device="neuron")
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    torch.neuron.synchronize()
    t0 = time.perf_counter()
    start.record()
    slow_work(x, 30)
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    assert end.elapsed_time(start) < 0 < start.elapsed_time(end)
    assert start.elapsed_time(end) > host_ms


def test_elapsed_time_of_an_incomplete_event_raises():
    x = torch.ones(BIG, device="neuron")
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    torch.neuron.synchronize()
    start.record()
    slow_work(x, 30)
    end.record()
    with pytest.raises(RuntimeError, match="completed"):
        start.elapsed_time(end)


def test_work_on_two_streams_is_ordered_by_wait_stream():
    side = torch.neuron.Stream()
    a = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    with torch.neuron.stream(side):
        slow_work(a, 10)
    torch.neuron.current_stream().wait_stream(side)
    b = a + a
    torch.testing.assert_close(b.cpu(), torch.full((BIG,), 2 * 1.0001 ** 10))


def test_a_high_priority_stream_overtakes_earlier_work_of_a_normal_one():
    high = torch.neuron.Stream(priority=-1)
    x, y = torch.ones(BIG, device="neuron"), torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    normal_done = torch.neuron.Event(enable_timing=True)
    high_done = torch.neuron.Event(enable_timing=True)
    slow_work(x, 10)                                  # default stream, enqueued first
    normal_done.record()
    with torch.neuron.stream(high):
        y.add_(1)
        high_done.record()
    torch.neuron.synchronize()
    assert high_done.elapsed_time(normal_done) > 0    # the later, high-priority work ran first
    torch.testing.assert_close(x.cpu(), torch.full((BIG,), 1.0001) ** 10, rtol=0, atol=0)


def test_without_wait_stream_a_high_priority_stream_reads_stale_data():
    # As on a GPU: the dependency is the program's to state. Here the race is deterministic.
    high = torch.neuron.Stream(priority=-1)
    x = torch.zeros(BIG, device="neuron")
    torch.neuron.synchronize()
    slow_work(x, 3)
    x.fill_(1.0)                          # default stream
    with torch.neuron.stream(high):
        stale = x * 2                     # no wait: runs before the fill
    high.wait_stream(torch.neuron.current_stream())
    with torch.neuron.stream(high):
        fresh = x * 2
    torch.neuron.synchronize()
    assert stale.cpu().max().item() == 0.0
    assert fresh.cpu().min().item() == 2.0


def test_the_stream_sanitizer_names_that_stale_read():
    from torchneuron.neuron import _sanitizer as nsan

    san = nsan.NeuronSanitizer()
    san.enable()
    try:
        high = torch.neuron.Stream(priority=-1)
        x = torch.zeros(256, device="neuron")
        x.fill_(1.0)
        with pytest.raises(nsan.NeuronSanitizerErrors):
            with torch.neuron.stream(high):
                x * 2
    finally:
        san.disable()
        san.dispatch.close()


def test_wait_event_orders_a_high_priority_stream_after_the_event():
    high = torch.neuron.Stream(priority=-1)
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    slow_work(x, 5)
    ev = torch.neuron.current_stream().record_event()
    high.wait_event(ev)
    assert not high.query()                            # waiting for the default stream's work
    with torch.neuron.stream(high):
        y = x + 1
    torch.neuron.synchronize()
    torch.testing.assert_close(y.cpu(), torch.full((BIG,), 1.0001) ** 5 + 1, rtol=0, atol=0)


def test_kernels_enqueued_by_two_threads_run_in_enqueue_order():
    # Both threads use the default stream: one FIFO, whichever thread runs the queue. Thread B
    # starts only after A's writes are enqueued, and its results must see every one of them.
    import threading

    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    a_done = threading.Event()
    out = {}

    def writer():
        slow_work(x, 10)
        a_done.set()

    def reader():
        a_done.wait()
        out["y"] = x * 2
        out["sum"] = out["y"][:1000].sum().item()   # a synchronization point on this thread

    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = torch.full((BIG,), 1.0001) ** 10 * 2
    torch.testing.assert_close(out["y"].cpu(), want, rtol=0, atol=0)
    assert out["sum"] == pytest.approx(float(want[:1000].sum()), rel=1e-6)


def test_an_event_recorded_on_one_thread_orders_a_stream_used_on_another():
    import threading

    side = torch.neuron.Stream()
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    recorded = threading.Event()
    box = {}

    def producer():
        with torch.neuron.stream(side):
            slow_work(x, 10)
            box["event"] = side.record_event()
        recorded.set()

    t = threading.Thread(target=producer)
    t.start()
    recorded.wait()
    torch.neuron.current_stream().wait_event(box["event"])
    y = x + 1
    t.join()
    torch.testing.assert_close(y.cpu(), torch.full((BIG,), 1.0001) ** 10 + 1, rtol=0, atol=0)


# ---- non_blocking copies -------------------------------------------------------------------

def test_a_non_blocking_copy_to_pinned_memory_lands_only_at_synchronization():
    # As on a GPU: a host that reads a non_blocking copy's destination without waiting reads
    # stale bytes, here deterministically (the queue runs only when the host waits)
    x = torch.arange(BIG, dtype=torch.float32, device="neuron")
    torch.neuron.synchronize()
    dst = torch.zeros(BIG, pin_memory=True)
    assert dst.is_pinned()
    slow_work(x, 2)
    dst.copy_(x, non_blocking=True)
    assert pending()
    assert dst.abs().sum().item() == 0          # the copy has not run
    torch.neuron.synchronize()
    torch.testing.assert_close(dst, torch.arange(BIG, dtype=torch.float32) * 1.0001 * 1.0001,
                               rtol=0, atol=0)


def test_to_cpu_non_blocking_returns_pinned_memory_filled_after_synchronization():
    x = torch.arange(BIG, dtype=torch.float32, device="neuron")
    slow_work(x, 2)
    y = x.to("cpu", non_blocking=True)
    assert y.is_pinned() and pending()
    torch.neuron.synchronize()
    torch.testing.assert_close(y, torch.arange(BIG, dtype=torch.float32) * 1.0001 * 1.0001,
                               rtol=0, atol=0)


def test_a_non_blocking_copy_from_pinned_memory_is_queued_behind_earlier_work():
    src = torch.arange(BIG, dtype=torch.float32).pin_memory()
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    slow_work(x, 3)
    before = engine.stats()["enqueued"]
    x.copy_(src, non_blocking=True)     # must land after the queued multiplies, not before
    assert engine.stats()["enqueued"] == before + 1
    x.add_(1)
    torch.testing.assert_close(x.cpu(), torch.arange(BIG, dtype=torch.float32) + 1, rtol=0, atol=0)


def test_a_non_blocking_copy_converts_dtypes_like_cpu():
    src = torch.randn(1000, dtype=torch.float64).pin_memory()
    x = torch.empty(1000, dtype=torch.bfloat16, device="neuron")
    x.copy_(src, non_blocking=True)
    back = torch.empty(1000, dtype=torch.float32, pin_memory=True)
    back.copy_(x, non_blocking=True)
    torch.neuron.synchronize()
    torch.testing.assert_close(back, src.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_a_non_blocking_copy_from_pageable_memory_is_synchronous():
    src = torch.arange(BIG, dtype=torch.float32)
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    slow_work(x, 2)
    x.copy_(src, non_blocking=True)   # CUDA stages pageable memory: src may change right after
    src.zero_()
    assert not pending()
    torch.testing.assert_close(x.cpu(), torch.arange(BIG, dtype=torch.float32), rtol=0, atol=0)


def test_a_non_blocking_copy_of_mismatched_shapes_raises_at_the_call():
    src = torch.ones(3, 4).pin_memory()
    x = torch.ones(5, 4, device="neuron")
    with pytest.raises(RuntimeError, match="must match"):
        x.copy_(src, non_blocking=True)
    assert not pending()


def test_pinned_memory_dropped_before_its_copy_ran_is_released_after_it():
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    slow_work(x, 3)
    src = torch.full((BIG,), 7.0).pin_memory()
    x.copy_(src, non_blocking=True)
    del src                                     # the queued copy still holds it
    torch.testing.assert_close(x.cpu(), torch.full((BIG,), 7.0), rtol=0, atol=0)


# ---- errors --------------------------------------------------------------------------------

def test_an_asynchronous_error_surfaces_at_the_next_synchronization_with_its_stack():
    w = torch.arange(4, device="neuron")
    zero = torch.tensor([1, 2, 0, 3], device="neuron")
    w.remainder_(zero)  # integer division by zero: only the kernel sees the data
    line = sys._getframe().f_lineno - 1
    with pytest.raises(torch.AcceleratorError) as err:  # a device error, as CUDA's (a RuntimeError)
        torch.neuron.synchronize()
    assert err.value.error_code == 1  # the Neuron runtime's NRT_FAILURE
    msg = str(err.value)
    assert "remainder" in msg and "ZeroDivisionError" in msg
    assert f'{__file__}", line {line}' in msg
    assert "Exception raised from" not in msg   # no C++ backtrace of the thread that ran it
    # reported once; the device stays usable
    torch.neuron.synchronize()
    assert (torch.ones(3, device="neuron") * 2).sum().item() == 6.0


def _divide_by_zero():
    w = torch.arange(4, device="neuron")
    w.remainder_(torch.tensor([1, 2, 0, 3], device="neuron"))  # fails in the kernel


def test_each_report_names_its_own_call_site_when_stacks_repeat():
    # A stack seen before is shared, not captured again: each report must still name its caller.
    here = sys._getframe().f_code.co_firstlineno
    reports = []
    for i in range(4):
        if i % 2 == 0:
            _divide_by_zero(); line = sys._getframe().f_lineno  # noqa: E702
        else:
            _divide_by_zero(); line = sys._getframe().f_lineno  # noqa: E702
        with pytest.raises(RuntimeError) as err:
            torch.neuron.synchronize()
        reports.append((line, str(err.value)))
    lines = {line for line, _ in reports}
    assert len(lines) == 2 and all(line > here for line in lines)
    for line, msg in reports:
        assert f'{__file__}", line {line}, in test_each_report' in msg
        assert "in _divide_by_zero" in msg
        (other,) = lines - {line}
        assert f'{__file__}", line {other},' not in msg


def test_an_error_enqueued_on_another_thread_names_that_threads_stack():
    import threading

    def worker_enqueueing_a_failure():
        _divide_by_zero()

    t = threading.Thread(target=worker_enqueueing_a_failure)
    t.start()
    t.join()
    with pytest.raises(RuntimeError) as err:
        torch.neuron.synchronize()
    assert "in worker_enqueueing_a_failure" in str(err.value)
    assert "in test_an_error_enqueued_on_another_thread" not in str(err.value)


def test_stacks_past_the_interned_ones_are_still_reported_right():
    # At most 4,096 stacks are interned; later new ones are gathered at every call. Distinct
    # code objects (exec) make distinct stacks.
    code = """
import torch
torch.neuron.engine.set_enabled(True)
ns = {}
x = torch.zeros(16, device="neuron")
for i in range(4200):
    exec(f"def site_{i}(x):\\n    x.add_(1)\\n", ns)
    ns[f"site_{i}"](x)
torch.neuron.synchronize()
assert x[0].item() == 4200
exec("def failing_site_past_the_cap(w, z):\\n    w.remainder_(z)\\n", ns)
ns["failing_site_past_the_cap"](torch.arange(4, device="neuron"), torch.tensor([1, 2, 0, 3], device="neuron"))
ns["site_7"](x)  # an interned stack, enqueued after the failing one
try:
    torch.neuron.synchronize()
except RuntimeError as e:
    msg = str(e)
    assert "in failing_site_past_the_cap" in msg and "site_7" not in msg, msg
    print("OK")
"""
    r = _run(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]


def test_shape_errors_raise_at_the_call_not_later():
    a, b = torch.ones(4, 5, device="neuron"), torch.ones(3, device="neuron")
    out = torch.empty(2, 2, device="neuron", dtype=torch.int64)
    torch.neuron.synchronize()
    with pytest.raises(RuntimeError, match="size"):
        a.add_(b)
    with pytest.raises(RuntimeError):
        torch.exp(a, out=out)
    with pytest.raises(RuntimeError, match="size"):
        torch.add(a, b, out=torch.empty(4, 5, device="neuron"))
    torch.neuron.synchronize()  # nothing failed later


def test_device_mismatch_raises_at_the_call():
    a = torch.ones(4, device="neuron")
    torch.neuron.synchronize()
    with pytest.raises(RuntimeError, match="same device"):
        a.add_(torch.ones(4))
    with pytest.raises(RuntimeError, match="same device"):
        torch.exp(torch.ones(4), out=a)
    assert not pending()


def test_a_collective_reads_what_queued_kernels_wrote():
    import torch.distributed as dist
    dist.init_process_group("neuron", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.zeros(BIG, device="neuron")
        slow_work(torch.ones(BIG, device="neuron"), 3)
        x.add_(1)
        out = torch.empty(BIG, device="neuron")
        dist.all_gather_into_tensor(out, x)
        assert out.sum().item() == BIG
    finally:
        dist.destroy_process_group()


def test_a_collective_waits_for_queued_writes_on_every_stream():
    # The transport reads device memory on the host, so a collective runs every queued kernel
    # first, not only the current stream's (architecture.md: a collective is a synchronization
    # point): here x is written on a side stream the default stream never waited for.
    import torch.distributed as dist
    dist.init_process_group("neuron", store=dist.HashStore(), rank=0, world_size=1)
    try:
        side = torch.neuron.Stream()
        x = torch.zeros(BIG, device="neuron")
        torch.neuron.synchronize()
        with torch.neuron.stream(side):
            slow_work(torch.ones(BIG, device="neuron"), 3)
            x.add_(1)
        out = torch.empty(BIG, device="neuron")
        dist.all_gather_into_tensor(out, x)   # world size 1: out is a copy of x, made by gloo
        torch.testing.assert_close(out.cpu(), torch.ones(BIG), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


# ---- memory --------------------------------------------------------------------------------

def test_a_tensor_dropped_while_its_kernel_is_queued_is_freed_at_once():
    # CUDA's stream-ordered free: the block returns to the pool now; only later kernels write it
    gc.collect()  # garbage of earlier tests (autograd cycles) would be freed mid-test otherwise
    torch.neuron.synchronize()
    base = torch.neuron.memory_allocated()
    x = torch.ones(BIG, device="neuron")
    slow_work(x)
    del x
    assert pending()
    assert torch.neuron.memory_allocated() == base


def test_memory_the_device_adopted_outlives_the_queued_kernels_that_use_it():
    # flip's result is CPU memory the device adopted (freed by the host allocator, not the
    # pool); 64 MiB, so the host allocator returns it to the OS at once when freed
    src = torch.arange(1 << 23, dtype=torch.float64)
    x = src.to("neuron").flip(0)
    slow = torch.ones(BIG, device="neuron")
    slow_work(slow, 5)
    y = torch.empty_like(x)
    torch.mul(x, 2, out=y)      # queued, reads x
    del x                       # its memory must survive until the mul ran
    torch.testing.assert_close(y.cpu(), src.flip(0) * 2, rtol=0, atol=0)


def test_an_output_block_is_reused_only_after_the_kernel_that_wrote_it():
    ref = torch.ones(BIG)
    for _ in range(3):
        x = torch.ones(BIG, device="neuron")
        slow_work(x, 3)
        y = x + x
        del x                     # the block may be reused by the next iteration's x
        torch.testing.assert_close(y.cpu(), 2 * ref * 1.0001 ** 3)


# ---- configuration -------------------------------------------------------------------------

def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


ASYNC_ERROR = """
import torch
w = torch.arange(4, device="neuron")
zero = torch.tensor([1, 2, 0, 3], device="neuron")
try:
    w.remainder_(zero)
    print("returned")
    torch.neuron.synchronize()
except RuntimeError as e:
    print("raised", "ZeroDivisionError" in str(e))
print("enabled", torch.neuron.engine.is_enabled())
"""


def test_the_engine_is_on_by_default():
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHNEURON_ASYNC_EXECUTION", "NEURON_LAUNCH_BLOCKING")}
    r = subprocess.run([sys.executable, "-c", ASYNC_ERROR], capture_output=True, text=True, timeout=120, env=env)
    assert r.stdout.split() == ["returned", "raised", "True", "enabled", "True"]


def test_environment_turns_the_engine_on():
    out = _run(ASYNC_ERROR, TORCHNEURON_ASYNC_EXECUTION="1", NEURON_LAUNCH_BLOCKING="0").stdout.split()
    assert out == ["returned", "raised", "True", "enabled", "True"]


def test_environment_turns_the_engine_off():
    out = _run(ASYNC_ERROR, TORCHNEURON_ASYNC_EXECUTION="0", NEURON_LAUNCH_BLOCKING="0").stdout.split()
    assert out == ["raised", "True", "enabled", "False"]


def test_launch_blocking_raises_at_the_op():
    out = _run(ASYNC_ERROR, TORCHNEURON_ASYNC_EXECUTION="1", NEURON_LAUNCH_BLOCKING="1").stdout.split()
    assert out == ["raised", "True", "enabled", "False"]


def test_profiler_runs_kernels_synchronously():
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    before = engine.stats()["enqueued"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.PrivateUse1]):
        slow_work(x, 2)
    assert engine.stats()["enqueued"] == before


def test_a_stream_whose_only_pending_item_is_a_satisfied_wait_queries_idle():
    # CUDA: a stream that waited on an event which has completed has nothing left to do.
    s1, s2 = torch.Stream(device="neuron"), torch.Stream(device="neuron")
    a = torch.ones(64, 64, device="neuron")
    with s2:
        b = a @ a  # queued on s2
        ev = s2.record_event()
    s1.wait_event(ev)  # a wait marker in s1's queue
    ev.synchronize()
    assert s1.query() and s2.query() and ev.query()
    assert torch.equal(b.cpu(), torch.full((64, 64), 64.0))


def test_kernels_queued_under_inference_mode_run_after_it_ends():
    # Their CPU aliases are inference tensors: the queue, drained outside inference_mode, runs
    # them below autograd, as the op would have (vLLM's sampler warm-up casts this way).
    with torch.inference_mode():
        x = torch.empty(1000, device="neuron")
        x.copy_(torch.ones(1000, dtype=torch.int32, device="neuron"))  # a queued cast
        y = x * 2
    torch.neuron.synchronize()
    assert y.sum().item() == 2000.0
