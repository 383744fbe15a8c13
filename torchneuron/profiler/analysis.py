"""From a neuron Chrome trace to the tables behind the Parquet export and the report.

:func:`analyze_trace` reads what ``export_chrome_trace`` wrote (CPU ops, the neuron device
activities with their estimates, syncs, memory events, ``ProfilerStep#N`` annotations) and
builds plain Python rows: per step, per framework op, per module, per collective, the memory
timeline, host gaps, syncs and portability findings. No pyarrow or matplotlib here.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..nki.perf_model import union_length

__all__ = ["Analysis", "analyze_trace", "load_trace"]

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")


def load_trace(path: str) -> dict:
    """Read a Chrome trace (``.json`` or ``.json.gz``)."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _overlap(a: tuple, intervals: list) -> float:
    """Length of interval ``a`` covered by the (sorted, merged) ``intervals``."""
    s, e = a
    covered = 0.0
    for x, y in intervals:
        if y <= s:
            continue
        if x >= e:
            break
        covered += min(e, y) - max(s, x)
    return covered


def _merge(intervals: list) -> list:
    out: list = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


@dataclass
class Analysis:
    """Everything the exporters need, in rows (dicts); times in ns on the trace's clock."""

    hardware: dict = field(default_factory=dict)
    label: str = "Trainium (estimated)"
    schema_version: str = ""
    rank: int = 0
    world_size: int = 1
    base_ns: int = 0
    device_events: list = field(default_factory=list)
    cpu_ops: list = field(default_factory=list)
    runtime_events: list = field(default_factory=list)
    annotations: list = field(default_factory=list)
    memory: list = field(default_factory=list)
    ooms: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    framework_nodes: list = field(default_factory=list)
    modules: list = field(default_factory=list)
    collectives: list = field(default_factory=list)
    syncs: list = field(default_factory=list)
    host_gaps: list = field(default_factory=list)
    portability: list = field(default_factory=list)
    stacks: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    trace_meta: dict = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        hw = self.hardware
        if dtype in ("float32", "float64"):
            return hw.get("peak_fp32_flops", 1.0)
        if dtype.startswith("float8") or dtype in ("int8", "uint8"):
            return hw.get("peak_fp8_flops", 1.0)
        return hw.get("peak_bf16_flops", 1.0)


def analyze_trace(trace: dict) -> Analysis:
    """Build the :class:`Analysis` of one rank's trace."""
    a = Analysis()
    info = trace.get("neuron_profiler") or {}
    if isinstance(info, str):
        info = json.loads(info)
    a.hardware = info.get("hardware", {})
    a.label = info.get("label", a.label)
    a.schema_version = info.get("schema_version", "")
    a.stacks = {int(k): v for k, v in (info.get("stacks") or {}).items()}
    a.trace_meta = {k: v for k, v in trace.items() if k != "traceEvents"}
    dist = trace.get("distributedInfo") or {}
    a.rank = int(dist.get("rank", 0) or 0)
    a.world_size = int(dist.get("world_size", 1) or 1)
    a.base_ns = base = int(trace.get("baseTimeNanoseconds", 0))

    def ns(ts: float) -> int:
        return base + int(round(float(ts) * 1000))

    for ev in trace.get("traceEvents", ()):
        cat = ev.get("cat", "")
        ph = ev.get("ph")
        args = ev.get("args") or {}
        if ph == "X" and cat in _DEVICE_CATS and "correlation" in args:
            start = ns(ev["ts"])
            a.device_events.append({"name": ev["name"], "cat": cat, "start": start,
                                    "end": start + int(round(float(ev.get("dur", 0)) * 1000)),
                                    "pid": ev.get("pid"), "tid": ev.get("tid"), **args})
        elif ph == "X" and cat == "cpu_op":
            start = ns(ev["ts"])
            a.cpu_ops.append({"name": ev["name"], "start": start,
                              "end": start + int(round(float(ev.get("dur", 0)) * 1000)),
                              "tid": ev.get("tid"), "pid": ev.get("pid"), "args": args})
        elif ph == "X" and cat == "user_annotation":
            start = ns(ev["ts"])
            a.annotations.append({"name": ev["name"], "start": start,
                                  "end": start + int(round(float(ev.get("dur", 0)) * 1000)),
                                  "tid": ev.get("tid"), "pid": ev.get("pid"), "args": args})
        elif ph == "X" and cat == "privateuse1_runtime":
            start = ns(ev["ts"])
            a.runtime_events.append({"name": ev["name"], "start": start,
                                     "end": start + int(round(float(ev.get("dur", 0)) * 1000)),
                                     "tid": ev.get("tid"), "pid": ev.get("pid"), **args})
        elif ph == "i" and ev.get("name") == "[memory]":
            if int(args.get("Device Type", -1)) == _PRIVATEUSE1:
                a.memory.append({"ts": ns(ev["ts"]), "device": int(args.get("Device Id", 0)),
                                 "bytes": int(args.get("Bytes", 0)),
                                 "allocated": int(args.get("Total Allocated", 0)),
                                 "reserved": int(args.get("Total Reserved", 0)),
                                 "addr": int(args.get("Addr", 0))})
        elif ph == "i" and ev.get("name") == "[OutOfMemory]":
            if int(args.get("Device Type", -1)) == _PRIVATEUSE1:
                a.ooms.append({"ts": ns(ev["ts"]), "device": int(args.get("Device Id", 0)),
                               "bytes": int(args.get("Bytes", 0)),
                               "allocated": int(args.get("Total Allocated", 0)),
                               "reserved": int(args.get("Total Reserved", 0))})
    a.device_events.sort(key=lambda e: e["start"])
    a.cpu_ops.sort(key=lambda e: (e["tid"], e["start"], -e["end"]))
    _build(a)
    return a


# ---------------------------------------------------------------------------------------------
def _build(a: Analysis) -> None:
    ops_by_ext: dict[int, dict] = {}
    for op in a.cpu_ops:
        ext = op["args"].get("External id")
        if ext is not None:
            ops_by_ext[int(ext)] = op
    _parents(a.cpu_ops)
    steps = [x for x in a.annotations if _STEP_RE.match(x["name"])]
    steps.sort(key=lambda x: x["start"])
    devs = [e for e in a.device_events if "est_ns" in e]

    # Backward attribution: forward module of each autograd sequence number.
    seq_module: dict[int, str] = {}
    seq_source: dict[int, tuple] = {}
    for e in devs:
        op = ops_by_ext.get(int(e.get("op_correlation", 0) or 0))
        seq = _sequence(op)
        if seq is not None and not _in_backward(op) and e.get("module"):
            seq_module.setdefault(seq, e["module"])
            if e.get("source"):
                seq_source.setdefault(seq, (e["source"], e.get("function", "")))
    for e in devs:
        op = ops_by_ext.get(int(e.get("op_correlation", 0) or 0))
        e["top_op"] = _top_op(op)["name"] if op else ""
        e["cpu_op"] = op["name"] if op else ""
        if op is not None and _in_backward(op):
            e["phase"] = "backward"
            seq = _backward_seq(op)
            if not e.get("module") and seq in seq_module:
                e["module"] = seq_module[seq] + " (backward)"
            if seq in seq_source:
                e.setdefault("forward_source", seq_source[seq][0])
        else:
            e["phase"] = "forward" if e.get("module") else "other"
        e["est_end_ns"] = int(e["est_start_ns"]) + int(round(float(e["est_ns"])))  # ints: ns since 1970 exceed float precision
        e["host_offset_ns"] = int(e.get("launch_ns", 0))
    # Steps (or the whole window as one).
    if not steps and devs:
        steps = [{"name": "ProfilerStep#0", "start": min(e["start"] - int(e.get("launch_ns", 0)) for e in devs),
                  "end": max(e["end"] for e in devs)}]
    _steps(a, steps, devs)
    _framework_nodes(a, devs, ops_by_ext)
    _modules(a, devs)
    _collectives(a, devs)
    _syncs(a)
    _gaps(a, devs)
    _portability(a, devs)
    _summary(a)


def _parents(ops: list) -> None:
    stack_by_tid: dict = defaultdict(list)
    for op in ops:
        st = stack_by_tid[op["tid"]]
        while st and st[-1]["end"] <= op["start"]:
            st.pop()
        op["parent"] = st[-1] if st else None
        st.append(op)


def _top_op(op: dict) -> dict:
    while op.get("parent") is not None and not op["parent"]["name"].startswith(
            ("autograd::engine::evaluate_function", "ProfilerStep#", "Optimizer.step")):
        op = op["parent"]
    return op


def _in_backward(op: dict | None) -> bool:
    while op is not None:
        if op["name"].startswith("autograd::engine::evaluate_function"):
            return True
        op = op.get("parent")
    return False


def _sequence(op: dict | None) -> int | None:
    """The autograd sequence number of the op (or of the nearest enclosing op that has one):
    the backward node's evaluate_function record carries the same number."""
    while op is not None:
        s = op["args"].get("Sequence number")
        if s is not None:
            return int(s)
        op = op.get("parent")
    return None


def _backward_seq(op: dict) -> int | None:
    while op is not None:
        if op["name"].startswith("autograd::engine::evaluate_function"):
            s = op["args"].get("Sequence number")
            return int(s) if s is not None else None
        op = op.get("parent")
    return None


def _virtual(devs_sorted: list, t: int) -> float:
    """Virtual (estimated) host time of measured time ``t``: the offset of the nearest device
    record launched at or before ``t``."""
    if not devs_sorted:
        return float(t)
    keys = [e["_launch"] for e in devs_sorted]
    i = bisect.bisect_right(keys, t) - 1
    e = devs_sorted[max(i, 0)]
    return t - (e["_launch"] - int(e["est_launch_ns"]))


def _steps(a: Analysis, steps: list, devs: list) -> None:
    for e in devs:
        e["_launch"] = e["start"] - int(e.get("launch_ns", 0))
    ordered = sorted((e for e in devs if "est_launch_ns" in e), key=lambda e: e["_launch"])
    for i, st in enumerate(steps):
        inside = [e for e in devs if st["start"] <= e["_launch"] < st["end"]]
        for e in inside:
            e["step"] = i
        v0 = _virtual(ordered, st["start"])
        v1 = _virtual(ordered, st["end"])
        comp = [e for e in inside if e.get("kind") != "collective"]
        est_end = max((e["est_end_ns"] for e in inside), default=v1)
        est_span = max(max(v1, est_end) - v0, 1.0)
        busy = union_length([(int(e["est_start_ns"]), e["est_end_ns"]) for e in comp])
        flops = sum(int(e.get("flops", 0)) for e in inside)
        nbytes = sum(int(e.get("bytes_read", 0)) + int(e.get("bytes_written", 0)) for e in comp)
        by_dtype: dict = defaultdict(float)
        for e in inside:
            if int(e.get("flops", 0)):
                by_dtype[e.get("dtype") or "bfloat16"] += int(e["flops"])
        dtype = max(by_dtype, key=by_dtype.get) if by_dtype else "bfloat16"
        m = re.match(r"ProfilerStep#(\d+)", st["name"])
        a.steps.append({
            "step": int(m.group(1)) if m else i, "name": st["name"], "start_ts": st["start"],
            "end_ts": st["end"], "host_ns": st["end"] - st["start"],
            "measured_device_ns": sum(e["end"] - e["start"] for e in comp),
            "est_ns": est_span, "est_busy_ns": busy, "flops": flops, "bytes": nbytes,
            "kernels": len(inside), "mfu_dtype": dtype,
            "est_mfu": flops / (est_span * 1e-9 * a.peak(dtype)) if est_span else 0.0,
            "est_mbu": nbytes / (est_span * 1e-9 * a.hardware.get("hbm_bytes_per_s", 1.0)),
            "host_bound_fraction": max(0.0, 1.0 - busy / est_span),
        })


def _framework_nodes(a: Analysis, devs: list, ops_by_ext: dict) -> None:
    by_op: dict[int, list] = defaultdict(list)
    for e in devs:
        by_op[int(e.get("op_correlation", 0) or 0)].append(e)
    nid = 0
    for ext, evs in sorted(by_op.items(), key=lambda kv: kv[1][0]["start"]):
        op = ops_by_ext.get(ext)
        first = evs[0]
        nid += 1
        flops = sum(int(e.get("flops", 0)) for e in evs)
        br = sum(int(e.get("bytes_read", 0)) for e in evs)
        bw = sum(int(e.get("bytes_written", 0)) for e in evs)
        est = sum(float(e["est_ns"]) for e in evs)
        dtype = first.get("dtype") or ""
        notes = sorted({n for e in evs for n in (e.get("portability") or [])})
        args = op["args"] if op else {}
        a.framework_nodes.append({
            "node_id": nid, "node_name": op["name"] if op else first["name"],
            "kernels": ",".join(sorted({e["name"] for e in evs})), "kernel_count": len(evs),
            "parent_name": (op["parent"]["name"] if op and op.get("parent") else ""),
            "top_op": first.get("top_op", ""), "module_path": first.get("module", ""),
            "phase": first.get("phase", ""), "step": first.get("step", -1),
            "source": first.get("source", ""), "function": first.get("function", ""),
            "stack_frame_id": int(first.get("stack_id", -1)) if "stack_id" in first else -1,
            "start_ts": op["start"] if op else first["start"],
            "end_ts": op["end"] if op else first["end"], "device": int(first.get("device", 0)),
            "input_dims": json.dumps(args.get("Input Dims", [])),
            "input_types": json.dumps(args.get("Input type", [])),
            "dtype": dtype, "flops": flops, "bytes_read": br, "bytes_written": bw,
            "engine": first.get("engine", ""), "bound": first.get("bound", ""),
            "measured_device_ns": sum(e["end"] - e["start"] for e in evs),
            "measured_host_ns": (op["end"] - op["start"]) if op else 0,
            "est_ns": est, "est_start_ts": min(int(e["est_start_ns"]) for e in evs),
            "est_end_ts": max(int(e["est_end_ns"]) for e in evs),
            "est_mfu": flops / (est * 1e-9 * a.peak(dtype or "bfloat16")) if est else 0.0,
            "est_mbu": (br + bw) / (est * 1e-9 * a.hardware.get("hbm_bytes_per_s", 1.0)) if est else 0.0,
            "fallback": any(e.get("fallback") for e in evs),
            "is_64bit": any(n.startswith("64-bit") for n in notes),
            "portability": ";".join(notes),
        })


def _modules(a: Analysis, devs: list) -> None:
    agg: dict[str, dict] = {}
    for e in devs:
        path = e.get("module") or "(no module)"
        m = agg.setdefault(path, {"module_path": path, "kernels": 0, "flops": 0, "bytes": 0,
                                  "est_ns": 0.0, "measured_device_ns": 0, "by_dtype": defaultdict(float)})
        m["kernels"] += 1
        m["flops"] += int(e.get("flops", 0))
        m["bytes"] += int(e.get("bytes_read", 0)) + int(e.get("bytes_written", 0))
        m["est_ns"] += float(e["est_ns"])
        m["measured_device_ns"] += e["end"] - e["start"]
        if int(e.get("flops", 0)):
            m["by_dtype"][e.get("dtype") or "bfloat16"] += int(e["flops"])
    for m in agg.values():
        bd = m.pop("by_dtype")
        dtype = max(bd, key=bd.get) if bd else "bfloat16"
        est = m["est_ns"]
        m["est_mfu"] = m["flops"] / (est * 1e-9 * a.peak(dtype)) if est else 0.0
        m["est_mbu"] = m["bytes"] / (est * 1e-9 * a.hardware.get("hbm_bytes_per_s", 1.0)) if est else 0.0
        m["depth"] = 0 if m["module_path"].startswith("(") else m["module_path"].count(".") + 1
        a.modules.append(m)
    a.modules.sort(key=lambda m: -m["est_ns"])


def _collectives(a: Analysis, devs: list) -> None:
    compute_by_dev: dict[int, list] = defaultdict(list)
    for e in devs:
        if e.get("kind") != "collective":
            compute_by_dev[int(e.get("device", 0))].append((int(e["est_start_ns"]), e["est_end_ns"]))
    merged = {d: _merge(v) for d, v in compute_by_dev.items()}
    for e in devs:
        if e.get("kind") != "collective":
            continue
        s, t = int(e["est_start_ns"]), e["est_end_ns"]
        covered = _overlap((s, t), merged.get(int(e.get("device", 0)), []))
        a.collectives.append({
            "name": e["name"], "collective": str(e.get("op", "")),
            "pg": e.get("pg", ""), "seq": int(e.get("seq", 0)), "group_size": int(e.get("group_size", 1)),
            "group_rank": int(e.get("group_rank", 0)), "rank": a.rank, "bytes": int(e.get("total_bytes", e.get("bytes", 0))),
            "dtype": e.get("cc_dtype", ""), "start_ts": e["start"], "end_ts": e["end"],
            "measured_ns": e["end"] - e["start"], "est_ns": float(e["est_ns"]),
            "est_start_ts": int(s), "est_end_ts": int(t), "exposed_ns": max(0.0, (t - s) - covered),
            "source": e.get("source", ""), "step": e.get("step", -1), "device": int(e.get("device", 0)),
        })


def _syncs(a: Analysis) -> None:
    for r in a.runtime_events:
        if r.get("kind") == "sync":
            a.syncs.append({"name": r["name"], "start_ts": r["start"], "measured_ns": r["end"] - r["start"],
                            "est_stall_ns": int(r.get("est_stall_ns", 0)), "device": int(r.get("device", 0)),
                            "source": r.get("source", ""), "function": r.get("function", ""),
                            "stack_frame_id": int(r.get("stack_id", -1))})
    for e in a.device_events:
        if e.get("blocking"):
            a.syncs.append({"name": e["name"] + " (blocking)", "start_ts": e["start"],
                            "measured_ns": e["end"] - e["start"],
                            "est_stall_ns": int(e.get("est_stall_ns", 0)), "device": int(e.get("device", 0)),
                            "source": e.get("source", ""), "function": e.get("function", ""),
                            "stack_frame_id": int(e.get("stack_id", -1))})


def _gaps(a: Analysis, devs: list, min_gap_ns: float = 2000.0) -> None:
    """Device idle stretches on the estimated timeline, charged to the next kernel's source."""
    by_q: dict[tuple, list] = defaultdict(list)
    for e in devs:
        if e.get("kind") != "collective":
            by_q[(int(e.get("device", 0)), int(e.get("stream", 0)))].append(e)
    agg: dict[tuple, dict] = {}
    for evs in by_q.values():
        evs.sort(key=lambda e: int(e["est_start_ns"]))
        for prev, cur in zip(evs, evs[1:]):
            gap = float(cur["est_start_ns"]) - prev["est_end_ns"]
            if gap < min_gap_ns:
                continue
            key = (cur.get("source", ""), cur.get("function", ""))
            g = agg.setdefault(key, {"source": key[0], "function": key[1], "gaps": 0, "gap_ns": 0.0,
                                     "next_kernel": cur["name"], "module": cur.get("module", "")})
            g["gaps"] += 1
            g["gap_ns"] += gap
    a.host_gaps = sorted(agg.values(), key=lambda g: -g["gap_ns"])


def _portability(a: Analysis, devs: list) -> None:
    agg: dict[tuple, dict] = {}
    for e in devs:
        for n in e.get("portability") or []:
            kind = n.split(":", 1)[0]
            key = (kind, n, e.get("source", ""), e["name"])
            p = agg.setdefault(key, {"kind": kind, "detail": n, "kernel": e["name"],
                                     "source": e.get("source", ""), "count": 0, "est_ns": 0.0})
            p["count"] += 1
            p["est_ns"] += float(e["est_ns"])
    for e in devs:
        if e.get("kind") == "memcpy" and e.get("copy") == "HtoD" and e.get("step", -1) >= 0:
            key = ("host-to-device", "HtoD copy in a step", e.get("source", ""), e["name"])
            p = agg.setdefault(key, {"kind": "host-to-device", "detail": "HtoD copy inside a step",
                                     "kernel": e["name"], "source": e.get("source", ""), "count": 0,
                                     "est_ns": 0.0})
            p["count"] += 1
            p["est_ns"] += float(e["est_ns"])
    a.portability = sorted(agg.values(), key=lambda p: (-p["count"], p["kind"]))


def _summary(a: Analysis) -> None:
    steps = a.steps[1:] if len(a.steps) > 2 else a.steps  # the first step warms up
    n = max(len(steps), 1)
    devs = [e for e in a.device_events if "est_ns" in e]
    hbm_peak = max((m["allocated"] for m in a.memory), default=0)
    a.summary = {
        "rank": a.rank, "world_size": a.world_size, "platform": a.hardware.get("platform", ""),
        "lnc": a.hardware.get("lnc", 0), "steps": len(a.steps),
        "measured_step_ns": sum(s["host_ns"] for s in steps) / n,
        "est_step_ns": sum(s["est_ns"] for s in steps) / n,
        "est_mfu": sum(s["est_mfu"] for s in steps) / n,
        "est_mbu": sum(s["est_mbu"] for s in steps) / n,
        "host_bound_fraction": sum(s["host_bound_fraction"] for s in steps) / n,
        "flops_per_step": sum(s["flops"] for s in steps) / n,
        "kernels_per_step": sum(s["kernels"] for s in steps) / n,
        "device_activities": len(devs),
        "est_device_ns": sum(float(e["est_ns"]) for e in devs),
        "measured_device_ns": sum(e["end"] - e["start"] for e in devs),
        "collective_exposed_ns": sum(c["exposed_ns"] for c in a.collectives),
        "sync_stall_ns": sum(s["est_stall_ns"] for s in a.syncs),
        "hbm_peak_allocated": hbm_peak, "hbm_capacity": a.hardware.get("hbm_bytes", 0),
        "ooms": len(a.ooms),
    }
