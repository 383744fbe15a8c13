"""Summaries every benchmark prints: the median over rounds with the spread (min-max).

Targets are judged on the median; the spread shows how much the shared host disturbed the run.
Ratios are computed per round from interleaved samples (both sides timed under the same load),
then summarised the same way.
"""

from __future__ import annotations

import statistics
from typing import Sequence

__all__ = ["summary", "ratios", "fmt", "fmt_ratio"]


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
