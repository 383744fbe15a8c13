"""torchneuron.profiler: the neuron device in torch.profiler, estimated Trainium time,
Parquet export and the bottleneck report. See docs/profiling.md.

Profile as on any device; ``ProfilerActivity.PrivateUse1`` adds the device timeline::

    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        model(x).sum().backward()
    prof.export_chrome_trace("trace.json")   # device queues + "Trainium2 (estimated)" track
    torchneuron.profiler.export_parquet(prof, "out/")  # Neuron Explorer-style tables
"""

from __future__ import annotations

from .. import _C

__all__ = ["set_options", "options"]


def set_options(*, source: bool | None = None) -> None:
    """Profiler options. ``source``: capture the Python launch site of every device activity
    (file:line, function; about a microsecond per kernel while recording; default on)."""
    if source is not None:
        _C._profiler_set_source_capture(bool(source))


def options() -> dict:
    """The current options."""
    return {"source": _C._profiler_source_capture()}
