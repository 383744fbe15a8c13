"""Counters of the ``neuron`` torch.compile backend (``torch.neuron.get_dynamo_metrics()``).

Kept free of Dynamo imports so ``torch.neuron.get_dynamo_metrics()`` is cheap before any
compilation. Graph-break counts come from Dynamo's global counters (graph breaks happen
before a backend is chosen), measured since the last :func:`reset`.
"""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_FIELDS = (
    "compilations",        # Dynamo graphs handed to the neuron backend
    "recompilations",      # ... of which were recompiles of an already compiled frame
    "graphs_lowered",      # forward/backward/inference graphs through Inductor (incl. cache hits)
    "cache_hits",          # compiled graphs served from the on-disk cache (FX graph / AOT cache)
    "cache_misses",        # compiled graphs that had to be generated
    "eager_fallbacks",     # graphs run eagerly because compilation failed (TORCHNEURON_COMPILE_FALLBACK=1)
    "flex_attention_decomposed",  # FlexAttention calls lowered through the math (training) path
    "graphs_recorded",     # mode="reduce-overhead": compiled graphs recorded into neuron graphs
    "graph_replays",       # ... calls served by replaying one
    "graphs_not_recordable",  # ... compiled graphs that could not be recorded (run as compiled)
)
_counts: dict[str, int] = dict.fromkeys(_FIELDS, 0)
_compile_time = 0.0
_graph_break_base = 0


def _dynamo_graph_breaks() -> int:
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    return int(sum(utils.counters["graph_break"].values()))


def incr(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` (one of the documented fields)."""
    if name not in _counts:
        raise KeyError(f"unknown neuron compile metric {name!r}")
    with _lock:
        _counts[name] += n


def add_compile_time(seconds: float) -> None:
    """Account wall time spent compiling (Dynamo graph lowering, forward and backward)."""
    global _compile_time
    with _lock:
        _compile_time += seconds


def get() -> dict:
    """Snapshot of the metrics since the last :func:`reset`.

    Keys: ``compilations``, ``recompilations``, ``graphs_lowered``, ``cache_hits``,
    ``cache_misses``, ``eager_fallbacks``, ``flex_attention_decomposed``, ``graphs_recorded``,
    ``graph_replays``, ``graphs_not_recordable`` (``mode="reduce-overhead"``), ``graph_breaks``
    (Dynamo graph breaks in this process) and ``compile_time_s``.
    """
    with _lock:
        out: dict = dict(_counts)
        out["graph_breaks"] = _dynamo_graph_breaks() - _graph_break_base
        out["compile_time_s"] = round(_compile_time, 6)
    return out


def reset() -> None:
    """Zero every metric."""
    global _compile_time, _graph_break_base
    with _lock:
        for k in _counts:
            _counts[k] = 0
        _compile_time = 0.0
        _graph_break_base = _dynamo_graph_breaks()
