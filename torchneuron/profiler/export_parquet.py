"""Parquet export with Neuron Explorer's table names (pyarrow).

``export_parquet(prof, dir)`` writes one set of tables per rank, ``dir/rank_<r>/<Table>.parquet``:

========================  =====================================================================
``SystemProfileEvents``   every trace event: CPU ops, annotations, launches, syncs, device
                          activities (measured) and their estimates, memory events
``FrameworkNode``         one row per framework op that ran device work, plus one per module
                          path and per step: FLOPs, bytes, engine, bound, measured and
                          estimated time, estimated MFU/MBU, fallback and 64-bit flags
``Instruction``           NKI instructions (engine, opcode, modelled start/end, bytes, FLOPs,
                          NKI source location) of the NKI kernels that ran
``CcOp``                  collectives: group, sequence, bytes, ranks, estimate, exposed time
``HbmUsage``              the device allocator's allocated/reserved bytes over time
``StackFrame``            the interned Python stacks other tables point to
``Summary``               per-rank totals: measured vs estimated step, MFU, MBU, host-bound share
``Metadata``              schema version, platform, LNC, HBM per core, the peaks used
========================  =====================================================================

Every file's Arrow schema carries ``torchneuron.schema_version``; columns are documented in
docs/profiling.md. A change that renames, removes or retypes a column bumps the major version.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .analysis import Analysis, analyze_trace, load_trace

__all__ = ["export_parquet", "read_parquet_set", "SCHEMAS", "SCHEMA_VERSION", "TABLES"]

SCHEMA_VERSION = "1.0"
TABLES = ("SystemProfileEvents", "FrameworkNode", "Instruction", "CcOp", "HbmUsage",
          "StackFrame", "Summary", "Metadata")


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - only without the extra
        raise ImportError("Parquet export needs pyarrow: pip install 'torchneuron[profiler]'") from exc
    return pa, pq


def _schemas() -> dict:
    pa, _ = _pa()
    i64, i32, f64, s, b = pa.int64(), pa.int32(), pa.float64(), pa.string(), pa.bool_()
    return {
        "SystemProfileEvents": [("id", i64), ("name", s), ("start_ts", i64), ("end_ts", i64),
                                ("duration_ns", i64), ("trace_event_source", s), ("process_id", i64),
                                ("thread_id", i64), ("nc_idx", i32), ("queue_id", i64),
                                ("correlation_id", i64), ("flow_id", i64), ("framework_stream_id", i64),
                                ("extra_attributes_json", s), ("rank", i32)],
        "FrameworkNode": [("node_id", i64), ("node_name", s), ("level", s), ("parent_name", s),
                          ("children", i64), ("kernels", s), ("module_path", s), ("phase", s),
                          ("step", i64), ("source", s), ("function", s), ("stack_frame_id", i64),
                          ("start_ts", i64), ("end_ts", i64), ("device", i32), ("input_dims", s),
                          ("input_types", s), ("dtype", s), ("flops", i64), ("bytes_read", i64),
                          ("bytes_written", i64), ("engine", s), ("bound", s),
                          ("measured_device_ns", i64), ("measured_host_ns", i64), ("est_ns", f64),
                          ("est_start_ts", i64), ("est_end_ts", i64), ("mfu", f64), ("mbu", f64),
                          ("fallback", b), ("is_64bit", b), ("portability", s), ("rank", i32)],
        "Instruction": [("nki_run", i64), ("kernel", s), ("start_ts", f64), ("end_ts", f64),
                        ("duration_ns", f64), ("engine", s), ("opcode", s), ("program", i32),
                        ("nki_source_location", s), ("bytes", i64), ("raw_flops", f64),
                        ("dtype", s), ("rank", i32)],
        "CcOp": [("name", s), ("collective", s), ("pg", s), ("seq", i64), ("group_size", i32),
                 ("group_rank", i32), ("rank", i32), ("bytes", i64), ("dtype", s),
                 ("start_ts", i64), ("end_ts", i64), ("measured_ns", i64), ("est_ns", f64),
                 ("est_start_ts", i64), ("est_end_ts", i64), ("exposed_ns", f64), ("source", s),
                 ("step", i64), ("device", i32)],
        "HbmUsage": [("ts", i64), ("device", i32), ("bytes", i64), ("allocated", i64),
                     ("reserved", i64), ("capacity", i64), ("event", s), ("rank", i32)],
        "StackFrame": [("stack_frame_id", i64), ("depth", i32), ("file", s), ("line", i64),
                       ("function", s), ("rank", i32)],
        "Summary": [(k, t) for k, t in (
            ("rank", i32), ("world_size", i32), ("platform", s), ("lnc", i32), ("steps", i64),
            ("measured_step_ns", f64), ("est_step_ns", f64), ("est_mfu", f64), ("est_mbu", f64),
            ("host_bound_fraction", f64), ("flops_per_step", f64), ("kernels_per_step", f64),
            ("device_activities", i64), ("est_device_ns", f64), ("measured_device_ns", i64),
            ("collective_exposed_ns", f64), ("sync_stall_ns", i64), ("hbm_peak_allocated", i64),
            ("hbm_capacity", i64), ("ooms", i64))],
        "Metadata": [("key", s), ("value", s), ("rank", i32)],
    }


def __getattr__(name: str) -> Any:
    if name == "SCHEMAS":
        return _schemas()
    raise AttributeError(name)


def _source_of(cat: str, args: dict) -> str:
    if cat == "kernel":
        kind = args.get("kind", "kernel")
        return "collective" if kind == "collective" else kind
    return {"gpu_memcpy": "memcpy", "gpu_memset": "memset", "cpu_op": "cpu_op",
            "user_annotation": "annotation", "python_function": "python",
            "neuron_estimate": "est_kernel", "cpu_instant_event": "memory"}.get(
        cat, "sync" if args.get("kind") == "sync" else "runtime" if cat == "privateuse1_runtime" else cat)


def _int(v: Any, default: int = -1) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _system_events(trace: dict, rank: int) -> list:
    base = int(trace.get("baseTimeNanoseconds", 0))
    rows = []
    for i, ev in enumerate(trace.get("traceEvents", ())):
        ph = ev.get("ph")
        if ph not in ("X", "i"):
            continue
        cat = ev.get("cat", "")
        if cat in ("Trace", "ac2g"):
            continue
        args = ev.get("args") or {}
        start = base + int(round(float(ev.get("ts", 0)) * 1000))
        dur = int(round(float(ev.get("dur", 0)) * 1000))
        src = _source_of(cat, args)
        if ev.get("name") == "[OutOfMemory]":
            src = "oom"
        device_like = cat in ("kernel", "gpu_memcpy", "gpu_memset", "neuron_estimate")
        rows.append({
            "id": i, "name": ev.get("name", ""), "start_ts": start, "end_ts": start + dur,
            "duration_ns": dur, "trace_event_source": src, "process_id": _int(ev.get("pid")),
            "thread_id": _int(ev.get("tid")),
            "nc_idx": _int(args.get("device"), -1) if device_like or "device" in args else -1,
            "queue_id": _int(args.get("stream", args.get("queue")), -1),
            "correlation_id": _int(args.get("correlation", args.get("External id", args.get("measured_correlation"))), -1),
            "flow_id": _int(args.get("correlation"), -1) if cat in ("kernel", "gpu_memcpy", "gpu_memset", "privateuse1_runtime") else -1,
            "framework_stream_id": _int(args.get("stream"), -1),
            "extra_attributes_json": json.dumps(args, default=str), "rank": rank,
        })
    return rows


def _nodes(a: Analysis) -> list:
    rows = []
    for n in a.framework_nodes:
        rows.append({**{k: n[k] for k in n if k not in ("est_mfu", "est_mbu", "kernel_count", "top_op")},
                     "level": "op", "children": n["kernel_count"], "mfu": n["est_mfu"],
                     "mbu": n["est_mbu"], "rank": a.rank})
    nid = len(rows)
    for m in a.modules:
        nid += 1
        parent = m["module_path"].rsplit(".", 1)[0] if "." in m["module_path"] else ""
        rows.append(_blank(nid, m["module_path"], "module", a.rank) | {
            "parent_name": parent, "children": m["kernels"], "module_path": m["module_path"],
            "flops": m["flops"], "bytes_read": m["bytes"], "measured_device_ns": m["measured_device_ns"],
            "est_ns": m["est_ns"], "mfu": m["est_mfu"], "mbu": m["est_mbu"]})
    for st in a.steps:
        nid += 1
        rows.append(_blank(nid, st["name"], "step", a.rank) | {
            "step": st["step"], "children": st["kernels"], "start_ts": st["start_ts"],
            "end_ts": st["end_ts"], "flops": st["flops"], "bytes_read": st["bytes"],
            "measured_device_ns": st["measured_device_ns"], "measured_host_ns": st["host_ns"],
            "est_ns": st["est_ns"], "mfu": st["est_mfu"], "mbu": st["est_mbu"], "dtype": st["mfu_dtype"]})
    return rows


def _blank(nid: int, name: str, level: str, rank: int) -> dict:
    return {"node_id": nid, "node_name": name, "level": level, "parent_name": "", "children": 0,
            "kernels": "", "module_path": "", "phase": "", "step": -1, "source": "", "function": "",
            "stack_frame_id": -1, "start_ts": 0, "end_ts": 0, "device": -1, "input_dims": "[]",
            "input_types": "[]", "dtype": "", "flops": 0, "bytes_read": 0, "bytes_written": 0,
            "engine": "", "bound": "", "measured_device_ns": 0, "measured_host_ns": 0, "est_ns": 0.0,
            "est_start_ts": 0, "est_end_ts": 0, "mfu": 0.0, "mbu": 0.0, "fallback": False,
            "is_64bit": False, "portability": "", "rank": rank}


def _instructions(a: Analysis, trace: dict) -> list:
    from . import _session

    info = trace.get("neuron_profiler") or {}
    if isinstance(info, str):
        info = json.loads(info)
    runs = info.get("nki_runs", [])
    rows = []
    for run in runs:
        entry = _session.nki_runs.get(int(run))
        if entry is None:
            continue
        kernel, bench = entry
        for ev in bench.events:
            ins = ev.instr
            loc = getattr(ins, "loc", None)
            rows.append({"nki_run": int(run), "kernel": kernel, "start_ts": ev.start * 1e9,
                         "end_ts": ev.end * 1e9, "duration_ns": (ev.end - ev.start) * 1e9,
                         "engine": ev.track, "opcode": ins.op, "program": int(ev.program),
                         "nki_source_location": f"{loc[0]}:{loc[1]}" if loc else "",
                         "bytes": int(ev.nbytes), "raw_flops": float(ins.flops or 0),
                         "dtype": str(getattr(ins, "dtype", "") or ""), "rank": a.rank})
    return rows


def _hbm(a: Analysis) -> list:
    cap = int(a.hardware.get("hbm_bytes", 0))
    rows = [{**m, "capacity": cap, "event": "alloc" if m["bytes"] >= 0 else "free", "rank": a.rank}
            for m in a.memory]
    rows += [{"ts": o["ts"], "device": o["device"], "bytes": o["bytes"], "allocated": o["allocated"],
              "reserved": o["reserved"], "capacity": cap, "event": "oom", "addr": 0, "rank": a.rank}
             for o in a.ooms]
    for r in rows:
        r.pop("addr", None)
    return sorted(rows, key=lambda r: r["ts"])


def _stacks(a: Analysis) -> list:
    rows = []
    for sid, frames in sorted(a.stacks.items()):
        for depth, (f, line, func) in enumerate(frames):
            rows.append({"stack_frame_id": sid, "depth": depth, "file": f, "line": int(line),
                         "function": func, "rank": a.rank})
    return rows


def _metadata(a: Analysis) -> list:
    import torch

    from .. import __version__

    rows = {"schema_version": SCHEMA_VERSION, "trace_schema_version": a.schema_version,
            "platform": a.hardware.get("platform", ""), "chip": a.hardware.get("chip", ""),
            "lnc": a.hardware.get("lnc", ""), "label": a.label,
            "hbm_bytes_per_core": a.hardware.get("hbm_bytes", ""),
            "rank": a.rank, "world_size": a.world_size, "torch_version": torch.__version__,
            "torchneuron_version": __version__}
    for k, v in a.hardware.items():
        rows.setdefault(k, v)
    return [{"key": k, "value": json.dumps(v) if not isinstance(v, str) else v, "rank": a.rank}
            for k, v in rows.items()]


def _table(name: str, rows: list):
    pa, _ = _pa()
    fields = _schemas()[name]
    schema = pa.schema([pa.field(n, t) for n, t in fields],
                       metadata={"torchneuron.schema_version": SCHEMA_VERSION,
                                 "torchneuron.table": name})
    cols = {n: [r.get(n) for r in rows] for n, _ in fields}
    return pa.Table.from_pydict(cols, schema=schema)


def _rank_of(trace: dict, rank: int | None) -> int:
    if rank is not None:
        return int(rank)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover
        pass
    return int((trace.get("distributedInfo") or {}).get("rank", 0) or 0)


def export_parquet(source: Any, directory: str, rank: int | None = None) -> str:
    """Write the Parquet set of one rank and return its directory (``directory/rank_<r>``).

    ``source``: a finished ``torch.profiler.profile``, a Chrome trace dict, or a trace file
    path. From a live profiler, the Chrome trace (with the estimated track) is written next to
    the tables as ``trace.json``.
    """
    _pa()
    if isinstance(source, dict):
        trace = source
    elif isinstance(source, (str, os.PathLike)):
        trace = load_trace(os.fspath(source))
    else:
        tmp = os.path.join(directory, f".trace-tmp-{os.getpid()}.json")
        os.makedirs(directory, exist_ok=True)
        source.export_chrome_trace(tmp)
        trace = load_trace(tmp)
        r = _rank_of(trace, rank)
        out = os.path.join(directory, f"rank_{r}")
        os.makedirs(out, exist_ok=True)
        os.replace(tmp, os.path.join(out, "trace.json"))
    from .trace import add_estimated_track

    add_estimated_track(trace)
    r = _rank_of(trace, rank)
    a = analyze_trace(trace)
    a.rank = r
    a.summary["rank"] = r
    for lst in (a.framework_nodes, a.collectives):
        for row in lst:
            row["rank"] = r
    out = os.path.join(directory, f"rank_{r}")
    os.makedirs(out, exist_ok=True)
    _, pq = _pa()
    tables = {
        "SystemProfileEvents": _system_events(trace, r),
        "FrameworkNode": _nodes(a),
        "Instruction": _instructions(a, trace),
        "CcOp": a.collectives,
        "HbmUsage": _hbm(a),
        "StackFrame": _stacks(a),
        "Summary": [a.summary],
        "Metadata": _metadata(a),
    }
    for name, rows in tables.items():
        pq.write_table(_table(name, rows), os.path.join(out, f"{name}.parquet"))
    # The analysis' extra findings (host gaps, syncs, portability) for the report.
    with open(os.path.join(out, "findings.json"), "w") as f:
        json.dump({"host_gaps": a.host_gaps, "syncs": a.syncs, "portability": a.portability,
                   "modules": a.modules, "steps": a.steps, "schema_version": SCHEMA_VERSION}, f)
    return out


def read_parquet_set(directory: str) -> dict:
    """Read one rank's tables back: ``{table name: pyarrow.Table}``."""
    _, pq = _pa()
    return {name: pq.read_table(os.path.join(directory, f"{name}.parquet")) for name in TABLES
            if os.path.exists(os.path.join(directory, f"{name}.parquet"))}
