"""torch.profiler on neuron: one device activity per piece of device work, on its stream,
linked to the op that launched it, with copies, syncs and key_averages() as on CUDA."""

import json

import pytest
import torch
from profiling_helpers import ACTIVITIES, device_events
from torch.profiler import profile

import torchneuron


def _trace(prof, tmp_path):
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())


def test_each_executed_kernel_is_one_device_activity_named_for_its_op(tmp_path):
    x = torch.randn(16, 16, device="neuron")
    w = torch.randn(16, 16, device="neuron")
    torchneuron.clear_op_tracking()
    with profile(activities=ACTIVITIES) as prof:
        y = (x @ w).relu().sum(dim=0)
    executed = sum(torchneuron.get_executed_ops().values())
    evs = device_events(_trace(prof, tmp_path), "kernel")
    assert [e["name"] for e in evs] == ["nc::mm", "nc::relu", "nc::sum.dim_IntList"]
    assert len(evs) == executed
    assert torch.allclose(y.cpu(), (x.cpu() @ w.cpu()).relu().sum(dim=0), atol=1e-5)


def test_device_activity_carries_its_stream_from_the_runtime(tmp_path):
    s = torch.neuron.Stream()
    x = torch.randn(8, device="neuron")
    with profile(activities=ACTIVITIES) as prof:
        with torch.neuron.stream(s):
            x.mul(2)
        x.mul(3)
    evs = device_events(_trace(prof, tmp_path), "kernel")
    assert [(e["args"]["stream"], e["tid"]) for e in evs] == [(s.stream_id, s.stream_id), (0, 0)]


def test_kernel_is_linked_to_the_launching_op_with_a_flow(tmp_path):
    x = torch.randn(8, 8, device="neuron")
    with profile(activities=ACTIVITIES) as prof:
        x @ x
    t = _trace(prof, tmp_path)
    (k,) = device_events(t, "kernel")
    op = next(e for e in t["traceEvents"] if e.get("cat") == "cpu_op" and e["name"] == "aten::mm")
    launch = next(e for e in t["traceEvents"] if e.get("name") == "neuronLaunchKernel")
    assert k["args"]["External id"] == op["args"]["External id"] == launch["args"]["External id"]
    assert launch["args"]["correlation"] == k["args"]["correlation"]
    # The launch runs inside the op on the host thread; the kernel follows it.
    assert op["ts"] <= launch["ts"] and launch["ts"] + launch["dur"] <= op["ts"] + op["dur"] + 1
    assert launch["tid"] == op["tid"] and k["ts"] >= launch["ts"]
    flows = [e for e in t["traceEvents"] if e.get("cat") == "ac2g" and e.get("id") == k["args"]["correlation"]]
    assert sorted(e["ph"] for e in flows) == ["f", "s"]


def test_copies_are_named_by_direction_with_bytes(tmp_path):
    with profile(activities=ACTIVITIES) as prof:
        d = torch.arange(6, dtype=torch.float32).to("neuron")  # HtoD
        e = d.clone()  # DtoD
        v = e.sum().item()  # DtoH, blocking
        e.to("neuron:1")  # DtoD across devices
    assert v == 15.0
    evs = [(e["name"], e["args"].get("bytes"), bool(e["args"].get("blocking")))
           for e in device_events(_trace(prof, tmp_path), "memcpy")]
    assert evs == [("Memcpy HtoD", 24, False), ("Memcpy DtoD", 24, False), ("Memcpy DtoH", 4, True),
                   ("Memcpy DtoD", 24, False)]


def test_synchronizations_are_recorded_with_blocked_time(tmp_path):
    s = torch.neuron.Stream()
    ev = torch.neuron.Event()
    with profile(activities=ACTIVITIES) as prof:
        torch.neuron.synchronize()
        ev.record()
        ev.synchronize()
        s.wait_event(ev)
        s.synchronize()
    t = _trace(prof, tmp_path)
    names = [e["name"] for e in t["traceEvents"] if e.get("cat") == "privateuse1_runtime"
             and e.get("args", {}).get("kind") in ("sync", "wait", "event_record")]
    assert names[:5] == ["neuronDeviceSynchronize", "neuronEventRecord", "neuronEventSynchronize",
                         "neuronStreamWaitEvent", "neuronStreamSynchronize"]
    syncs = [e for e in t["traceEvents"] if e.get("args", {}).get("kind") == "sync"]
    assert all(e["args"]["blocked_ns"] >= 0 and "est_stall_ns" in e["args"] for e in syncs)


def test_key_averages_has_device_time_and_no_rows_from_cpu_kernels_underneath():
    x = torch.randn(64, 64, device="neuron")
    with profile(activities=ACTIVITIES) as prof:
        x.relu()
    rows = {r.key: r for r in prof.key_averages()}
    # CPU's relu kernel calls clamp_min internally: not a framework op of the neuron program.
    assert "aten::clamp_min" not in rows
    assert rows["aten::relu"].count == 1 and rows["nc::relu"].count == 1
    assert rows["aten::relu"].device_time_total > 0
    assert rows["aten::relu"].device_time_total == pytest.approx(rows["nc::relu"].self_device_time_total)
    assert "NEURON" in prof.key_averages().table()


@pytest.mark.parametrize("use_kineto", [False, True])
def test_legacy_profiler_use_device_gives_non_negative_device_times(use_kineto):
    x = torch.randn(32, 32, device="neuron")
    with torch.autograd.profiler.profile(use_device="neuron", use_kineto=use_kineto) as prof:
        for _ in range(3):
            x @ x
    mm = [e for e in prof.function_events if e.name == "aten::mm"]
    assert len(mm) == 3
    assert all(e.device_time_total > 0 for e in mm)
    assert all(e.device_time_total >= 0 for e in prof.function_events)


def test_profiler_options_work_on_neuron(tmp_path):
    x = torch.randn(8, 4, device="neuron")
    w = torch.randn(4, 3, device="neuron")
    with profile(activities=ACTIVITIES, record_shapes=True, with_stack=True, with_flops=True,
                 with_modules=True, profile_memory=True) as prof:
        x @ w
    mm = next(e for e in prof.events() if e.name == "aten::mm")
    assert mm.input_shapes[:2] == [[8, 4], [4, 3]]
    assert mm.flops == 2 * 8 * 4 * 3
    assert mm.device_memory_usage >= 8 * 3 * 4
    # with_stack's Python tracer records this test's frames (and no garbage: the neuron
    # session's callbacks run hidden from it).
    t = _trace(prof, tmp_path)
    py = [e["name"] for e in t["traceEvents"] if e.get("cat") == "python_function"]
    assert any("test_device_timeline.py" in n for n in py)


def test_with_modules_records_the_module_hierarchy_around_device_work(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).to("neuron")
    x = torch.randn(8, 4, device="neuron")
    with profile(activities=ACTIVITIES, with_stack=True, with_modules=True) as prof:
        model(x)
    t = _trace(prof, tmp_path)
    mods = {e["name"]: e for e in t["traceEvents"]
            if e.get("cat") == "python_function" and e["name"].startswith("nn.Module: ")}
    assert {"nn.Module: Sequential_0", "nn.Module: Linear_0", "nn.Module: ReLU_0"} <= set(mods)
    # The Linear's CPU op (the launcher of the device addmm) runs inside the Linear module span.
    lin = mods["nn.Module: Linear_0"]
    (addmm,) = [e for e in t["traceEvents"] if e.get("cat") == "cpu_op" and e["name"] == "aten::addmm"]
    assert lin["ts"] <= addmm["ts"] and addmm["ts"] + addmm["dur"] <= lin["ts"] + lin["dur"]


def test_schedule_and_tensorboard_trace_handler_write_device_and_estimated_tracks(tmp_path):
    x = torch.randn(16, 16, device="neuron")
    handler = torch.profiler.tensorboard_trace_handler(str(tmp_path))
    with profile(activities=ACTIVITIES, on_trace_ready=handler,
                 schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1)) as prof:
        for _ in range(4):
            x @ x
            prof.step()
    (path,) = list(tmp_path.glob("*.pt.trace.json"))
    t = json.loads(path.read_text())
    assert len(device_events(t, "kernel")) == 2  # two active steps, one matmul each
    est = [e for e in t["traceEvents"] if e.get("cat") == "neuron_estimate"]
    assert len(est) == 2


def test_nothing_is_recorded_and_no_hooks_stay_installed_when_off():
    from torch.nn.modules import module as m

    x = torch.randn(8, device="neuron")
    with profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not torchneuron._C._trace_active()  # CPU-only profiling: no device recording
        x.mul(2)
    with profile(activities=ACTIVITIES):
        assert torchneuron._C._trace_active()
        assert len(m._global_forward_pre_hooks) == 1
    assert not torchneuron._C._trace_active()
    assert len(m._global_forward_pre_hooks) == 0 and len(m._global_forward_hooks) == 0


def test_a_failing_kernel_records_nothing_and_leaves_recording_usable(tmp_path):
    a = torch.randn(2, 3, device="neuron")
    with profile(activities=ACTIVITIES) as prof:
        with pytest.raises(RuntimeError):
            torch.mm(a, a)  # (2x3) @ (2x3): shapes do not match
        a.add(1)
    t = _trace(prof, tmp_path)
    assert [e["name"] for e in device_events(t, "kernel")] == ["nc::add.Tensor"]
    assert any(e.get("name") == "aten::add" for e in t["traceEvents"])  # RecordFunction back on


def test_a_zero_fill_and_a_device_copy_are_memset_and_memcpy_activities(tmp_path):
    x = torch.randn(16, device="neuron")
    with profile(activities=ACTIVITIES) as prof:
        x.zero_()
        x.clone()
    evs = device_events(_trace(prof, tmp_path))
    assert [(e["cat"], e["name"]) for e in evs] == [("gpu_memset", "Memset (zero_)"),
                                                     ("gpu_memcpy", "Memcpy DtoD")]


def test_a_graph_replays_kernels_are_device_activities_tagged_with_the_graph(tmp_path):
    # CUDA's profiler shows a graph's kernels at each replay; a replay here enqueues recorded
    # kernels whose ops ran at the capture, so the replay records them itself.
    x = torch.zeros(64, device="neuron")
    w, a = torch.randn(16, 16, device="neuron"), torch.randn(4, 16, device="neuron")
    g = torch.neuron.NeuronGraph()
    with torch.neuron.graph(g):
        x.add_(1)
        y = (a @ w).relu()
        x.normal_()
    with profile(activities=ACTIVITIES) as prof:
        g.replay()
        g.replay()
        torch.neuron.synchronize()
    evs = device_events(_trace(prof, tmp_path), "kernel")
    assert [e["name"] for e in evs] == ["nc::add_.Tensor", "nc::mm", "nc::relu", "nc::normal_"] * 2
    assert {str(e["args"]["graph"]) for e in evs} == {str(g.pool()[0])}
    assert all(e["dur"] >= 0 for e in evs)
    torch.testing.assert_close(y.cpu(), (a.cpu() @ w.cpu()).relu())
    g.replay()  # outside the profiler: not traced, and still right
    torch.neuron.synchronize()


def test_a_graph_replays_kernels_carry_the_captured_launches_shapes_and_estimates(tmp_path):
    # the operands a kernel noted at the capture: the replay's estimate is the eager launch's
    w, a = torch.randn(32, 48, device="neuron"), torch.randn(8, 32, device="neuron")
    g = torch.neuron.NeuronGraph()
    with torch.neuron.graph(g):
        (a @ w).relu_()
    with profile(activities=ACTIVITIES) as prof:
        (a @ w).relu_()
        torch.neuron.synchronize()
        g.replay()
        torch.neuron.synchronize()
    evs = device_events(_trace(prof, tmp_path), "kernel")
    eager = [e for e in evs if "graph" not in e["args"]]
    replayed = [e for e in evs if "graph" in e["args"]]
    assert [e["name"] for e in replayed] == [e["name"] for e in eager] == ["nc::mm", "nc::relu_"]
    for mine, ref in zip(replayed, eager):
        for key in ("dtype", "flops", "bytes_read", "bytes_written", "est_ns"):
            assert mine["args"][key] == ref["args"][key], key
    assert replayed[0]["args"]["flops"] == 2 * 8 * 32 * 48


def captured_here():
    """The line of the caller's frame (where an op is captured)."""
    import inspect

    frame = inspect.currentframe().f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def test_a_graph_replays_kernels_carry_the_source_line_that_captured_them(tmp_path):
    a = torch.randn(8, 32, device="neuron")
    g = torch.neuron.NeuronGraph()
    with torch.neuron.graph(g):
        y = a.sigmoid(); where = captured_here()  # noqa: E702 (the op and its line together)
    with profile(activities=ACTIVITIES) as prof:
        g.replay()
        torch.neuron.synchronize()
    (k,) = device_events(_trace(prof, tmp_path), "kernel")
    assert k["name"] == "nc::sigmoid" and "graph" in k["args"]
    assert k["args"]["source"] == where
    assert k["args"]["function"] == "test_a_graph_replays_kernels_carry_the_source_line_that_captured_them"
    torch.testing.assert_close(y.cpu(), a.cpu().sigmoid())


def test_a_compiled_kernel_replayed_from_a_graph_is_its_launchs_compiled_activity(tmp_path):
    # vLLM's decode graphs over a compiled model: each replayed Inductor kernel is the same
    # attributed activity (name, source, FLOPs, bytes, estimate) as its eager launch
    def f(x):
        return torch.sin(x) * 2 + 1  # one fused kernel

    cf = torch.compile(f, backend="neuron")
    x = torch.randn(256, device="neuron")
    cf(x)
    with profile(activities=ACTIVITIES) as eager_prof:
        cf(x)
        torch.neuron.synchronize()
    g = torch.neuron.NeuronGraph()
    with torch.neuron.graph(g):
        out = cf(x)
    x.copy_(torch.randn(256))
    with profile(activities=ACTIVITIES) as prof:
        g.replay()
        torch.neuron.synchronize()
    torch.testing.assert_close(out.cpu(), torch.sin(x.cpu()) * 2 + 1)
    (ref,) = device_events(_trace(eager_prof, tmp_path), "compiled")
    (mine,) = device_events(_trace(prof, tmp_path), "compiled")
    assert mine["name"] == ref["name"] and mine["name"].startswith("cpp_fused")
    assert "graph" in mine["args"] and "graph" not in ref["args"]
    for key in ("source", "function", "flops", "bytes_read", "bytes_written", "dtype", "est_ns"):
        assert mine["args"].get(key) == ref["args"].get(key), key
    assert mine["args"]["flops"] == 3 * 256 and mine["args"]["bytes_written"] == 256 * 4


def test_small_copies_fills_and_pointwise_ops_replay_as_their_traced_launches(tmp_path):
    # the ops that run over raw pointers when small (no ZeroCopy) note their launches too
    a, b = torch.randn(64, device="neuron"), torch.randn(64, device="neuron")
    c, t = torch.empty(64, device="neuron"), torch.empty(8, 8, device="neuron")

    def ops():
        c.copy_(a)
        t.copy_(a.view(8, 8).t())  # (a queued copy between layouts)
        c.zero_()
        c.add_(b)
        return a * b

    with profile(activities=ACTIVITIES) as eager_prof:
        ops()
        torch.neuron.synchronize()
    g = torch.neuron.NeuronGraph()
    with torch.neuron.graph(g):
        out = ops()
    with profile(activities=ACTIVITIES) as prof:
        g.replay()
        torch.neuron.synchronize()
    torch.testing.assert_close(out.cpu(), a.cpu() * b.cpu())
    torch.testing.assert_close(c.cpu(), b.cpu())
    torch.testing.assert_close(t.cpu(), a.cpu().view(8, 8).t())
    ref = device_events(_trace(eager_prof, tmp_path))
    mine = device_events(_trace(prof, tmp_path))
    assert [(e["cat"], e["name"]) for e in mine] == [(e["cat"], e["name"]) for e in ref] == [
        ("gpu_memcpy", "Memcpy DtoD"), ("gpu_memcpy", "Memcpy DtoD"), ("gpu_memset", "Memset (zero_)"),
        ("kernel", "nc::add_.Tensor"),
        ("kernel", "nc::mul.Tensor")]
    for m, r in zip(mine, ref):
        assert "graph" in m["args"]
        for key in ("kind", "bytes", "dtype", "flops", "bytes_read", "bytes_written", "est_ns"):
            assert m["args"].get(key) == r["args"].get(key), (m["name"], key)
