"""Memory history in CUDA's snapshot format (rendered by PyTorch's own memory visualizer) and
the allocator's reports to the profiler (profile_memory, export_memory_timeline, OOMs)."""

import pickle

import torch
from profiling_helpers import ACTIVITIES
from support import run_python

from torch.cuda import _memory_viz


def _allocate_here():
    return torch.empty(1 << 20, device="neuron")


def test_snapshot_has_each_live_block_with_its_allocation_stack():
    torch.neuron.memory._record_memory_history(stacks="python")
    try:
        x = _allocate_here()
        snap = torch.neuron.memory._snapshot()
    finally:
        torch.neuron.memory._record_memory_history(enabled=None)
    addr = x.data_ptr()
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == addr]
    (b,) = blocks
    assert b["state"] == "active_allocated" and b["size"] >= x.nbytes
    assert any(f["name"] == "_allocate_here" and f["filename"] == __file__ for f in b["frames"])
    trace = snap["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc" and e["addr"] == addr]
    assert allocs and any(f["name"] == "_allocate_here" for f in allocs[-1]["frames"])


def test_history_records_frees_and_stops_when_disabled():
    torch.neuron.memory._record_memory_history(stacks="python")
    x = _allocate_here()
    addr = x.data_ptr()
    del x
    actions = [e["action"] for e in torch.neuron.memory._snapshot()["device_traces"][0] if e["addr"] == addr]
    torch.neuron.memory._record_memory_history(enabled=None)
    assert actions[-3:] == ["alloc", "free_requested", "free_completed"]
    _allocate_here()
    assert torch.neuron.memory._snapshot()["device_traces"][0] == []


def test_pytorch_memory_visualizer_renders_a_dumped_neuron_snapshot(tmp_path):
    torch.neuron.memory._record_memory_history(stacks="python", max_entries=1000)
    try:
        keep = [_allocate_here() for _ in range(3)]
        del keep[1]
        path = tmp_path / "snap.pickle"
        torch.neuron.memory._dump_snapshot(str(path))
    finally:
        torch.neuron.memory._record_memory_history(enabled=None)
    snap = pickle.loads(path.read_bytes())
    assert "<html" in _memory_viz.trace_plot(snap).lower()
    assert "<html" in _memory_viz.segment_plot(snap).lower()
    assert "segment" in _memory_viz.segsum(snap).lower()


def test_profile_memory_feeds_export_memory_timeline(tmp_path):
    x = torch.randn(256, 256, device="neuron", requires_grad=True)
    with torch.profiler.profile(activities=ACTIVITIES, record_shapes=True, profile_memory=True,
                                with_stack=True) as prof:
        (x @ x).relu().sum().backward()
    out = tmp_path / "mem.json"
    prof.export_memory_timeline(str(out), device="neuron:0")
    import json

    times, sizes = json.loads(out.read_text())
    assert len(times) > 2 and any(v > 0 for row in sizes for v in row)


def test_out_of_memory_reaches_history_and_profiler():
    code = """
import torch
from torch.profiler import profile, ProfilerActivity as A
torch.neuron.memory._record_memory_history(stacks="python")
with profile(activities=[A.CPU, A.PrivateUse1], profile_memory=True) as prof:
    try:
        torch.empty(64 << 20, dtype=torch.uint8, device="neuron")
    except torch.OutOfMemoryError:
        print("OOM")
snap = torch.neuron.memory._snapshot()
print("history", [e["action"] for e in snap["device_traces"][0]].count("oom"))
print("profiler", sum(e.name() == "[OutOfMemory]" for e in prof.profiler.kineto_results.events()))
"""
    r = run_python(code, env={"TORCHNEURON_DEVICE_MEMORY": "32MiB"})
    assert r.returncode == 0, r.stderr
    assert "OOM" in r.stdout and "history 1" in r.stdout and "profiler 1" in r.stdout
