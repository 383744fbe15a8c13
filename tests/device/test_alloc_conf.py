"""PYTORCH_ALLOC_CONF tunes neuron's caching allocator as it tunes CUDA's.

Each case runs in a fresh process: the settings are process-wide (c10's
AcceleratorAllocatorConfig, read from the environment at first use) and some cannot be unset.
"""

import json

import pytest

from support import run_python

MiB = 1 << 20

# Prints the allocator's counters after each step of `steps` (a list of statements).
PROBE = """
import json, torch
MiB = 1 << 20
live = {{}}
def alloc(name, mib, extra=0):
    live[name] = torch.empty(mib * MiB + extra, dtype=torch.uint8, device="neuron")
def free(name):
    del live[name]
def seg_addrs():
    return sorted(s["address"] for s in torch.neuron.memory_snapshot())
out = []
for step in {steps!r}:
    exec(step)
    s = torch.neuron.memory_stats()
    out.append({{k: s[k] for k in ("segment.all.current", "reserved_bytes.all.current", "allocated_bytes.all.current",
                                  "oversize_allocations.current", "oversize_segments.peak")}})
    out[-1]["segments"] = seg_addrs()
print(json.dumps(out))
"""


def probe(steps, conf=None, env=None):
    full_env = {"TORCHNEURON_DEVICE_MEMORY": "256MiB", **(env or {})}
    if conf is not None:
        full_env["PYTORCH_ALLOC_CONF"] = conf
    r = run_python(PROBE.format(steps=steps), env=full_env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


STEPS_SPLIT = ["alloc('big', 50)", "free('big')", "alloc('small', 12)", "alloc('big2', 45)"]


def test_by_default_a_cached_large_block_is_split_for_a_smaller_request():
    out, _ = probe(STEPS_SPLIT)
    assert out[2]["segment.all.current"] == 1  # the 12 MiB came from the cached 50 MiB segment
    assert out[3]["segment.all.current"] == 2  # (the rest, 38 MiB, cannot hold 45)


def test_max_split_size_keeps_oversize_blocks_whole_and_for_oversize_requests():
    out, _ = probe(STEPS_SPLIT, conf="max_split_size_mb:40")
    assert out[0]["oversize_allocations.current"] == 1 and out[0]["oversize_segments.peak"] == 1
    assert out[1]["oversize_allocations.current"] == 0
    assert out[2]["segment.all.current"] == 2  # a 12 MiB request does not take the oversize block
    # A 45 MiB request takes the cached 50 MiB one (within max_non_split_rounding_mb), unsplit.
    assert out[3]["segment.all.current"] == 2
    assert out[3]["allocated_bytes.all.current"] == (12 + 50) * MiB


def test_max_non_split_rounding_bounds_what_an_oversize_request_may_take():
    steps = ["alloc('big', 70)", "free('big')", "alloc('big2', 45)"]
    out, _ = probe(steps, conf="max_split_size_mb:40")
    assert out[-1]["segment.all.current"] == 2  # 70 MiB is more than 45 + 20 (the default): a segment of its own
    out, _ = probe(steps, conf="max_split_size_mb:40,max_non_split_rounding_mb:30")
    assert out[-1]["segment.all.current"] == 1


def test_garbage_collection_threshold_frees_the_least_recently_freed_segments():
    steps = ["alloc('a', 60)", "alloc('b', 60)", "alloc('c', 60)", "free('a')", "free('b')", "free('c')",
             "alloc('d', 70)"]
    without, _ = probe(steps)
    assert without[-1]["reserved_bytes.all.current"] == 250 * MiB  # all cached, and the new one
    # 0.75 x 256 MiB = 192 MiB: freeing the oldest, a's, suffices (250 - 60 = 190).
    out, _ = probe(steps, conf="garbage_collection_threshold:0.75")
    assert out[-1]["reserved_bytes.all.current"] == 190 * MiB
    a, b, c = (set(out[i]["segments"]) - set(out[i - 1]["segments"]) for i in range(3))
    assert not a & set(out[-1]["segments"]) and b | c <= set(out[-1]["segments"])


def test_roundup_power2_divisions_sets_the_size_classes():
    steps = ["alloc('x', 3, 1)"]
    default, _ = probe(steps)
    assert default[0]["allocated_bytes.all.current"] == 3 * MiB + MiB // 2  # four classes per power of two
    out, _ = probe(steps, conf="roundup_power2_divisions:2")
    assert out[0]["allocated_bytes.all.current"] == 4 * MiB


def test_settings_given_at_run_time_apply_to_later_allocations():
    out, _ = probe(["torch._C._accelerator_setAllocatorSettings('max_split_size_mb:40')"] + STEPS_SPLIT)
    assert out[3]["segment.all.current"] == 2


@pytest.mark.parametrize("variable", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_expandable_segments_grow_one_segment(variable):
    # (the behaviour itself: test_expandable_segments.py)
    out, err = probe(["alloc('x', 2)", "alloc('y', 30)"], env={variable: "expandable_segments:True"})
    assert out[-1]["segment.all.current"] == 0 and len(out[-1]["segments"]) == 1
    assert out[-1]["reserved_bytes.all.current"] == 40 * MiB and "expandable" not in err
