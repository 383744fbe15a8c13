"""Fixtures for the torch.compile backend tests.

The whole session uses one fresh compile cache directory (unless TORCHNEURON_COMPILE_CACHE_DIR
is set), so results never depend on artifacts left by earlier runs. The backend is
registered explicitly in case the package's entry point is not installed yet; the entry point
itself is checked in a subprocess by test_registration.py.
"""

import os
import shutil
import tempfile

import pytest

_OWN_CACHE = None
if not os.environ.get("TORCHNEURON_COMPILE_CACHE_DIR"):
    _OWN_CACHE = tempfile.mkdtemp(prefix="tn-compile-")
    os.environ["TORCHNEURON_COMPILE_CACHE_DIR"] = _OWN_CACHE

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

import torchneuron.compile as tnc  # noqa: E402

tnc.install_import_hooks()
tnc.register()


@pytest.fixture
def metrics():
    """Zeroed neuron compile metrics; returns a callable giving the current snapshot."""
    torch.neuron.reset_dynamo_metrics()
    return torch.neuron.get_dynamo_metrics


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
