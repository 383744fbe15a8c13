"""PYTORCH_ALLOC_CONF=expandable_segments:True: segments that grow in place, as CUDA's.

Each case runs in a fresh process on a small device (the setting is process-wide). The
statistics of random sequences against an independent model of these rules are in
test_allocator_invariants.py; here, the behaviours a user relies on.
"""

import json

import pytest

from support import run_python

MiB = 1 << 20
CONF = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}

PRELUDE = """
import json, torch
MiB = 1 << 20
def big(mib, fill=0):
    return torch.full((mib * MiB,), fill, dtype=torch.uint8, device="neuron")
def stats():
    s = torch.neuron.memory_stats()
    return {k: s[k] for k in ("segment.all.current", "reserved_bytes.all.current", "allocated_bytes.all.current",
                              "num_device_alloc", "num_device_free", "inactive_split.all.current")}
def segments():
    return [(s["address"], s["total_size"], s["is_expandable"], s["segment_type"], s["stream"],
             [(b["address"], b["size"], b["state"]) for b in s["blocks"]]) for s in torch.neuron.memory_snapshot()]
"""


def run(body, env=None, memory="256MiB"):
    r = run_python(PRELUDE + body, env={"TORCHNEURON_DEVICE_MEMORY": memory, **CONF, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


# Batched inference whose batch grows by one each step (CUDA's motivating case): every step
# holds 4 layers x (b MiB + 1.5 b MiB) at once, then frees them. At batch 12 that is the whole
# 120 MiB device.
GROWING_BATCHES = """
reached = 0
try:
    for batch in range(8, 13):
        acts = []
        for layer in range(4):
            acts.append(torch.empty(batch * MiB, dtype=torch.uint8, device="neuron"))
            acts.append(torch.empty(batch * 3 * MiB // 2, dtype=torch.uint8, device="neuron"))
        del acts
        reached = batch
except torch.OutOfMemoryError as e:
    oom = str(e)
else:
    oom = None
print(json.dumps({"reached": reached, "oom": oom, "max_reserved": torch.neuron.max_memory_reserved()}))
"""


def test_growing_batches_fit_where_ordinary_segments_fragment():
    ordinary, _ = run(GROWING_BATCHES, env={"PYTORCH_ALLOC_CONF": ""}, memory="120MiB")
    expandable, _ = run(GROWING_BATCHES, memory="120MiB")
    # Ordinary segments are sized for the requests of their step: the next, larger ones leave
    # slivers at their ends, and the device is full at 100 MiB of tensors.
    assert ordinary["reached"] == 9 and ordinary["oom"] is not None
    assert "try PYTORCH_ALLOC_CONF=expandable_segments:True" in ordinary["oom"]
    # One segment per pool grows instead: every step fits, up to the whole device.
    assert expandable == {"reached": 12, "oom": None, "max_reserved": 120 * MiB}


def test_a_segment_grows_in_place_and_counts_only_its_mapped_bytes():
    out, _ = run("""
a = big(30); b = big(25)
print(json.dumps({"a": a.data_ptr(), "b": b.data_ptr(), "stats": stats(), "segments": segments()}))
""")
    assert out["b"] == out["a"] + 30 * MiB  # the second block follows the first in one segment
    [(address, total, expandable, kind, _, blocks)] = out["segments"]
    assert (address, total, expandable, kind) == (out["a"], 60 * MiB, True, "large")  # 20 MiB chunks
    assert [(b[1], b[2]) for b in blocks] == [(30 * MiB, "active_allocated"), (25 * MiB, "active_allocated"),
                                             (5 * MiB, "inactive")]
    # As CUDA's: mapped bytes are reserved, the segment is not counted, nor its free tail as a split.
    assert out["stats"] == {"segment.all.current": 0, "reserved_bytes.all.current": 60 * MiB,
                            "allocated_bytes.all.current": 55 * MiB, "num_device_alloc": 2,
                            "num_device_free": 0, "inactive_split.all.current": 0}


def test_values_stay_where_they_are_while_the_segment_grows_and_shrinks():
    out, _ = run("""
a = big(30, 1); b = big(30, 2); c = big(30, 3)
del b
torch.neuron.empty_cache()
d = big(45, 4)
print(json.dumps({"sums": [int(t.sum().item()) for t in (a, c, d)], "ptrs": [t.data_ptr() for t in (a, c, d)]}))
""")
    assert out["sums"] == [30 * MiB, 3 * 30 * MiB, 4 * 45 * MiB]
    assert out["ptrs"][1] == out["ptrs"][0] + 60 * MiB


def test_empty_cache_unmaps_the_whole_free_chunks_and_returns_them_to_the_device():
    out, _ = run("""
a = big(30); b = big(30); c = big(30)
before = (stats(), torch.neuron.mem_get_info()[0])
del b
torch.neuron.empty_cache()
print(json.dumps({"before": before, "after": (stats(), torch.neuron.mem_get_info()[0]), "segments": segments(),
                  "a": a.data_ptr()}))
""")
    (s0, free0), (s1, free1) = out["before"], out["after"]
    assert s0["reserved_bytes.all.current"] == 100 * MiB
    # b was bytes 30-60 MiB: only the chunk 40-60 MiB lies wholly inside it.
    assert s1["reserved_bytes.all.current"] == 80 * MiB and free1 - free0 == 20 * MiB
    assert s1["num_device_free"] == s0["num_device_free"] + 1
    a = out["a"]
    runs = [(s[0] - a, s[1], [(x[0] - a, x[1], x[2]) for x in s[5]]) for s in out["segments"]]
    assert runs == [(0, 40 * MiB, [(0, 30 * MiB, "active_allocated"), (30 * MiB, 10 * MiB, "inactive")]),
                    (60 * MiB, 40 * MiB, [(60 * MiB, 30 * MiB, "active_allocated"),
                                          (90 * MiB, 10 * MiB, "inactive")])]


def test_a_segment_without_pages_reserves_nothing_and_regrows_in_place():
    out, _ = run("""
x = big(50)
before = x.data_ptr()
del x
torch.neuron.empty_cache()
empty = {"segments": segments(), "stats": stats(), "free": torch.neuron.mem_get_info()[0]}
print(json.dumps({"empty": empty, "before": before, "again": big(50).data_ptr()}))
""")
    empty = out["empty"]
    assert empty["segments"] == [] and empty["stats"]["reserved_bytes.all.current"] == 0
    assert empty["free"] == 256 * MiB  # every page back to the device
    assert out["again"] == out["before"]  # (its address space stays reserved)


def test_small_requests_grow_their_own_segment_by_2_mib():
    out, _ = run("""
xs = [torch.empty(300_000, dtype=torch.uint8, device="neuron") for _ in range(8)]
print(json.dumps({"segments": segments(), "stats": stats()}))
""")
    [(_, total, expandable, kind, _, blocks)] = out["segments"]
    assert (total, expandable, kind) == (4 * MiB, True, "small")  # 8 x 300 KB in 2 MiB chunks
    assert out["stats"]["num_device_alloc"] == 2


def test_each_stream_grows_its_own_segment():
    out, _ = run("""
a = big(5)
s = torch.neuron.Stream()
with torch.neuron.stream(s):
    b = big(5)
print(json.dumps({"segments": segments()}))
""")
    streams = sorted(seg[4] for seg in out["segments"])
    assert len(streams) == 2 and streams[0] != streams[1]


def test_a_block_that_fits_is_taken_before_one_that_could_grow():
    # a fills bytes 0-10 MiB, b 10-40, c 40-45 of chunks mapped up to 60 MiB: once b is freed,
    # the free blocks are b's 30 MiB and the tail's 15 MiB, which unmapped space follows. Best
    # fit counts the tail at what it could grow to, as CUDA's: a 12 MiB request takes b's.
    out, _ = run("""
a = big(10); b = big(30); c = big(5)
pb = b.data_ptr()
del b
e = big(12)
print(json.dumps({"e": e.data_ptr(), "b": pb, "tail": c.data_ptr() + 5 * MiB}))
""")
    assert out["e"] == out["b"]


def test_switching_it_off_at_run_time_gives_ordinary_segments_again():
    out, _ = run("""
a = big(30)
torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
del a
b = big(12)
print(json.dumps({"segments": segments(), "b": b.data_ptr()}))
""")
    kinds = sorted((s[2], s[1]) for s in out["segments"])
    # The expandable segment's free block does not serve b; b gets a 12 MiB ordinary segment.
    assert kinds == [(False, 12 * MiB), (True, 40 * MiB)]
    assert [s for s in out["segments"] if not s[2]][0][0] == out["b"]


def test_mem_pools_keep_ordinary_segments():
    out, _ = run("""
pool = torch.neuron.MemPool()
with torch.neuron.use_mem_pool(pool):
    x = big(3)
y = big(3)
print(json.dumps({"segments": segments()}))
""")
    assert sorted((s[2], s[1]) for s in out["segments"]) == [(False, 20 * MiB), (True, 20 * MiB)]


def test_oom_past_the_device_names_it_and_loses_nothing():
    out, _ = run("""
a = big(100, 5)
try:
    b = big(200)
except torch.OutOfMemoryError as e:
    msg = str(e)
c = big(100, 6)
print(json.dumps({"msg": msg, "sums": [int(a.sum().item()), int(c.sum().item())], "stats": stats()}))
""")
    assert "neuron out of memory. Tried to allocate 200.00 MiB" in out["msg"]
    assert "expandable_segments:True" not in out["msg"]  # (it is on)
    assert out["sums"] == [500 * MiB, 600 * MiB]


def test_memory_history_records_the_maps_and_unmaps():
    out, _ = run("""
torch.neuron.memory._record_memory_history()
a = big(30)
del a
torch.neuron.empty_cache()
snap = torch.neuron.memory._snapshot()
print(json.dumps([(e["action"], e["size"]) for e in snap["device_traces"][0]]))
""")
    assert out == [["segment_map", 40 * MiB], ["alloc", 30 * MiB], ["free_requested", 30 * MiB],
                   ["free_completed", 30 * MiB], ["segment_unmap", 40 * MiB]]


IPC = """
import torch.multiprocessing as mp
def child(q, back):
    t = q.get()
    back.put((int(t.sum().item()), t.numel()))
    t.fill_(9)
    torch.neuron.synchronize()
    back.put("done")
if __name__ == "__main__":
    a = big(15, 1)
    b = big(10, 2)  # bytes 15-25 MiB: across the first chunk's end
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, back))
    p.start()
    q.put(b)
    got = back.get(timeout=60)
    assert back.get(timeout=60) == "done"
    p.join(60)
    print(json.dumps({"got": got, "now": int(b.sum().item()), "a": int(a.sum().item())}))
"""


def test_a_tensor_across_chunks_is_shared_with_another_process(tmp_path):
    script = tmp_path / "share.py"
    script.write_text(PRELUDE + IPC)
    r = run_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
                   env={"TORCHNEURON_DEVICE_MEMORY": "256MiB", **CONF})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"got": [2 * 10 * MiB, 10 * MiB], "now": 9 * 10 * MiB, "a": 15 * MiB}
