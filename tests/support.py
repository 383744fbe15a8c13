"""Helpers shared by the tests (importable as ``support``; tests/ is on pytest's pythonpath)."""

import os
import pathlib
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (topology and autoload are per process)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)


def vllm_cache_root(tmp_path) -> str:
    """A fresh VLLM_CACHE_ROOT under ``tmp_path`` whose ``modelinfos`` is shared by every vLLM
    run of the session (the directory next to ``tmp_path``'s). Without an entry there, vLLM
    inspects a model architecture in a subprocess of its own that imports torch and vLLM (10-20
    s); entries are keyed by the model module's hash. The compile caches stay per run."""
    root = pathlib.Path(tmp_path) / "vllm-cache"
    root.mkdir()
    shared = pathlib.Path(tmp_path).parent / "vllm-modelinfos"
    shared.mkdir(exist_ok=True)
    (root / "modelinfos").symlink_to(shared, target_is_directory=True)
    return str(root)


# The kernels of csrc/backend/random.cpp, as torchneuron's op tracking names them. An op that ran
# one draws from neuron's Philox generator, whose numbers differ from CPU's by design.
RANDOM_KERNELS = frozenset(f"aten::{k}" for k in (
    "uniform_", "normal_", "log_normal_", "exponential_", "cauchy_", "geometric_", "random_",
    "bernoulli_", "native_dropout", "randperm", "multinomial", "_standard_gamma",
    "_sample_dirichlet", "poisson", "binomial"))


def ran_random_kernel() -> bool:
    """Whether a neuron random kernel ran since the last ``torchneuron.clear_op_tracking()``."""
    import torchneuron

    return bool(RANDOM_KERNELS & set(torchneuron.get_executed_ops()))


def _extract_test_fn_from_frames():
    """``common_utils.extract_test_fn`` without reading source files: the same search (the
    innermost frame whose ``self`` is a unittest.TestCase running a test method), over
    ``sys._getframe`` instead of ``inspect.stack()``."""
    import unittest

    try:
        frame = sys._getframe(1)
        while frame is not None:
            self_val = frame.f_locals.get("self")
            if isinstance(self_val, unittest.TestCase):
                *_, cls_name, test_name = self_val.id().rsplit(".", 2)
                if cls_name == type(self_val).__name__ and test_name.startswith("test"):
                    return getattr(self_val, test_name).__func__
            frame = frame.f_back
    except Exception:
        pass
    return None


def use_fast_opinfo_input_tracking() -> None:
    """Make PyTorch's OpInfo sample generators cheap to start under pytest.

    Each ``op.sample_inputs(...)`` looks up the running test (twice) with ``inspect.stack()``,
    which reads the source lines of every frame; ``inspect.getmodule`` scans all of
    ``sys.modules`` per frame, so in a worker that collected the whole suite (vLLM, transformers,
    ...) one lookup takes ≈ 0.37 s, most of an OpInfo test's time. The replacement returns the
    same function (or None, as for every pytest-style test), so sample seeds and failure reports
    do not change."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    # opinfo.core imported the function by name (its sample callback calls it once per test)
    for module in (common_utils, core):
        assert hasattr(module, "extract_test_fn"), module.__name__
        module.extract_test_fn = _extract_test_fn_from_frames


def fp32_ulp(ref64):
    """One fp32 ULP at |ref64| (a float64 tensor of exact values): the unit the compiled
    kernels' fast math (tanh, erf) is measured in."""
    import torch

    ref = ref64.float().abs()
    return (torch.nextafter(ref, torch.tensor(float("inf"))) - ref).double()
