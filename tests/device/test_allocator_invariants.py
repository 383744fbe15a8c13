"""Allocator statistics are exact: random alloc / free / empty_cache / OOM / reset sequences on
two devices and two streams each give, after every step, the same ``memory_stats`` as an
independent model of the allocator's rules (tests/device/allocator_model.py)."""

import os

import pytest

from support import run_python

HERE = os.path.dirname(os.path.abspath(__file__))
# Two small devices, so that the sequences reach OOM and the retry that frees the cache.
ENV = {"NEURON_RT_VISIBLE_CORES": "0,1", "TORCHNEURON_DEVICE_MEMORY": "96MiB"}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_memory_stats_equal_the_allocator_model_after_every_step(seed):
    r = run_python(f"import sys; sys.path.insert(0, {HERE!r}); import allocator_model as m; "
                   f"m.replay({seed}, 400)", env=ENV, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"seed {seed}: 400 steps" in r.stdout


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_memory_stats_equal_the_model_with_expandable_segments(seed):
    """The same with PYTORCH_ALLOC_CONF=expandable_segments:True, switched off and on at run
    time along the way."""
    r = run_python(f"import sys; sys.path.insert(0, {HERE!r}); import allocator_model as m; "
                   f"m.replay({seed}, 400, expandable=True)",
                   env={**ENV, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"seed {seed}: 400 steps" in r.stdout
