"""NKI kernels as device activities.

An ``@nki.jit`` kernel called on neuron tensors runs on the NKI simulator (host code). While a
profiler session records neuron activities, :func:`begin` / :func:`end` wrap that call into
one device activity named ``nki::<kernel>``: the host staging copies the simulator needs are
not device work and are not recorded, and the activity's estimate is the NKI performance
model's latency for the instruction stream that ran (``perf_model.analyze``). The scheduled
instructions are kept for the Parquet ``Instruction`` table.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from .. import _C

__all__ = ["begin", "end", "cancel"]

_run_ids = itertools.count(1)


def begin(fn: Any, tensors: list, device: Any) -> Any:
    """Start the activity of an NKI launch; None when nothing records (one C call)."""
    if not _C._trace_active() or getattr(device, "type", "cpu") != "neuron":
        return None
    name = "nki::" + getattr(fn, "__name__", "kernel")
    act = _C._Activity(4, name, device.index if device.index is not None else -1)
    act.tensors([t for t in tensors if t.device.type == "neuron"], False)
    act.begin()
    _C._trace_suppress(True)
    return act


def end(act: Any, fn: Any, result: Any, outputs: list) -> None:
    """Finish the activity with the performance model's figures for ``result`` (a RunResult)."""
    _C._trace_suppress(False)
    from ..nki.perf_model import analyze
    from . import _session

    bench = analyze(result.programs, result.platform, None, max(result.peak_sbuf, default=0))
    run = next(_run_ids)
    _session.nki_runs[run] = ("nki::" + getattr(fn, "__name__", "kernel"), bench)
    act.tensors([t for t in outputs if getattr(t, "device", None) is not None
                 and t.device.type == "neuron"], True)
    meta = [("nki_latency_us", json.dumps(bench.latency_us)), ("nki_flops", json.dumps(bench.flops)),
            ("nki_dtype", json.dumps(_torch_dtype_name(bench.matmul_dtype))),
            ("nki_mfu", json.dumps(bench.mfu)), ("nki_dma_bytes", json.dumps(bench.dma_bytes)),
            ("nki_instructions", json.dumps(bench.instructions)), ("nki_run", json.dumps(run)),
            ("nki_platform", json.dumps(bench.platform)),
            ("nki_engine_busy_us", json.dumps(bench.engine_busy_us))]
    act.end(meta, int(bench.dma_bytes))


def cancel(act: Any) -> None:
    """The launch failed: drop the activity."""
    _C._trace_suppress(False)
    act.cancel()


def _torch_dtype_name(nki_dtype: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn",
            "fp8_e5m2": "float8_e5m2"}.get(str(nki_dtype), str(nki_dtype))
