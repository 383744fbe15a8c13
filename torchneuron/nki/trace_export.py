"""Chrome / Perfetto trace export of a modelled kernel run (one track per engine and queue)."""

from __future__ import annotations

import json
import os

_ORDER = {"tensor": 0, "vector": 1, "scalar": 2, "gpsimd": 3}


def _tid(track: str) -> int:
    if track in _ORDER:
        return _ORDER[track]
    return 10 + int(track[3:])  # dma<q>


def _name(track: str) -> str:
    return {"tensor": "TensorE", "vector": "VectorE", "scalar": "ScalarE",
            "gpsimd": "GpSimdE"}.get(track, f"DMA queue {track[3:]}")


def chrome_trace(events: list, platform: str) -> dict:
    """The trace as a dict in the Chrome trace-event format (timestamps in microseconds)."""
    out = []
    seen = set()
    for ev in events:
        pid, tid = ev.program, _tid(ev.track)
        if (pid, None) not in seen:
            seen.add((pid, None))
            out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                        "args": {"name": f"{platform} NeuronCore (program {pid})"}})
        if (pid, tid) not in seen:
            seen.add((pid, tid))
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                        "args": {"name": _name(ev.track)}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid}})
        ins = ev.instr
        args = {"cycles": ins.cycles} if ins.engine != "dma" else {"bytes": ev.nbytes}
        if ins.loc:
            args["source"] = f"{os.path.basename(ins.loc[0])}:{ins.loc[1]}"
        if ins.flops:
            args["flops"] = ins.flops
        out.append({"ph": "X", "name": ins.op, "cat": ins.engine, "pid": pid, "tid": tid,
                    "ts": ev.start * 1e6, "dur": max(ev.end - ev.start, 0.0) * 1e6, "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ns"}


def write_chrome_trace(events: list, path: str, platform: str) -> str:
    """Write the trace JSON to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
    with open(path, "w") as f:
        json.dump(chrome_trace(events, platform), f)
    return path
