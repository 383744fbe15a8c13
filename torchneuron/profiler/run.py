"""``torchneuron profile run [--steps A:B] script.py args...``: profile an unmodified script.

The script runs as ``__main__`` (like ``python script.py args...``) under ``torch.profiler``
with the neuron device activities, shapes and memory events recorded. Steps are the
optimizer's steps (a global ``Optimizer.step`` post-hook advances the profiler), so
``--steps A:B`` records steps A to B-1 (0-based) of a training loop; without ``--steps`` the
whole run is recorded, still split into steps where an optimizer steps. When the trace is
ready, this rank's Chrome trace (with the estimated Trainium track) and Parquet set go to
``OUT/rank_<r>/`` and rank 0 writes the report (``OUT/report.html``, ``OUT/report.md``).
"""

from __future__ import annotations

import os
import runpy
import sys
from dataclasses import dataclass

__all__ = ["parse_steps", "profile_script", "RunResult"]


@dataclass
class RunResult:
    out_dir: str
    rank_dir: str | None
    report: object | None  # torchneuron.profiler.report.Report on rank 0


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``"A:B"`` -> (A, B) with 0 <= A < B; None for the whole run."""
    if not text:
        return None
    try:
        a, b = text.split(":", 1)
        lo, hi = int(a or 0), int(b)
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A:B, e.g. 5:8 (steps 5, 6 and 7)") from None
    if lo < 0 or hi <= lo:
        raise ValueError(f"--steps {text!r}: need 0 <= A < B")
    return lo, hi


def _rank() -> int:
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def profile_script(script: str, args: list[str], out_dir: str = "neuron_profile",
                   steps: tuple[int, int] | None = None, report: bool = True) -> RunResult:
    """Run ``script`` with ``args`` under the profiler; see the module docstring."""
    import torch
    from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

    from .export_parquet import export_parquet

    if not os.path.isfile(script):
        raise FileNotFoundError(f"torchneuron profile run: no such script: {script!r}")
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    result = RunResult(out_dir, None, None)

    def on_ready(prof) -> None:
        result.rank_dir = export_parquet(prof, out_dir)
        if report and _rank() == 0:
            from .report import write_report

            result.report = write_report(out_dir)

    if steps is None:
        sched = lambda step: ProfilerAction.RECORD  # noqa: E731  (record every step, save at exit)
    else:
        lo, hi = steps
        sched = schedule(wait=max(lo - 1, 0), warmup=1 if lo > 0 else 0, active=hi - lo, repeat=1)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1], schedule=sched,
                   on_trace_ready=on_ready, record_shapes=True, profile_memory=True)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda *a, **k: prof.step())
    argv, path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        with prof:
            runpy.run_path(script, run_name="__main__")
    finally:
        handle.remove()
        sys.argv = argv
        if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(script)) and sys.path[0] != path0:
            sys.path.pop(0)
    return result
