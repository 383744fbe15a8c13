"""Chrome / Perfetto traces with the estimated Trainium timeline as a track of its own.

Every measured device activity in a neuron trace carries its estimate in its args
(``est_start_ns``, ``est_ns``, FLOPs, bytes, engine, bound, MFU/MBU). When the trace is written,
:func:`add_estimated_track` turns those into a second device track per neuron device,
"Trainium2 (estimated)", one thread per queue, so the measured emulator timeline and the
estimated Trainium timeline sit side by side in Perfetto or chrome://tracing.

The estimated events use category ``neuron_estimate`` (not ``kernel``), so trace tools that
count device kernels (Holistic Trace Analysis, PyTorch's own parser) count only measured ones.
:func:`install` wraps ``torch.autograd.profiler.profile.export_chrome_trace`` (which
``torch.profiler.profile.export_chrome_trace`` and ``tensorboard_trace_handler`` call) so every
exported neuron trace gets the track; traces without neuron estimates are left untouched.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["add_estimated_track", "augment_file", "install", "ESTIMATE_PID_BASE",
           "ESTIMATE_CATEGORY"]

#: pid of device ``d``'s estimated track: far from real process ids and device indices.
ESTIMATE_PID_BASE = 0x7F000000
ESTIMATE_CATEGORY = "neuron_estimate"
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_ARGS = ("flops", "bytes_read", "bytes_written", "engine", "bound", "est_mfu", "est_mbu",
         "module", "source", "function", "dtype", "kind")


def add_estimated_track(trace: dict) -> dict:
    """Add the estimated timeline to ``trace`` (a Chrome trace dict; modified and returned).
    Idempotent."""
    events = trace.get("traceEvents", [])
    if any(e.get("cat") == ESTIMATE_CATEGORY for e in events):
        return trace
    info = trace.get("neuron_profiler") or {}
    if isinstance(info, str):
        info = json.loads(info)
    label = info.get("label", "Trainium (estimated)")
    base = int(trace.get("baseTimeNanoseconds", 0))
    added: list[dict] = []
    tracks: set = set()
    names = {e["pid"]: e.get("args", {}).get("name") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices: set = set()
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in _DEVICE_CATS:
            continue
        a = e.get("args") or {}
        if "est_start_ns" not in a or "est_ns" not in a:
            continue
        dev = int(a.get("device", 0))
        queue = int(a.get("stream", 0))
        devices.add(dev)
        pid = ESTIMATE_PID_BASE + dev
        tracks.add((pid, queue, dev))
        args = {k: a[k] for k in _ARGS if k in a}
        args["measured_correlation"] = a.get("correlation")
        added.append({"ph": "X", "cat": ESTIMATE_CATEGORY, "name": e["name"], "pid": pid,
                      "tid": queue, "ts": (int(a["est_start_ns"]) - base) / 1000.0,
                      "dur": float(a["est_ns"]) / 1000.0, "args": args})
    if not added:
        return trace
    meta: list[dict] = []
    for dev in sorted(devices):
        if dev not in names:  # kineto names one device per session: name the others
            meta += [{"ph": "M", "name": "process_name", "pid": dev, "tid": 0,
                      "args": {"name": f"neuron:{dev}"}}]
    for pid, queue, dev in sorted(tracks):
        meta += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
             "args": {"name": f"neuron:{dev} {label}"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
             "args": {"sort_index": 0x1000000 + 2 * dev + 1}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": queue,
             "args": {"name": ("comm queue " + str(queue - (1 << 20))) if queue >= (1 << 20)
                      else f"stream {queue}"}},
        ]
    trace["traceEvents"] = events + meta + added
    return trace


def augment_file(path: str | os.PathLike) -> bool:
    """Add the estimated track to the Chrome trace at ``path`` (plain JSON) in place. Returns
    whether the file had neuron estimates."""
    path = os.fspath(path)
    with open(path) as f:
        text = f.read()
    if '"est_start_ns"' not in text:
        return False
    trace = add_estimated_track(json.loads(text))
    with open(path, "w") as f:
        json.dump(trace, f)
    return True


_installed = False


def install() -> None:
    """Make PyTorch's trace export add the estimated track (idempotent)."""
    global _installed
    if _installed:
        return
    import torch.autograd.profiler as _ap

    original = _ap.profile.export_chrome_trace

    def export_chrome_trace(self, path: Any, *args: Any, **kwargs: Any):
        result = original(self, path, *args, **kwargs)
        try:
            if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
                augment_file(path)
        except (OSError, ValueError):
            pass  # a trace we cannot parse is left as written
        return result

    export_chrome_trace.__doc__ = original.__doc__
    export_chrome_trace._torchneuron = True  # type: ignore[attr-defined]
    _ap.profile.export_chrome_trace = export_chrome_trace
    _installed = True
