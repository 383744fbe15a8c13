"""The performance model is pinned: every NKI-lib kernel (docs/nkilib.md shapes, LNC=1, and a set
at LNC=2) and every tutorial kernel models to its committed latency, instruction count, DMA
bytes and TensorE FLOPs on trn2 and trn3. Intended changes regenerate the figures with
``python tools/perf_golden.py --write`` (see that script)."""

import json
import os
import re
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import perf_golden  # noqa: E402

GOLDEN = json.load(open(perf_golden.GOLDEN))
CASES = {c[0]: c for c in perf_golden.all_cases()}


def test_golden_file_covers_every_case():
    assert set(GOLDEN) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_modelled_figures_equal_the_golden_ones(name):
    for platform in perf_golden.PLATFORMS:
        got = perf_golden.measure(CASES[name], platform)
        want = GOLDEN[name][platform]
        assert got["instructions"] == want["instructions"], (platform, got, want)
        assert got["dma_bytes"] == want["dma_bytes"], (platform, got, want)
        assert got["flops"] == want["flops"], (platform, got, want)
        assert got["latency_us"] == pytest.approx(want["latency_us"], rel=1e-9, abs=1e-6), (platform, got, want)


def test_docs_nkilib_table_shows_the_golden_latencies():
    table = open(os.path.join(ROOT, "docs", "nkilib.md")).read()
    rows = re.findall(r"^\| ([^|]+?) \| (trn[23]) \| ([0-9.]+) \|", table, re.M)
    assert rows, "docs/nkilib.md has no modelled-performance table"
    for name, platform, latency in rows:
        assert name in GOLDEN, f"docs/nkilib.md row {name!r} is not a golden case"
        assert float(latency) == pytest.approx(GOLDEN[name][platform]["latency_us"], abs=0.051), (
            name, platform)
