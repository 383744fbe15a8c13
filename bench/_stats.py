"""Summaries every benchmark prints: the median over rounds with the spread (min-max).

Targets are judged on the median; the spread shows how much the shared host disturbed the run.
Ratios are computed per round from interleaved samples (both sides timed under the same load),
then summarised the same way.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

__all__ = ["timed", "interleaved", "summary", "ratios", "fmt", "fmt_ratio"]


def _wait_for_device() -> None:
    # The execution engine is on by default: a device op returns once its kernel is queued, so
    # a sample ends when the device has run what the calls queued (and starts after what earlier
    # samples queued). For CPU candidates the queue is empty: one check.
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def timed(fn: Callable[[], object], inner: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Mean time of one call of ``fn`` over ``inner`` calls, read on ``clock``, including the
    device work the calls queued."""
    _wait_for_device()
    start = clock()
    for _ in range(inner):
        fn()
    _wait_for_device()
    return (clock() - start) / inner


def interleaved(fns: dict, inner: int, rounds: int,
                clock: Callable[[], float] = time.perf_counter) -> dict:
    """Per-round samples of each candidate (after a warm-up), alternated round by round so that
    drift and noise from other processes hit all alike."""
    for fn in fns.values():
        timed(fn, max(1, inner // 4), clock)
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(timed(fn, inner, clock))
    return samples


def summary(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``samples``."""
    return statistics.median(samples), min(samples), max(samples)


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round ratios of two interleaved sample lists of equal length."""
    assert len(num) == len(den), (len(num), len(den))
    return [a / b for a, b in zip(num, den)]


def fmt(samples: Sequence[float], scale: float = 1e3, unit: str = "ms", digits: int = 2) -> str:
    """``median [min-max] unit`` of seconds scaled by ``scale``."""
    m, lo, hi = summary(samples)
    return f"{m * scale:.{digits}f} [{lo * scale:.{digits}f}-{hi * scale:.{digits}f}] {unit}"


def fmt_ratio(rs: Sequence[float], digits: int = 2) -> str:
    m, lo, hi = summary(rs)
    return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"
